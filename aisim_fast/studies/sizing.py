"""Cluster sizing: the cheapest deployment (fewest GPUs) of a base payload that meets an
SLA (``report.sla``) at a trace's load, found with batched sweeps.

The search space is the product of *shapes* (the choices of ``SizingSpace``: backend,
tensor parallelism with op-level timing, ``max_num_seqs``, ``max_num_batched_tokens``)
and *sizes* (the worker count of an aggregated pool, the prefill / decode worker pair of
a disaggregated one), bounded by a worker and a GPU budget. A candidate's cost is its
GPUs (workers x tensor parallelism, both pools).

When the space holds at most ``EXHAUSTIVE_LIMIT`` candidates every one is run. Otherwise
the search is pruned: a coarse grid (sizes at powers of two) of every shape in one
sweep, then, for every shape with a feasible coarse point, every size cheaper than the
best feasible coarse point found so far and dearer than half of that shape's own best
in a second sweep. It assumes that a shape infeasible at some size is infeasible at
every size of at most that many GPUs below its cheapest feasible coarse point's half;
inside the refined range it assumes nothing. Ties in GPUs go to the earlier shape (in
the order the choices were given), then the fewer prefill workers.

``--rates`` sizes for several offered loads at once (``rate_edits``: a trace's
``traffic.arrival_speedup_ratio``, a synthetic load's rate).
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from aisim_fast.config import speculation
from aisim_fast.config.payload import ConfigError, parse_payload, read_payload_file, set_aic_timing
from aisim_fast.io.progress import Progress
from aisim_fast.report.cost import COST_COLUMNS, load_prices, pool_system, price_of
from aisim_fast.report.sla import Sla, parse_sla, parse_sla_text
from aisim_fast.studies.sweeps import SweepError, run_sweep
from aisim_fast.trace.workload import TraceError

PREFILL = "spec.topology.prefill.initial_workers"
DECODE = "spec.topology.decode.initial_workers"
WORKERS = "spec.topology.workers.initial_workers"
RATE = "traffic.arrival_speedup_ratio"
EXHAUSTIVE_LIMIT = 48
SIZING_PARQUET = "sizing.parquet"
ANSWER_JSON = "answer.json"
REPLICAS_PARQUET = "replicas.parquet"   # size --window-s: one row per window
REPLICAS_PNG = "replicas.png"
SIZING_PNG = "sizing.png"               # every candidate against the SLA
REPORT_HTML = "report.html"
SIZING_FILES = (SIZING_PARQUET, ANSWER_JSON, REPLICAS_PARQUET, REPLICAS_PNG, SIZING_PNG, REPORT_HTML)
# a shape axis -> the payload paths it sets (a disaggregated payload: both pools' ranks)
_RANK_FIELDS = {"backend": "backend", "max_num_seqs": "max_num_seqs",
                "max_num_batched_tokens": "max_num_batched_tokens"}


@dataclass(frozen=True)
class SizingSpace:
    """The choices a search may make besides the sizes (an empty tuple: the base's)."""
    backend: tuple = ()
    tp: tuple = ()
    max_num_seqs: tuple = ()
    max_num_batched_tokens: tuple = ()
    prefill_system: tuple = ()      # GPU systems of a disaggregated base's pools (op-level timing)
    decode_system: tuple = ()
    # speculative decoding schemes (``config.speculation`` choices: "none", "mtp:2@1.4", ...);
    # beyond the reference, whose recommend does not search speculation
    speculation: tuple = ()

    def axes(self) -> list[tuple[str, tuple]]:
        return [(name, getattr(self, name)) for name in ("backend", "tp", "max_num_seqs",
                                                          "max_num_batched_tokens", "prefill_system",
                                                          "decode_system", "speculation")
                if getattr(self, name)]

    def shapes(self) -> list[dict]:
        axes = self.axes()
        return [dict(zip([a for a, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]


@dataclass(frozen=True)
class Confidence:
    """Judge a candidate over ``runs`` variants instead of one run: it is feasible when
    at least ``fraction`` of them meet the SLA. Variant i uses placement seed
    ``seed + i`` (a random or kv_router placement; round robin has no seed) and, with
    ``timing_pct`` > 0, every pass time scaled by one factor drawn uniformly in
    [1 - k %, 1 + k %] (the ranks' ``speedup_ratio``: a systematic timing-model error)."""
    fraction: float
    runs: int = 8
    timing_pct: float = 0.0
    seed: int = 0

    def factors(self) -> list[float]:
        import numpy as np

        if self.timing_pct <= 0:
            return [1.0] * self.runs
        rng = np.random.default_rng(self.seed)
        k = self.timing_pct / 100.0
        return [float(f) for f in rng.uniform(1.0 - k, 1.0 + k, self.runs)]


@dataclass(frozen=True)
class SizingAnswer:
    rate: float                 # arrival speedup ratio sized for
    feasible: bool
    gpus: int | None            # of the cheapest feasible deployment
    deployment: dict            # its sizes ({WORKERS: n} or {PREFILL: p, DECODE: d}) and shape
    evidence: pd.DataFrame      # every candidate run: sizes, shape, GPUs, verdict, metrics
    closest: dict = field(default_factory=dict)  # infeasible: the nearest candidate and why it failed
    search: str = "pruned"      # "exhaustive" or "pruned"


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v < limit:
        out.append(v)
        v *= 2
    return out + [limit] if limit >= 1 else []


def size(payload: dict | str | Path, sla: Sla | dict | str, *, base_dir=None, trace: str | None = None,
         max_workers: int = 64, max_gpus: int | None = None, rates=(None,),
         space: SizingSpace | None = None, timing: dict | None = None, goodput: float | None = None,
         jobs: int = 1, quiet: bool = True, exhaustive: bool | None = None,
         objective: str = "gpus", prices=None, confidence: Confidence | None = None,
         say=None) -> list[SizingAnswer]:
    """Size the base ``payload`` (an execution payload, or its .json / .yaml file) for
    ``sla`` (``report.sla`` terms: an ``Sla``, their mapping or their ``k=v,..`` text;
    ``goodput`` the default fraction); one answer per rate (None: the payload's own).
    ``timing``: {model, system, tp, backend_version} of op-level timing for every point
    (``config.set_aic_timing``); a ``space.tp`` choice overrides its tp. ``exhaustive``:
    None decides by the space's size. ``objective``: "gpus" (fewest GPUs) or "cost"
    (cheapest per hour at ``prices``, ``report.cost.load_prices``'s table or file).
    ``confidence``: judge each candidate over seeded variants (``Confidence``). ``say``: a callable given one line per search phase (progress)."""
    if objective not in ("gpus", "cost"):
        raise SweepError(f"objective: must be gpus or cost, got {objective!r}")
    prices = load_prices(prices)
    if isinstance(payload, (str, Path)):
        path = Path(payload)
        payload = read_payload_file(path)
        base_dir = base_dir or path.resolve().parent
    if not isinstance(sla, Sla):
        sla = parse_sla_text(sla, "sla", goodput) if isinstance(sla, str) else parse_sla(sla, "sla", goodput)
    if max_workers < 1:
        raise SweepError(f"max_workers: must be >= 1, got {max_workers!r}")
    if max_gpus is not None and max_gpus < 1:
        raise SweepError(f"max_gpus: must be >= 1, got {max_gpus!r}")
    if sla.empty:
        raise SweepError("sla: give at least one bound")
    space = space or SizingSpace()
    if (space.tp or space.prefill_system or space.decode_system) and not (timing or _has_aic(payload)):
        raise SweepError("tp: a tensor-parallel choice needs op-level timing (--model and --system, "
                         "or an AIC timing model in the payload)" if space.tp else
                         "prefill_system / decode_system: need op-level timing (--model and --system, "
                         "or an AIC timing model in the payload)")
    base_dir = str(Path(base_dir or ".").resolve())
    trace = str(Path(trace).resolve()) if trace is not None else None
    setup = parse_payload(payload, base_dir, trace)  # (the one parse of the base)
    if confidence is not None:
        _check_confidence(confidence, setup)
    if setup.from_trace_file:  # one clear error, not a trace_error on every candidate
        where = Path(setup.trace_path)
        if not where.is_file():
            raise TraceError(str(where), None, "trace file not found" if not where.exists() else "not a file")
    shapes = space.shapes() or [{}]
    candidates = _candidates(payload, base_dir, trace, setup.disaggregated, shapes, max_workers,
                             max_gpus, timing or {}, prices if objective == "cost" else None)
    if not candidates:
        raise SweepError(f"no candidate fits the budget (max_workers {max_workers}"
                         + (f", max_gpus {max_gpus}" if max_gpus is not None else "") + ")")
    if exhaustive is None:
        exhaustive = len(candidates) <= EXHAUSTIVE_LIMIT
    say = say or (lambda line: None)
    answers = []
    for rate in rates:
        effective = float(rate) if rate is not None else float(setup.arrival_speedup_ratio)
        search = _Search(payload, setup.disaggregated, base_dir, trace, sla, rate_edits(setup, rate),
                         timing or {}, jobs, quiet, say, prices, confidence)
        answers.append(search.run(candidates, exhaustive, effective))
    return answers


def rate_edits(setup, rate) -> dict:
    """The payload fields that offer ``rate`` times the base's load (None: the base's
    own, no edit): a trace's arrivals sped up (``traffic.arrival_speedup_ratio``); a
    synthetic poisson load's ``request_rate`` or a constant rate's ``arrival_interval_ms``
    scaled. A closed loop (concurrency, kv_capacity_fraction) has no arrival rate."""
    if rate is None:
        return {}
    load = setup.synthetic
    if load is None:
        return {RATE: float(rate)}
    if load.load_type == "poisson":
        return {"traffic.request_rate": load.request_rate * float(rate)}
    if load.load_type == "constant_rate":
        return {"traffic.arrival_interval_ms": load.arrival_interval_ms / float(rate)}
    raise SweepError(f"rates: a synthetic {load.load_type} load is a closed loop, with no arrival rate to "
                     "scale; sweep its traffic.concurrency (or kv_load_ratio) instead")


def _check_confidence(confidence: Confidence, setup) -> None:
    if not 0 < confidence.fraction <= 1:
        raise SweepError(f"confidence: must be a fraction in (0, 1], got {confidence.fraction!r}")
    if confidence.runs < 2:
        raise SweepError(f"confidence runs: must be >= 2, got {confidence.runs!r}")
    if not 0 <= confidence.timing_pct < 100:
        raise SweepError(f"timing perturbation: must be a percentage in [0, 100), got {confidence.timing_pct!r}")
    if confidence.timing_pct == 0 and setup.placement not in ("random", "kv_router"):
        raise SweepError("confidence: the runs would be identical (round-robin placement, no timing "
                         "perturbation); give a timing perturbation or a random / kv_router placement")


def _has_aic(payload: dict) -> bool:
    engine = payload.get("spec", {}).get("engine", {})
    blocks = [engine, engine.get("prefill") or {}, engine.get("decode") or {}]
    return any(((b.get("rank") or {}).get("timing_model") or {}).get("provider") == "aic" for b in blocks)


@dataclass(frozen=True)
class _Candidate:
    shape_index: int
    shape: tuple            # ((axis, value), ...)
    sizes: tuple            # (workers,) or (prefill, decode)
    gpus: int
    cost: float             # what the search minimizes: GPUs, or USD per hour


def _candidates(payload, base_dir, trace, disaggregated, shapes, max_workers, max_gpus, timing,
                prices) -> list:
    """Every (shape, sizes) within the budgets, with its GPUs and cost (``prices`` None:
    the cost is the GPUs); a shape the payload parser refuses is refused here, naming
    the shape."""
    out = []
    for index, shape in enumerate(shapes):
        shaped = _shaped(payload, shape, timing, disaggregated)
        try:
            setup = parse_payload(shaped, base_dir, trace)
        except ConfigError as exc:
            described = ", ".join(f"{k}={v}" for k, v in shape.items()) or "the base"
            raise SweepError(f"shape {described}: {exc}") from None
        described = ", ".join(f"{k}={v}" for k, v in shape.items()) or "the base"
        if disaggregated:
            p_gpus, d_gpus = setup.prefill_gpus_per_worker, setup.gpus_per_worker
            sizes = [(p, d) for p in range(1, max_workers) for d in range(1, max_workers - p + 1)]
            gpus = lambda s: s[0] * p_gpus + s[1] * d_gpus  # noqa: E731
            pools = [(pool_system(setup.prefill_rank), p_gpus), (pool_system(setup.rank), d_gpus)]
        else:
            sizes = [(w,) for w in range(1, max_workers + 1)]
            gpus = lambda s: s[0] * setup.gpus_per_worker  # noqa: E731
            pools = [(pool_system(setup.rank), setup.gpus_per_worker)]
        unit = [1.0] * len(pools)
        if prices is not None:
            unit = [price_of(system, prices) * per_worker for system, per_worker in pools]
            if any(math.isnan(u) for u in unit):
                unknown = next(system for (system, _), u in zip(pools, unit) if math.isnan(u))
                raise SweepError(f"shape {described}: no price for GPU system {unknown or '(none: not timed by AIC)'}; "
                                 "give a price file (--gpu-prices) with it or a default entry")
        for s in sizes:
            if max_gpus is None or gpus(s) <= max_gpus:
                cost = float(sum(n * u for n, u in zip(s, unit))) if prices is not None else float(gpus(s))
                out.append(_Candidate(index, tuple(shape.items()), s, gpus(s), cost))
    return out


def _shaped(payload: dict, shape: dict, timing: dict, disaggregated: bool) -> dict:
    """The base payload with one shape's choices applied."""
    out = copy.deepcopy(payload)
    engine = out.setdefault("spec", {}).setdefault("engine", {})
    ranks = ([engine.setdefault("prefill", {}).setdefault("rank", {}),
              engine.setdefault("decode", {}).setdefault("rank", {})] if disaggregated
             else [engine.setdefault("rank", {})])
    for axis, value in shape.items():
        if axis in _RANK_FIELDS:
            for rank in ranks:
                rank[_RANK_FIELDS[axis]] = value
        if axis == "speculation":
            fields = speculation.rank_fields(value, "--speculation")
            for rank in ranks:
                for key in ("aic_nextn", "aic_nextn_accept_rates"):
                    rank.pop(key, None)
                rank.update(fields)
    aic = dict(timing)
    if "tp" in shape:
        aic["tp"] = shape["tp"]
    if aic:
        out = set_aic_timing(out, **aic)
    for role in ("prefill", "decode"):
        if f"{role}_system" in shape:
            out = set_aic_timing(out, system=shape[f"{role}_system"], role=role, where="--")
    return out


class _Search:
    def __init__(self, payload, disaggregated, base_dir, trace, sla, load_edits, timing, jobs, quiet, say, prices,
                 confidence):
        self.prices, self.confidence = prices, confidence
        self.payload, self.base_dir, self.trace = payload, base_dir, trace
        self.sla, self.load_edits, self.timing = sla, load_edits, timing
        self.jobs, self.quiet, self.say = jobs, quiet, say
        self.disaggregated = disaggregated
        self.columns = (PREFILL, DECODE) if self.disaggregated else (WORKERS,)

    def run(self, candidates, exhaustive, effective_rate) -> SizingAnswer:
        head = f"rate x{effective_rate:g}: " if self.load_edits else ""
        if exhaustive:
            self.say(f"{head}all {len(candidates)} candidates")
            tried = self._evaluate(candidates)
        else:
            coarse = self._coarse(candidates)
            self.say(f"{head}coarse grid: {len(coarse)} of {len(candidates)} candidates")
            tried = self._evaluate(coarse)
            refine = self._refinement(candidates, tried)
            if refine:
                self.say(f"{head}refining: {len(refine)} cheaper candidates")
                tried = pd.concat([tried, self._evaluate(refine)], ignore_index=True)
        tried = tried.sort_values(["cost", "gpus", "shape_index", *self.columns], ignore_index=True)
        search = "exhaustive" if exhaustive else "pruned"
        feasible = tried[tried["feasible"]]
        if not len(feasible):
            return SizingAnswer(effective_rate, False, None, {}, tried, _closest(tried), search)
        best = feasible.iloc[0]
        return SizingAnswer(effective_rate, True, int(best["gpus"]), _deployment(best, self.columns),
                            tried, {}, search)

    def _coarse(self, candidates) -> list:
        """Sizes at powers of two (and each axis's largest size), every shape."""
        top: dict = {}
        for c in candidates:
            top[c.shape_index] = tuple(max(a, b) for a, b in zip(top.get(c.shape_index, c.sizes), c.sizes))
        return [c for c in candidates
                if all(v & (v - 1) == 0 or v == top[c.shape_index][i] for i, v in enumerate(c.sizes))]

    def _refinement(self, candidates, tried: pd.DataFrame) -> list:
        feasible = tried[tried["feasible"]]
        if not len(feasible):
            return []
        best_all = float(feasible["cost"].min())
        seen = {(int(r["shape_index"]), tuple(int(r[c]) for c in self.columns)) for _, r in tried.iterrows()}
        out = []
        for shape_index, group in feasible.groupby("shape_index"):
            best_shape = float(group["cost"].min())
            for c in candidates:
                if (c.shape_index == shape_index and best_shape / 2 < c.cost <= min(best_shape, best_all)
                        and (c.shape_index, c.sizes) not in seen):
                    out.append(c)
        return out

    def _evaluate(self, candidates) -> pd.DataFrame:
        """Run candidates, a sweep per shape (a zip over the sizes), and judge them."""
        frames = []
        by_shape: dict = {}
        for c in candidates:
            by_shape.setdefault((c.shape_index, c.shape), []).append(c)
        progress = Progress(len(candidates), desc="aisim-fast size", unit="candidates", quiet=self.quiet)
        try:
            for (shape_index, shape), group in by_shape.items():
                frames.append(self._evaluate_shape(shape_index, shape, group))
                feasible = sum(int(f["feasible"].sum()) for f in frames)
                progress.update(progress.done + len(group), f"{feasible} feasible")
        finally:
            progress.close()
        return pd.concat(frames, ignore_index=True)

    def _evaluate_shape(self, shape_index, shape, group) -> pd.DataFrame:
        payload = _shaped(self.payload, dict(shape), self.timing, self.disaggregated)
        spec = {"base": {"spec": payload, **({"trace": self.trace} if self.trace else {})},
                "zip": {col: [c.sizes[i] for c in group] for i, col in enumerate(self.columns)},
                "sla": self.sla.terms(), "prices": self.prices}
        for path, value in self.load_edits.items():  # rate_edits: the offered load
            spec["zip"][path] = [value] * len(group)
        costs = {c.sizes: c.cost for c in group}
        if self.confidence is not None:
            return self._judge_variants(self._variants(spec, payload), shape_index, dict(shape), costs)
        points = run_sweep(spec, None, jobs=self.jobs, quiet=True, base_dir=self.base_dir)
        return self._judge(points, shape_index, dict(shape), costs)

    def _variants(self, spec: dict, payload: dict) -> pd.DataFrame:
        """Every candidate of ``spec`` in each confidence variant, one sweep."""
        setup = parse_payload(payload, self.base_dir, self.trace)
        zipped = spec["zip"]
        n = len(next(iter(zipped.values())))
        runs = self.confidence.runs
        out = {k: [v for v in values for _ in range(runs)] for k, values in zipped.items()}
        variant = list(range(runs)) * n  # point j is variant j % runs of candidate j // runs
        factors = self.confidence.factors()
        roles = ((("spec.engine.prefill.rank", setup.prefill_rank), ("spec.engine.decode.rank", setup.rank))
                 if setup.disaggregated else (("spec.engine.rank", setup.rank),))
        if self.confidence.timing_pct > 0:
            for path, rank in roles:  # pass time x factor: the ratio divides it
                out[f"{path}.speedup_ratio"] = [rank.speedup_ratio / factors[i] for i in variant]
        if setup.placement in ("random", "kv_router"):
            out["spec.adapters.placement.config.seed"] = [self.confidence.seed + i for i in variant]
        return run_sweep({**spec, "zip": out}, None, jobs=self.jobs, quiet=True, base_dir=self.base_dir)

    def _judge_variants(self, points: pd.DataFrame, shape_index: int, shape: dict, costs: dict) -> pd.DataFrame:
        """One row per candidate: feasible when the confidence fraction of its variants
        meets the SLA; the spread of its p90 TTFT and ITL over them."""
        each = self._judge(points, shape_index, shape, costs)
        each["met"] = each["feasible"]
        rows = []
        for _, group in each.groupby(list(self.columns), sort=False):
            first = group.iloc[0].to_dict()
            met = float(group["met"].mean())
            failed = sorted({t for f in group["sla_failed"] for t in f.split(",") if t})
            out = {**first, "feasible": met >= self.confidence.fraction, "runs": len(group),
                   "runs_met_fraction": met, "sla_failed": ",".join(failed),
                   "sla_reason": next((r for r in group["sla_reason"] if r), ""),
                   "sla_margin": float(group["sla_margin"].quantile(self.confidence.fraction))}
            for key in ("p90_ttft_ms", "p90_itl_ms"):
                if key in group:
                    out[f"{key}_min"], out[key], out[f"{key}_max"] = (
                        float(group[key].min()), float(group[key].median()), float(group[key].max()))
            if "error" in group:
                out["status"] = "ok" if (group["status"] == "ok").all() else str(
                    group.loc[group["status"] != "ok", "status"].iloc[0])
            out.pop("met", None)
            rows.append(out)
        return pd.DataFrame(rows)

    def _judge(self, points: pd.DataFrame, shape_index: int, shape: dict, costs: dict) -> pd.DataFrame:
        rows = []
        for _, point in points.iterrows():
            row = {k: (None if _missing(v) else v) for k, v in point.items()}
            verdict = self.sla.judge(row)
            out = {c: int(row[c]) for c in self.columns}
            out.update({"shape_index": shape_index, **{f"shape.{k}": v for k, v in shape.items()},
                        "cost": costs[tuple(out[c] for c in self.columns)],
                        "gpus": int(row["gpus"]), "status": row["status"],
                        "error": row.get("error") or "", "feasible": verdict.ok,
                        "sla_failed": ",".join(verdict.failed), "sla_reason": verdict.reason,
                        "sla_margin": _margin(self.sla, verdict)})
            out.update({f"sla.{term}": value for term, value in verdict.values.items()})
            for key in ("p90_ttft_ms", "p90_tpot_ms", "p90_itl_ms", "p90_e2e_latency_ms",
                        "output_throughput_tok_s", "request_throughput_rps", *COST_COLUMNS):
                if row.get(key) is not None:
                    out[key] = float(row[key])
            rows.append(out)
        return pd.DataFrame(rows)


def _missing(value) -> bool:
    try:
        return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))
    except TypeError:
        return False


def _margin(sla: Sla, verdict) -> float:
    """How far a candidate is from the SLA: the largest ratio of value to bound over its
    terms (goodput: needed over met), <= 1 when it meets every term; inf when it did not
    run."""
    if "status" in verdict.failed:
        return math.inf
    ratios = [1.0]
    for term, value in verdict.values.items():
        if term == "goodput":
            if sla.goodput > 0:
                ratios.append(sla.goodput / value if value > 0 else math.inf)
        elif term == "min_goodput_rps":
            ratios.append(sla.min_goodput_rps / value if value > 0 else math.inf)
        else:
            ratios.append(value / sla.stat_bounds[term])
    if "completed" in verdict.failed:
        ratios.append(math.inf)
    return max(ratios)


def _deployment(row, columns) -> dict:
    out = {c: int(row[c]) for c in columns}
    out.update({k: _plain(v) for k, v in row.items() if k.startswith("shape.") and not _missing(v)})
    return out


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def _closest(tried: pd.DataFrame) -> dict:
    ran = tried[tried["status"] == "ok"]
    if not len(ran):
        reasons = sorted(set(tried["error"].astype(str)) - {""})
        return {"reason": "no candidate ran: " + ("; ".join(reasons[:3]) or "every run failed")}
    row = ran.sort_values(["sla_margin", "gpus"], kind="stable").iloc[0]
    columns = [c for c in (WORKERS, PREFILL, DECODE) if c in row.index and not _missing(row[c])]
    return {"deployment": _deployment(row, columns), "gpus": int(row["gpus"]),
            "failed": [t for t in str(row["sla_failed"]).split(",") if t], "reason": row["sla_reason"]}


def format_answers(answers: list[SizingAnswer], sla: Sla) -> str:
    lines = []
    for a in answers:
        head = f"rate x{a.rate:g}: "
        if a.feasible:
            where = ", ".join(f"{_short(k)}={v}" for k, v in a.deployment.items())
            best = a.evidence[a.evidence["feasible"]].iloc[0]
            price = best.get("cost_per_hour_usd")
            dollars = f", ${price:,.2f}/h" if price is not None and not _missing(price) else ""
            lines.append(head + f"{a.gpus} GPUs ({where}{dollars}) meet {sla.text()}")
        else:
            lines.append(head + f"nothing within the budget meets {sla.text()}")
            if a.closest.get("deployment"):
                where = ", ".join(f"{_short(k)}={v}" for k, v in a.closest["deployment"].items())
                lines.append(f"  closest: {a.closest['gpus']} GPUs ({where}): {a.closest['reason']}")
            else:
                lines.append(f"  {a.closest.get('reason', '')}")
        e = a.evidence
        sizes = [c for c in (WORKERS, PREFILL, DECODE) if c in e]
        shown = [*sizes, *[c for c in e if c.startswith("shape.")], "gpus",
                 *(["cost_per_hour_usd"] if "cost_per_hour_usd" in e and e["cost_per_hour_usd"].notna().any()
                   else []),
                 "status", "feasible", "sla_failed", *[c for c in ("runs_met_fraction",) if c in e],
                 *[c for c in e if c.startswith("sla.")], "output_throughput_tok_s"]
        shown = [c for c in shown if c in e]  # (every column is in sizing.parquet)
        table = a.evidence[shown].rename(columns=_short)
        lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return "\n".join(lines)


def _short(column: str) -> str:
    if column.startswith("spec."):
        return column.split(".")[-2]
    if column.startswith("shape."):
        return column[len("shape."):]
    return column


def answers_json(answers: list[SizingAnswer], sla: Sla) -> dict:
    """``answer.json``: the SLA and, per rate, the answer or the closest miss."""
    out = []
    for a in answers:
        entry = {"rate": a.rate, "feasible": a.feasible, "search": a.search,
                 "candidates_evaluated": int(len(a.evidence))}
        if a.feasible:
            entry.update(gpus=a.gpus, deployment={_short(k): v for k, v in a.deployment.items()})
            best = a.evidence[a.evidence["feasible"]].iloc[0]
            entry.update({c: (None if c not in best or _missing(best[c]) else float(best[c]))
                          for c in COST_COLUMNS})
        else:
            closest = dict(a.closest)
            if "deployment" in closest:
                closest["deployment"] = {_short(k): v for k, v in closest["deployment"].items()}
            entry["closest"] = closest
        out.append(entry)
    return {"sla": sla.terms(), "answers": out}


def evidence_frame(answers: list[SizingAnswer]) -> pd.DataFrame:
    """``sizing.parquet``: every candidate of every rate, with its verdict."""
    frames = [a.evidence.assign(rate=a.rate) for a in answers]
    frame = pd.concat(frames, ignore_index=True)
    return frame.rename(columns=_short)


def stderr_line(line: str) -> None:
    print(f"aisim-fast size: {line}", file=sys.stderr, flush=True)
