"""Cluster sizing: the cheapest deployment (fewest GPUs) of a base payload that meets an
SLA at a trace's load, found with batched sweeps.

A deployment is feasible when its replay finishes (status ``ok``) and at least the
``goodput`` fraction of its requests meets every SLA bound (the reference's goodput:
TTFT, mean inter-token gap, end to end). Aggregated: worker counts; disaggregated:
prefill / decode worker pairs. The search runs a coarse grid (powers of two up to
``max_workers``) in one sweep, then every cheaper candidate near the cheapest feasible
coarse point in a second one, so it does not assume that more workers always help
inside the refined range; it does assume that a deployment with fewer GPUs than the
cheapest feasible coarse point's half is not feasible. ``--rates`` sizes for several
offered loads (``traffic.arrival_speedup_ratio``) at once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from aisim_fast.config.payload import parse_payload, set_aic_timing
from aisim_fast.studies.sweeps import SweepError, run_sweep

PREFILL = "spec.topology.prefill.initial_workers"
DECODE = "spec.topology.decode.initial_workers"
WORKERS = "spec.topology.workers.initial_workers"
RATE = "traffic.arrival_speedup_ratio"


@dataclass(frozen=True)
class SizingAnswer:
    rate: float                 # arrival speedup ratio sized for
    feasible: bool
    gpus: int | None            # of the cheapest feasible deployment
    deployment: dict            # its worker counts ({WORKERS: n} or {PREFILL: p, DECODE: d})
    evidence: pd.DataFrame      # every point tried, with its goodput fraction and feasibility


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v < limit:
        out.append(v)
        v *= 2
    return out + [limit]


def size(payload: dict | str | Path, sla: dict, *, trace: str | None = None, goodput: float = 0.99,
         max_workers: int = 64, rates=(None,), jobs: int = 1, base_dir=None,
         quiet: bool = True, timing: dict | None = None) -> list[SizingAnswer]:
    """Size the base ``payload`` (an execution payload or its file) for ``sla``
    ({ttft_ms, itl_ms, e2e_ms}); one answer per rate (None: the payload's own).
    ``timing``: {model, system, tp, backend_version} (any of them) to size in GPUs
    of that system with op-level timing (``config.set_aic_timing``); a GPU is a
    worker's tensor-parallel rank."""
    if not 0 < goodput <= 1:
        raise SweepError(f"goodput: must be in (0, 1], got {goodput!r}")
    if max_workers < 1:
        raise SweepError(f"max_workers: must be >= 1, got {max_workers!r}")
    if isinstance(payload, (str, Path)):
        import json

        path = Path(payload)
        base_dir = base_dir or path.resolve().parent
        payload = json.loads(path.read_text(encoding="utf-8"))
    if timing:
        payload = set_aic_timing(payload, **timing)
    base_dir = str(Path(base_dir or ".").resolve())
    trace = str(Path(trace).resolve()) if trace is not None else None  # as given: from the working folder
    base = {"spec": copy.deepcopy(payload), "trace": trace}
    disaggregated = parse_payload(payload, base_dir, trace).disaggregated
    answers = []
    for rate in rates:
        answers.append(_size_one(base, base_dir, sla, goodput, max_workers, rate, disaggregated,
                                 jobs, quiet))
    return answers


def _sweep(base, base_dir, sla, rate, columns, rows, jobs, quiet) -> pd.DataFrame:
    spec = {"base": {k: v for k, v in base.items() if v is not None},
            "zip": {c: [r[i] for r in rows] for i, c in enumerate(columns)},
            "sla": dict(sla)}
    if rate is not None:
        spec["zip"][RATE] = [float(rate)] * len(rows)
    return run_sweep(spec, None, jobs=jobs, quiet=quiet, base_dir=base_dir)


def _size_one(base, base_dir, sla, goodput, max_workers, rate, disaggregated, jobs, quiet):
    gpu_cost = _gpu_cost(base["spec"], base_dir, base["trace"])
    if disaggregated:
        columns = (PREFILL, DECODE)
        coarse = [(p, d) for p in _powers(max_workers) for d in _powers(max_workers) if p + d <= max_workers]
    else:
        columns = (WORKERS,)
        coarse = [(w,) for w in _powers(max_workers)]
    tried = _sweep(base, base_dir, sla, rate, columns, coarse, jobs, quiet)
    tried = _judge(tried, columns, gpu_cost, goodput)
    best = _cheapest(tried)
    if best is not None:
        # every untried deployment cheaper than the best, above half its cost
        best_cost = int(best["gpus"])
        seen = {tuple(int(r[c]) for c in columns) for _, r in tried.iterrows()}
        if disaggregated:
            candidates = [(p, d) for p in range(1, max_workers) for d in range(1, max_workers - p + 1)
                          if best_cost / 2 < gpu_cost((p, d)) < best_cost and (p, d) not in seen]
        else:
            candidates = [(w,) for w in range(1, max_workers + 1)
                          if best_cost / 2 < gpu_cost((w,)) < best_cost and (w,) not in seen]
        if candidates:
            more = _judge(_sweep(base, base_dir, sla, rate, columns, candidates, jobs, quiet),
                          columns, gpu_cost, goodput)
            tried = pd.concat([tried, more], ignore_index=True)
            best = _cheapest(tried)
    tried = tried.sort_values(["gpus", *columns], ignore_index=True)
    effective_rate = float(rate) if rate is not None else float(
        parse_payload(base["spec"], base_dir, base["trace"]).arrival_speedup_ratio)
    if best is None:
        return SizingAnswer(effective_rate, False, None, {}, tried)
    return SizingAnswer(effective_rate, True, int(best["gpus"]), {c: int(best[c]) for c in columns}, tried)


def _gpu_cost(payload, base_dir, trace):
    setup = parse_payload(payload, base_dir, trace)
    if setup.disaggregated:
        return lambda row: row[0] * setup.prefill_gpus_per_worker + row[1] * setup.gpus_per_worker
    return lambda row: row[0] * setup.gpus_per_worker


def _judge(points: pd.DataFrame, columns, gpu_cost, goodput: float) -> pd.DataFrame:
    points = points.copy()
    def column(name):  # a column no point has (every point failed) reads as <NA>
        return points[name].astype("Float64") if name in points else pd.Series(pd.NA, points.index, "Float64")

    points["goodput_fraction"] = column("goodput_completed_requests") / column("num_requests")
    points["feasible"] = ((points["status"] == "ok") & (points["goodput_fraction"] >= goodput)).fillna(False) \
        .astype(bool)
    keep = [*columns, "gpus", "status", "goodput_fraction", "feasible"]
    extra = [c for c in ("p90_ttft_ms", "p90_itl_ms", "p90_e2e_latency_ms", "output_throughput_tok_s")
             if c in points]
    return points[keep + extra].assign(**{c: points[c].astype(int) for c in columns})


def _cheapest(tried: pd.DataFrame):
    ok = tried[tried["feasible"]]
    if not len(ok):
        return None
    return ok.sort_values(["gpus", *[c for c in tried.columns if c.startswith("spec.")]]).iloc[0]


def format_answers(answers: list[SizingAnswer], sla: dict, goodput: float) -> str:
    bounds = ", ".join(f"{k}={v:g}" for k, v in sla.items())
    lines = []
    for a in answers:
        head = f"rate x{a.rate:g}: "
        if a.feasible:
            where = ", ".join(f"{k.split('.')[-2]}={v}" for k, v in a.deployment.items())
            lines.append(head + f"{a.gpus} GPUs ({where}) meet {bounds} for >= {goodput:.0%} of requests")
        else:
            lines.append(head + f"nothing up to the worker limit meets {bounds} for {goodput:.0%} of requests")
        table = a.evidence.rename(columns=lambda c: c.split(".")[-2] if c.startswith("spec.") else c)
        lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return "\n".join(lines)
