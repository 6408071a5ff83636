"""Sweeps: many replay configurations of one base payload, run in batches.

A sweep spec (YAML or JSON) names a base execution payload (what ``aisim-fast replay
--spec`` takes) and axes over its fields by dotted path::

    base: {spec: golden/1k_vllm_agg2.spec.json, trace: traces/mooncake_1k.jsonl}
    grid:                                   # cartesian product
      spec.engine.rank.max_num_seqs: [32, 64, 128, 256]
      spec.topology.workers.initial_workers: [1, 2, 4, 8]
    zip: {}                                 # parallel lists, one axis together
    random: {samples: 0, seed: 0, space: {}}  # {path: {uniform|loguniform|randint|loguniform_int: [lo, hi]} | {choice: [...]}}
    trace: [a.jsonl, b.jsonl]               # shortcuts, each one more grid axis
    arrival_speedup_ratio: [1, 2, 4]
    workers: [1, 2, 4]                      # aggregated worker count
    prefill_decode: [[1, 3], [2, 2]]        # disaggregated prefill / decode workers
    rate: [2, 4, 8]                         # a synthetic poisson load's requests per second
    model: [Qwen/Qwen3-8B, Qwen/Qwen3-32B]  # op-level (AIC) timing of every pool
    system: [h100_sxm, h200_sxm, b200_sxm]
    tp: [1, 2]
    sla: {ttft_p90_ms: 500, itl_p90_ms: 50}  # the terms of report/sla.py
    prices: prices.yaml                     # USD per GPU-hour by system (report/cost.py)

The points are the product of the grid axes, the shortcuts (in the order trace,
arrival_speedup_ratio, workers, prefill_decode, rate, model, system, tp), the zip rows and
the random samples,
the last axis varying fastest. Relative paths resolve against
the sweep file's folder. Every point's payload is validated before any work starts.

Points that share a trace (and its block size and arrival scaling) run together in
one ``run_batch`` call per batch; batches run in this process, in ``jobs`` local
worker processes, or on a Dask cluster, with identical results. The output folder
holds ``manifest.json`` (the spec, the points), ``parts/`` (one Parquet file per
finished batch, written atomically: the record of what is done),
``requests/point=<id>/part-0.parquet`` and at the end ``points.parquet``, rebuilt
from the parts. ``resume`` runs only the points no part holds.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from aisim_fast.config.payload import ConfigError, parse_payload, set_aic_timing
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.memory import StateTooLarge
from aisim_fast.engine.simulation import STATUS_OK, setup_workload, simulation_from_setup, turn_outcome_key
from aisim_fast.engine.warmup import warm_kernels
from aisim_fast.io.progress import Progress
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.io.run_folder import REQUEST_TABLE_OPTIONS
from aisim_fast.kernels.loop.event_loop import set_kernel_threads
from aisim_fast.report.cost import load_prices, run_cost
from aisim_fast.report.sla import Sla, parse_sla
from aisim_fast.report.summary import routing_summary, summarize_replay
from aisim_fast.trace.workload import TraceError
from aisim_fast.version import __version__

SWEEP_KEYS = ("base", "grid", "zip", "random", "trace", "arrival_speedup_ratio", "rate", "workers",
              "prefill_decode", "model", "system", "tp", "sla", "batch_size", "prices")
# shortcuts over op-level (AIC) timing: every pool's model / GPU system / tensor
# parallelism (config.set_aic_timing; points columns named as the shortcut)
AIC_COLUMNS = ("model", "system", "tp")
RANDOM_KINDS = ("uniform", "loguniform", "randint", "loguniform_int", "choice")
DEFAULT_BATCH_SIZE = 64
MANIFEST_FILE = "manifest.json"
POINTS_FILE = "points.parquet"
PARTS_DIR = "parts"
REQUESTS_DIR = "requests"
TRACE_COLUMN = "trace"

# shortcut -> the payload paths it sets (prefill_decode: one value per path)
_SHORTCUT_PATHS = {
    "arrival_speedup_ratio": ("traffic.arrival_speedup_ratio",),
    "workers": ("spec.topology.workers.initial_workers",),
    "prefill_decode": ("spec.topology.prefill.initial_workers",
                       "spec.topology.decode.initial_workers"),
    # a synthetic poisson load's arrivals per second (traffic.request_rate)
    "rate": ("traffic.request_rate",),
}


class SweepError(ValueError):
    """A sweep that cannot run as given; the message names the key, axis or value."""


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base payload and one parameter dict per point."""
    base_payload: dict
    base_dir: str                 # where the base payload's relative trace_path resolves
    base_trace: str | None        # the base's trace override (absolute), if any
    columns: tuple[str, ...]      # varied parameters, in axis order
    points: tuple[dict, ...]      # per point: column -> value
    sla: Sla | None               # the sla_ok column's terms (None: no SLA)
    batch_size: int
    digest: str                   # identity of what the sweep computes (resume check)
    source: dict = field(default_factory=dict)  # the spec, paths resolved (manifest)
    # op-level timing given for every point (the CLI's --model/--system/--tp); a
    # point's model/system/tp shortcuts override it
    timing: dict = field(default_factory=dict)
    # per point: (trace path, trace block size, arrival ratio, disaggregated), from the
    # validation's parse; points with equal workload keys share a batch
    workload_keys: tuple = ()
    # USD per GPU-hour by GPU system (report.cost): every row's cost_*_usd columns
    prices: dict = field(default_factory=dict)

    def payload(self, i: int) -> tuple[dict, str | None]:
        """Point i's execution payload and trace override."""
        payload = copy.deepcopy(self.base_payload)
        trace = self.base_trace
        timing = dict(self.timing)
        for column, value in self.points[i].items():
            if column == TRACE_COLUMN:
                trace = value
            elif column in AIC_COLUMNS:
                timing[column] = value
            else:
                _set_path(payload, column, value)
        if timing:
            payload = set_aic_timing(payload, **timing)
        return payload, trace


# ---------------------------------------------------------------------------------
# spec
# ---------------------------------------------------------------------------------
def _read_spec_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SweepError(f"sweep spec not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SweepError(f"cannot read sweep spec {path}: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SweepError(f"{path}: not valid JSON ({exc})") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SweepError(f"{path}: not valid YAML ({exc})") from None


def _set_path(payload: dict, path: str, value: Any) -> None:
    node = payload
    parts = path.split(".")
    for depth, key in enumerate(parts[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise SweepError(f"axis {path!r}: {'.'.join(parts[:depth + 1])} is not an object "
                             f"in the base payload")
        node = child
    node[parts[-1]] = value


def _values(key: str, raw: Any) -> list:
    if not isinstance(raw, list):
        raise SweepError(f"{key}: must be a list of values, got {raw!r}")
    if not raw:
        raise SweepError(f"{key}: is empty (give at least one value)")
    return list(raw)


def _check_path(key: str) -> None:
    if not isinstance(key, str) or key.split(".")[0] not in ("spec", "traffic") or "" in key.split("."):
        raise SweepError(f"axis {key!r}: must be a dotted path starting with 'spec.' or "
                         "'traffic.' (e.g. spec.engine.rank.max_num_seqs)")


def _random_axis(path: str, rule: Any, rng: np.random.Generator, n: int) -> list:
    where = f"random.space.{path}"
    if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in RANDOM_KINDS:
        raise SweepError(f"{where}: must be one of {{{', '.join(k + ': ...' for k in RANDOM_KINDS)}}}, "
                         f"got {rule!r}")
    kind, arg = next(iter(rule.items()))
    if kind == "choice":
        options = _values(f"{where}.choice", arg)
        return [options[int(i)] for i in rng.integers(0, len(options), n)]
    if not (isinstance(arg, list) and len(arg) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in arg)
            and arg[0] <= arg[1]):
        raise SweepError(f"{where}.{kind}: must be [low, high] numbers with low <= high, got {arg!r}")
    lo, hi = arg
    if kind == "randint":
        if not all(isinstance(v, int) for v in arg):
            raise SweepError(f"{where}.randint: bounds must be integers, got {arg!r}")
        return [int(v) for v in rng.integers(lo, hi + 1, n)]
    if kind == "loguniform_int":  # integers spread evenly in log space: 1..1024 as often 1-32 as 32-1024
        if not all(isinstance(v, int) for v in arg) or lo < 1:
            raise SweepError(f"{where}.loguniform_int: bounds must be integers >= 1, got {arg!r}")
        drawn = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))).astype(np.int64)
        return [int(v) for v in np.minimum(drawn, hi)]
    if kind == "loguniform":
        if lo <= 0:
            raise SweepError(f"{where}.loguniform: bounds must be > 0, got {arg!r}")
        return [float(v) for v in np.exp(rng.uniform(math.log(lo), math.log(hi), n))]
    return [float(v) for v in rng.uniform(lo, hi, n)]


def load_sweep(spec: str | Path | dict, base_dir: str | Path | None = None,
               timing: dict | None = None) -> Sweep:
    """Read and validate a sweep spec (a YAML / JSON file, or its dict with relative
    paths resolved against ``base_dir``, default the working folder). Every point's
    payload is parsed here: an invalid one fails before any work, naming the point and
    its parameters. ``timing`` ({model, system, tp, backend_version}, any of them)
    retimes the base's pools with op-level timing (``config.set_aic_timing``)."""
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        raw = _read_spec_file(path)
        folder = path.resolve().parent
    else:
        raw = spec
        folder = Path(base_dir or ".").resolve()
    if not isinstance(raw, dict):
        raise SweepError("sweep spec: must be a mapping with 'base' and axes")
    for key in raw:
        if key not in SWEEP_KEYS:
            raise SweepError(f"{key}: unknown sweep key; allowed: {', '.join(SWEEP_KEYS)}")

    def resolve(p: Any, what: str) -> str:
        if not isinstance(p, str) or not p:
            raise SweepError(f"{what}: must be a path, got {p!r}")
        return str(p if os.path.isabs(p) else folder / p)

    base = raw.get("base")
    if not isinstance(base, dict) or "spec" not in base:
        raise SweepError("base: must be {spec: PATH or payload, trace: PATH (optional)}")
    for key in base:
        if key not in ("spec", "trace"):
            raise SweepError(f"base.{key}: unknown key; allowed: spec, trace")
    if isinstance(base["spec"], dict):
        base_payload, base_dir_ = base["spec"], str(folder)
    else:
        spec_path = Path(resolve(base["spec"], "base.spec"))
        try:
            base_payload = json.loads(spec_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SweepError(f"base.spec: not found: {spec_path}") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise SweepError(f"base.spec: cannot read {spec_path}: {exc}") from None
        base_dir_ = str(spec_path.parent)
    base_trace = resolve(base["trace"], "base.trace") if base.get("trace") is not None else None

    # axes: (columns, rows of values)
    axes: list[tuple[tuple[str, ...], list[tuple]]] = []
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        raise SweepError("grid: must be a mapping of dotted path -> list of values")
    for path, values in grid.items():
        _check_path(path)
        axes.append(((path,), [(v,) for v in _values(f"grid.{path}", values)]))
    if raw.get("trace") is not None:
        axes.append(((TRACE_COLUMN,), [(resolve(t, "trace"),) for t in _values("trace", raw["trace"])]))
    for short, paths in _SHORTCUT_PATHS.items():
        if raw.get(short) is None:
            continue
        rows = []
        for v in _values(short, raw[short]):
            row = tuple(v) if len(paths) > 1 else (v,)
            if len(row) != len(paths):
                raise SweepError(f"{short}: each value must be [{', '.join(p.split('.')[-2] for p in paths)}], "
                                 f"got {v!r}")
            rows.append(row)
        axes.append((paths, rows))
    for short in AIC_COLUMNS:
        if raw.get(short) is not None:
            axes.append(((short,), [(v,) for v in _values(short, raw[short])]))
    zipped = raw.get("zip") or {}
    if not isinstance(zipped, dict):
        raise SweepError("zip: must be a mapping of dotted path -> list of values")
    if zipped:
        lengths = {path: len(_values(f"zip.{path}", values)) for path, values in zipped.items()}
        for path in zipped:
            _check_path(path)
        if len(set(lengths.values())) != 1:
            raise SweepError(f"zip: lists must have equal lengths, got {lengths}")
        axes.append((tuple(zipped), list(zip(*zipped.values()))))
    rnd = raw.get("random") or {}
    if not isinstance(rnd, dict) or any(k not in ("samples", "seed", "space") for k in rnd):
        raise SweepError("random: must be {samples: N, seed: S, space: {path: rule}}")
    samples = rnd.get("samples", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise SweepError(f"random.samples: must be an integer >= 0, got {samples!r}")
    space = rnd.get("space") or {}
    if samples > 0:
        if not space:
            raise SweepError("random.space: is empty but random.samples > 0")
        seed = rnd.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise SweepError(f"random.seed: must be an integer >= 0, got {seed!r}")
        rng = np.random.default_rng(seed)
        columns = []
        drawn = []
        for path, rule in space.items():
            _check_path(path)
            columns.append(path)
            drawn.append(_random_axis(path, rule, rng, samples))
        axes.append((tuple(columns), list(zip(*drawn))))

    all_columns = [c for cols, _ in axes for c in cols]
    repeated = sorted({c for c in all_columns if all_columns.count(c) > 1})
    if repeated:
        raise SweepError(f"axes set the same field twice: {', '.join(repeated)}")
    points = tuple({c: v for (cols, _), row in zip(axes, combo) for c, v in zip(cols, row)}
                   for combo in itertools.product(*(rows for _, rows in axes)))

    try:
        sla = parse_sla(raw["sla"], "sla") if raw.get("sla") is not None else None
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    try:
        prices = load_prices(resolve(raw["prices"], "prices") if isinstance(raw.get("prices"), str)
                             else raw.get("prices"))
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    batch_size = raw.get("batch_size", DEFAULT_BATCH_SIZE)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SweepError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
    if sla is not None:  # the sweep's per-request bounds replace the base's spec.sla
        base_payload = copy.deepcopy(base_payload)
        base_payload.setdefault("spec", {}).pop("sla", None)
        if sla.request_bounds:
            base_payload["spec"]["sla"] = dict(sla.request_bounds)

    timing = {k: v for k, v in (timing or {}).items() if v is not None}
    for key in timing:
        if key not in (*AIC_COLUMNS, "backend_version"):
            raise SweepError(f"timing.{key}: unknown; allowed: model, system, tp, backend_version")
    sweep = Sweep(base_payload, base_dir_, base_trace, tuple(all_columns), points,
                  sla, batch_size, "", {}, timing)
    keys = []
    for i in range(len(points)):
        try:
            payload, trace = sweep.payload(i)
            setup = parse_payload(payload, base_dir_, trace)
            keys.append((setup.trace_path, setup.trace_block_size, setup.arrival_speedup_ratio,
                         setup.disaggregated, setup.trace_format, setup.more_trace_paths,
                         turn_outcome_key(setup)))
        except ConfigError as exc:
            described = ", ".join(f"{c}={v!r}" for c, v in points[i].items()) or "the base"
            raise SweepError(f"point {i} ({described}): {exc}") from None
    missing = sorted({k[0] for k in keys if k[0] and not os.path.isfile(k[0])})  # "": inline requests
    if missing:  # one clear error before any work, not a trace_error row per point
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SweepError(f"{missing[0]}: trace file not found{more}")
    source = {"base": {"spec": base_payload, "base_dir": base_dir_, "trace": base_trace},
              "columns": list(all_columns), "points": [dict(p) for p in points],
              "sla": sla.terms() if sla is not None else None, "timing": timing, "prices": prices}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True, default=str).encode()).hexdigest()
    return Sweep(base_payload, base_dir_, base_trace, tuple(all_columns), points, sla,
                 batch_size, digest, source, timing, tuple(keys), prices)


# ---------------------------------------------------------------------------------
# running points
# ---------------------------------------------------------------------------------
_WORKLOADS: dict = {}  # per process: the last traces loaded, by (path, block size, ratio)


def _workload(setup):
    if not setup.from_trace_file:  # inline in the payload, or a synthetic load
        return setup_workload(setup)
    key = (setup.trace_path, setup.more_trace_paths, setup.trace_format, setup.trace_block_size,
           setup.arrival_speedup_ratio, turn_outcome_key(setup))
    wl = _WORKLOADS.get(key)
    if wl is None:
        if len(_WORKLOADS) >= 4:  # a sweep walks its traces in order: keep memory flat
            _WORKLOADS.pop(next(iter(_WORKLOADS)))
        wl = _WORKLOADS[key] = setup_workload(setup)
    return wl


def _gpus(setup) -> int:
    gpus = setup.workers * setup.gpus_per_worker
    if setup.disaggregated:
        gpus += setup.prefill_workers * setup.prefill_gpus_per_worker
    return gpus


def run_points(tasks: list, threads: int = 1, with_requests: bool = True, prices: dict | None = None) -> list:
    """Run points in one batch: ``tasks`` = [(point id, payload, base dir, trace override)].
    Returns [(point id, summary row, requests frame or None)]; the task of a local worker
    process or a Dask worker, and of the sweep's own process. ``prices``: the cost table
    (``report.cost``; None: the defaults)."""

    set_kernel_threads(threads)
    setups, sims, out = [], [], []
    for point, payload, base_dir, trace in tasks:
        setup = parse_payload(payload, base_dir, trace)
        try:
            sims.append(simulation_from_setup(setup, _workload(setup)))
            setups.append(setup)
        except (TraceError, OSError) as exc:
            out.append((point, {"status": "trace_error", "error": str(exc), "gpus": _gpus(setup)}, None))
    ids = [t[0] for t in tasks if t[0] not in {o[0] for o in out}]
    out += _run_batch_rows(ids, setups, sims, with_requests, load_prices(prices))
    out.sort(key=lambda o: o[0])
    return out


STATUS_TOO_LARGE = "too_large"  # the point's state alone does not fit in memory


def _run_batch_rows(ids, setups, sims, with_requests, prices) -> list:
    """Rows of points run in one batch; a batch whose state does not fit in memory is
    split in halves until it does, and a point that does not fit alone is recorded
    with the reason (the sweep goes on)."""

    if not sims:
        return []
    try:
        result = run_batch(sims, record_passes=False)
    except StateTooLarge as exc:
        if len(sims) == 1:
            return [(ids[0], {"status": STATUS_TOO_LARGE, "error": str(exc), "gpus": _gpus(setups[0])},
                     None)]
        half = len(sims) // 2
        return (_run_batch_rows(ids[:half], setups[:half], sims[:half], with_requests, prices)
                + _run_batch_rows(ids[half:], setups[half:], sims[half:], with_requests, prices))
    out = []
    for s, (point, setup, sim) in enumerate(zip(ids, setups, sims)):
        # the batch's numbering of the simulation means nothing outside it
        error = re.sub(r"^simulation \d+: ", "", result.error[s])
        row = {"status": result.status[s], "error": error, "gpus": _gpus(setup)}
        requests = None
        if result.status[s] == STATUS_OK:
            requests = requests_in_uuid_order(result.requests[s], sim.workload.session,
                                              sim.workload.turn_index)
            summary = summarize_replay(setup, requests, result.token_stat[s], result.token_hist[s],
                                       end_ms=float(result.end_ms[s]), cap=result.capped[s])
            row.update(summary)
            if setup.placement == "kv_router":
                row.update(routing_summary(result.routing[s]))
            row["output_throughput_per_gpu_tok_s"] = summary["output_throughput_tok_s"] / row["gpus"]
            row.update(run_cost(setup, summary, prices))
        out.append((point, row, requests if with_requests else None))
    return out


def _batches(sweep: Sweep, todo: list[int], batch_size: int) -> tuple[list[list[int]], set]:
    """Points to run, grouped by workload (one trace load and one prompt hashing per
    batch), in point order within a group; and the topologies they use."""
    groups: dict = {}
    topologies = set()
    for i in todo:
        key = sweep.workload_keys[i]
        groups.setdefault((*key[:3], *key[4:]), []).append(i)
        topologies.add("disaggregated" if key[3] else "aggregated")
    return ([ids[k:k + batch_size] for ids in groups.values() for k in range(0, len(ids), batch_size)],
            topologies)


def _sla_columns(row: dict, sweep: Sweep) -> dict:
    """``sla_ok`` and ``sla_failed`` (the failed terms, comma-separated) of one point;
    a point that did not run has neither (<NA>)."""
    if sweep.sla is None:
        return {}
    if row.get("status") != "ok":
        return {"sla_ok": None, "sla_failed": None}
    verdict = sweep.sla.judge(row)
    return {"sla_ok": verdict.ok, "sla_failed": ",".join(verdict.failed)}


_LEADING = ("point",)
_AFTER_PARAMS = ("status", "error", "gpus")
_SLA_COLUMNS = ("sla_ok", "sla_failed")


def _canonical(frame: pd.DataFrame, sweep: Sweep, int_columns) -> pd.DataFrame:
    """One column order and one dtype per column whatever the batching: the point, its
    parameters, status, error, GPUs, then the metrics by name; integer metrics as
    nullable Int64 (a failed point has none), the rest float64."""
    order = [*_LEADING, *sweep.columns, *_AFTER_PARAMS]
    rest = sorted(c for c in frame.columns if c not in order and c not in _SLA_COLUMNS)
    frame = frame.reindex(columns=order + rest + (list(_SLA_COLUMNS) if sweep.sla is not None else []))
    frame["point"] = frame["point"].astype(np.int64)
    frame["gpus"] = frame["gpus"].astype(np.int64)
    for c in rest:
        frame[c] = frame[c].astype("Int64" if c in int_columns else np.float64)
    if "sla_ok" in frame:
        frame["sla_ok"] = frame["sla_ok"].astype("boolean")
        frame["sla_failed"] = frame["sla_failed"].astype("string")
    return frame.sort_values("point", ignore_index=True)


def _points_frame(sweep: Sweep, results: list) -> pd.DataFrame:
    rows = []
    int_columns = set()
    for point, row, _ in results:
        params = {c: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                  for c, v in sweep.points[point].items()}
        int_columns.update(k for k, v in row.items() if isinstance(v, (int, np.integer))
                           and not isinstance(v, bool))
        rows.append({"point": point, **params, **row, **_sla_columns(row, sweep)})
    return _canonical(pd.DataFrame(rows, columns=["point", *sweep.columns, *_AFTER_PARAMS])
                      if not rows else pd.DataFrame(rows), sweep, int_columns)


# ---------------------------------------------------------------------------------
# the output folder
# ---------------------------------------------------------------------------------
def _atomic_parquet(frame: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _manifest(sweep: Sweep) -> dict:
    return {"aisim_fast.version": __version__, "digest": sweep.digest, "sweep": sweep.source,
            "num_points": len(sweep.points)}


def _done_points(out: Path) -> set[int]:
    done: set[int] = set()
    parts = out / PARTS_DIR
    if parts.is_dir():
        for part in sorted(parts.glob("points-*.parquet")):
            done.update(int(p) for p in pd.read_parquet(part, columns=["point"])["point"])
    return done


def _forget_failed(out: Path) -> int:
    """Drop the failed points' rows from the parts (a part left empty is removed), so
    that they count as not done; returns how many were dropped."""
    dropped = 0
    for part in sorted((out / PARTS_DIR).glob("points-*.parquet")):
        frame = pd.read_parquet(part)
        failed = frame["status"] != STATUS_OK
        if failed.any():
            dropped += int(failed.sum())
            if failed.all():
                part.unlink()
            else:
                _atomic_parquet(frame[~failed], part)
    return dropped


def _prepare_out(out: Path, sweep: Sweep, resume: bool, overwrite: bool,
                 retry_failed: bool = False) -> set[int]:
    """Check the folder, write the manifest; returns the points already done."""
    manifest = out / MANIFEST_FILE
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out}: is a file")
    if out.exists() and any(out.iterdir()):
        same = False
        if manifest.is_file():
            old = json.loads(manifest.read_text(encoding="utf-8"))
            same = old.get("digest") == sweep.digest
            if resume and not same:
                raise SweepError(f"--resume: {out} holds a different sweep ({_what_differs(old['sweep'], sweep.source)}); "
                                 "give the same spec or another --out")
        if same and (resume or not _done_points(out)):
            # --resume; or the same sweep that finished no point (e.g. its scheduler was
            # unreachable), which a plain rerun simply starts again
            if retry_failed:
                _forget_failed(out)
            return _done_points(out)
        if not overwrite:
            raise SweepError(f"--out {out}: exists and is not empty; --resume continues the sweep "
                             "it holds, --overwrite replaces it")
        if not manifest.is_file():
            raise SweepError(f"--out {out}: holds no sweep (no {MANIFEST_FILE}); refusing to replace it")
        import shutil

        shutil.rmtree(out)
    # --resume with nothing there yet starts the sweep (a scheduled job can always pass it)
    (out / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    _atomic_text(json.dumps(_manifest(sweep), indent=2, default=str) + "\n", manifest)
    return set()


def _what_differs(old: dict, new: dict) -> str:
    diffs = []
    for key in sorted(set(old) | set(new)):
        if json.dumps(old.get(key), sort_keys=True, default=str) != json.dumps(new.get(key), sort_keys=True,
                                                                               default=str):
            if key == "points":
                diffs.append(f"points: {len(old.get(key) or [])} before, {len(new.get(key) or [])} now"
                             if len(old.get(key) or []) != len(new.get(key) or []) else "point values differ")
            else:
                diffs.append(f"{key} differs")
    return "; ".join(diffs) or "different digest"


def _write_batch(out: Path, sweep: Sweep, results: list, with_requests: bool) -> None:
    # requests first: a part on disk means its points are complete
    frames = [(point, requests) for point, _, requests in results if requests is not None]
    if with_requests and frames:
        import pyarrow as pa
        import pyarrow.parquet as pq


        # one pandas -> Arrow conversion for the batch, then a slice per point
        table = pa.Table.from_pandas(pd.concat([f for _, f in frames], ignore_index=True),
                                     preserve_index=False)
        start = 0
        for point, requests in frames:
            folder = out / REQUESTS_DIR / f"point={point}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "part-0.parquet"
            tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
            pq.write_table(table.slice(start, len(requests)), tmp, **REQUEST_TABLE_OPTIONS)
            os.replace(tmp, path)
            start += len(requests)
    ids = [r[0] for r in results]
    _atomic_parquet(_points_frame(sweep, results), out / PARTS_DIR / f"points-{min(ids):06d}-{max(ids):06d}.parquet")


def _collect_points(out: Path, sweep: Sweep) -> pd.DataFrame:
    parts = sorted((out / PARTS_DIR).glob("points-*.parquet"))
    frames = [pd.read_parquet(p) for p in parts]
    int_columns = {c for f in frames for c, t in f.dtypes.items() if str(t) == "Int64"}
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"point": [], "gpus": []})
    return _canonical(frame, sweep, int_columns)


# ---------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------
def run_sweep(spec, out: str | Path | None = None, *, jobs: int = 1, scheduler=None,
              batch_size: int | None = None, resume: bool = False, overwrite: bool = False,
              requests: bool = True, quiet: bool = False, base_dir=None,
              timing: dict | None = None, retry_failed: bool = False, prices=None) -> pd.DataFrame:
    """Run a sweep (a spec file, its dict, or a ``Sweep``) and return one row per point.

    ``out``: write the folder described in the module doc (None: keep results in memory
    only). ``jobs`` > 1: local worker processes, one kernel thread each; ``scheduler``:
    a Dask scheduler address or ``distributed.Client``. ``resume``: run only the points
    ``out`` does not hold yet (``retry_failed``: and the points that failed). ``requests``
    False: no per-request dataset. ``timing``: op-level timing of the base
    (``load_sweep``). ``prices``: a price file or mapping over the spec's own
    (``report.cost``)."""
    if retry_failed and not resume:
        raise SweepError("--retry-failed: reruns the failed points of a sweep; give it with --resume")
    sweep = spec if isinstance(spec, Sweep) else load_sweep(spec, base_dir, timing)
    if prices is not None:
        try:
            sweep = dataclasses.replace(sweep, prices={**sweep.prices, **load_prices(prices)})
        except ConfigError as exc:
            raise SweepError(str(exc)) from None
    size = batch_size or sweep.batch_size
    out_path = Path(out) if out is not None else None
    client = None
    if isinstance(scheduler, str):  # reach it before the folder is touched
        client = _connect(scheduler)
        scheduler = client
    try:
        done = _prepare_out(out_path, sweep, resume, overwrite, retry_failed) if out_path is not None else set()
        return _run(sweep, out_path, done, size, jobs, scheduler, requests, quiet)
    finally:
        if client is not None:
            client.close()


SCHEDULER_TIMEOUT_S = 10  # how long --scheduler is tried before the sweep gives up


def _connect(address: str):
    from distributed import Client

    try:
        return Client(address, timeout=f"{SCHEDULER_TIMEOUT_S}s")
    except (OSError, TimeoutError) as exc:
        raise SweepError(f"--scheduler {address}: cannot reach the Dask scheduler ({exc})") from None


def _run(sweep: Sweep, out_path: Path | None, done: set, size: int, jobs: int, scheduler, requests: bool,
         quiet: bool) -> pd.DataFrame:
    todo = [i for i in range(len(sweep.points)) if i not in done]
    batches, topologies = _batches(sweep, todo, size)
    kept: list = []
    progress = Progress(len(sweep.points), desc="aisim-fast sweep", unit="points", done=len(done),
                        quiet=quiet)
    simulated = [0]
    start_s = time.perf_counter()

    def finished(results: list) -> None:
        if out_path is not None:
            _write_batch(out_path, sweep, results, requests)
        else:
            kept.extend((p, row, None) for p, row, _ in results)
        simulated[0] += sum(int(r.get("num_requests", 0)) for _, r, _ in results)
        rate = simulated[0] / max(time.perf_counter() - start_s, 1e-9)
        progress.update(progress.done + len(results), f"{rate:,.0f} simulated requests/s")

    def tasks(batch: list[int]) -> list:
        return [(i, payload, sweep.base_dir, trace) for i in batch
                for payload, trace in [sweep.payload(i)]]

    try:
        if batches and (jobs > 1 or scheduler is not None):
            _run_parallel(batches, tasks, finished, jobs, scheduler, requests and out_path is not None,
                          sorted(topologies), sweep.prices)
        else:
            for batch in batches:
                finished(run_points(tasks(batch), threads=0, with_requests=requests and out_path is not None,
                                    prices=sweep.prices))
    finally:
        progress.close()
    if out_path is None:
        return _points_frame(sweep, sorted(kept, key=lambda r: r[0]))
    frame = _collect_points(out_path, sweep)
    _atomic_parquet(frame, out_path / POINTS_FILE)
    return frame


def _run_parallel(batches, tasks, finished, jobs: int, scheduler, with_requests: bool,
                  topologies, prices: dict) -> None:
    """Batches on local processes or a Dask cluster, written as they finish."""

    warm_kernels(topologies)  # compile once here; the workers load the cache
    if scheduler is not None:
        from distributed import as_completed

        futures = [scheduler.submit(run_points, tasks(b), 1, with_requests, prices, pure=False) for b in batches]
        for future in as_completed(futures):
            finished(future.result())
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(run_points, tasks(b), 1, with_requests, prices) for b in batches}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    finished(future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def read_point_requests(out: str | Path, points=None) -> pd.DataFrame:
    """The per-request rows of a sweep folder (``points``: only these), with ``point`` an
    int64 column like ``points.parquet``'s: a plain ``pd.read_parquet`` of the hive
    folder reads the partition key as a categorical."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    partitioning = ds.partitioning(pa.schema([("point", pa.int64())]), flavor="hive")
    dataset = ds.dataset(Path(out) / REQUESTS_DIR, format="parquet", partitioning=partitioning)
    where = ds.field("point").isin(list(points)) if points is not None else None
    return dataset.to_table(filter=where).to_pandas()


def sla_frontier(points: pd.DataFrame, columns) -> list[tuple[str, dict, Any]]:
    """Where the SLA stops holding along each numeric axis: for every numeric varied
    column and every combination of the other varied columns, the highest value of the
    column whose point, and every point below it, met the SLA (None: not even the
    lowest). Axes of one value have no frontier. Returns [(column, {other column: value}, highest value)]; empty without an
    SLA. "The highest request rate 4 workers sustain" is the ``traffic.request_rate``
    entry of ``workers`` 4."""
    if "sla_ok" not in points or not len(points):
        return []
    ran = points[points["status"] == "ok"]
    out = []
    for column in columns:
        if column not in ran or not pd.api.types.is_numeric_dtype(ran[column]) or ran[column].nunique() < 2:
            continue
        others = [c for c in columns if c != column and c in ran]
        groups = ran.groupby(others, dropna=False, sort=True) if others else [((), ran)]
        for key, group in groups:
            key = key if isinstance(key, tuple) else (key,)
            highest = None
            for value, ok in group.sort_values(column)[[column, "sla_ok"]].itertuples(index=False):
                if ok is pd.NA or not bool(ok):
                    break
                highest = value
            out.append((column, dict(zip(others, key)), highest))
    return out
