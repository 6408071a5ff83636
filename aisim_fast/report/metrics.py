"""Summary report with the reference simulator's keys and definitions (spec replay.md 6.2, 12).

``summarize`` turns one simulation's per-request arrays plus its token-stream accumulator
rows (``kernels/stats/sketch.py``) into the reference's summary dict. Definitions that matter for
bit-exact parity:

* Sample set: a request enters the aggregates iff it was admitted at least once
  (``first_admit_ms`` finite) AND its ``terminal_status`` is ``"completed"``.
* ``num_requests`` counts rows whose ``arrival_ms`` is finite: the simulator must leave
  ``arrival_ms`` NaN for requests that never arrived (after a time cap, or never dispatched
  in closed loop).
* Sums (means, std) are plain sequential float64 sums in ROW ORDER. The reference sums in
  request-id (uuid) order; on the session goldens that differs from arrival order and from
  termination order, and only uuid order reproduces ``mean_e2e_latency_ms`` and
  ``mean_tpot_ms`` bit for bit. So pass rows in request-id order.
* ``cached_tokens`` must be the max reused-prefix tokens over ALL of a request's
  admissions (re-admissions, and both sides in disagg); ``first_admission_cached_tokens``
  the first (prefill-side) admission's reuse.
* Percentiles of per-request distributions are exact order statistics at
  ``percentile_rank(n, p)`` (round half UP, no interpolation); std is the population std
  from a second pass around the mean. Token-level distributions (``itl``,
  ``output_token_throughput_per_user``) come from the Welford + DDSketch accumulator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from aisim_fast.kernels.stats import sketch as _sk

percentile_rank = _sk.percentile_rank


def sketch_merge_rows(stat_rows: np.ndarray) -> np.ndarray:
    """One token-stat row from several (``stat[u, :]`` of independent parts of one
    run): counts add, means and M2 combine with Chan's parallel formula, min/max
    fold, zero counts add."""
    out = np.empty(stat_rows.shape[1])
    for base in (_sk.ITL_STAT_BASE, _sk.RATE_STAT_BASE):
        n_i = stat_rows[:, base + _sk.STAT_COUNT]
        mean_i = stat_rows[:, base + _sk.STAT_MEAN]
        n = n_i.sum()
        mean = float((n_i * mean_i).sum() / n) if n > 0 else 0.0
        m2 = float(stat_rows[:, base + _sk.STAT_M2].sum() + (n_i * (mean_i - mean) ** 2).sum())
        out[base + _sk.STAT_COUNT] = n
        out[base + _sk.STAT_MEAN] = mean
        out[base + _sk.STAT_M2] = m2
        out[base + _sk.STAT_MIN] = stat_rows[:, base + _sk.STAT_MIN].min()
        out[base + _sk.STAT_MAX] = stat_rows[:, base + _sk.STAT_MAX].max()
        out[base + _sk.STAT_ZERO_COUNT] = stat_rows[:, base + _sk.STAT_ZERO_COUNT].sum()
    return out

REQUEST_COLUMNS = (
    "arrival_ms",
    "first_admit_ms",
    "first_token_ms",
    "second_token_ms",
    "last_token_ms",
    "completion_ms",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "first_admission_cached_tokens",
    "terminal_status",
)

# (key prefix, percentile in percent); mean/min/max/std are added around these.
PERCENTILES = (("median", 50.0), ("p75", 75.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0))
STAT_NAMES = ("mean", "min", "max") + tuple(name for name, _ in PERCENTILES) + ("std",)

STATUS_COMPLETED = "completed"
MS_PER_S = 1000.0
S_PER_HOUR = 3600.0
# duration_s floor, as in the reference, so an empty run divides by a tiny positive number.
MIN_DURATION_S = 1e-9


def seq_sum(values):
    """Left-to-right float64 sum (the reference's order; np.sum is pairwise, which differs
    in the last bits). np.cumsum is a plain sequential accumulate."""
    if values.size == 0:
        return 0.0
    return float(np.cumsum(values, dtype=np.float64)[-1])


def exact_distribution(values) -> dict:
    """mean/min/max/median/p75/p90/p95/p99/std of one-sample-per-request values.

    Mean: sequential sum / n. Std: population, two-pass around the mean. Percentiles: the
    sorted sample at ``percentile_rank(n, p)``. An empty set gives 0.0 for all nine.

    Std matches the reference only to a few ulps (<= 4e-15 rel on the goldens): the
    reference runs its two passes (mean, then squared deviations) over the array AFTER
    five Rust select_nth_unstable calls have permuted it, so its summation order is that
    of Rust's introselect. Emulating that would tie parity to one rustc version.
    """
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    if n == 0:
        return {name: 0.0 for name in STAT_NAMES}
    mean = seq_sum(x) / n
    dev = x - mean
    std = math.sqrt(seq_sum(dev * dev) / n)
    xs = np.sort(x, kind="stable")
    out = {"mean": mean, "min": float(xs[0]), "max": float(xs[-1])}
    for name, p in PERCENTILES:
        out[name] = float(xs[int(percentile_rank(n, p))])
    out["std"] = std
    return out


def sketch_distribution(token_stat_row, token_hist_row, stat_base, hist_base) -> dict:
    """The nine statistics of one token stream from its accumulator rows.

    Mean/std/min/max are the exact Welford values; percentiles are the sketch estimates
    (``sketch_quantile_value``). An empty stream gives 0.0 for all nine.
    """
    stat = np.asarray(token_stat_row, dtype=np.float64)
    hist = np.asarray(token_hist_row, dtype=np.int64)
    n = int(stat[stat_base + _sk.STAT_COUNT])
    if n == 0:
        return {name: 0.0 for name in STAT_NAMES}
    min_value = float(stat[stat_base + _sk.STAT_MIN])
    zero_count = int(stat[stat_base + _sk.STAT_ZERO_COUNT])
    bins = np.ascontiguousarray(hist[hist_base : hist_base + _sk.SKETCH_NUM_BINS])
    out = {
        "mean": float(stat[stat_base + _sk.STAT_MEAN]),
        "min": min_value,
        "max": float(stat[stat_base + _sk.STAT_MAX]),
    }
    for name, p in PERCENTILES:
        out[name] = float(_sk.sketch_quantile_value(bins, zero_count, n, p, min_value))
    out["std"] = math.sqrt(float(stat[stat_base + _sk.STAT_M2]) / n)
    return out


def _columns(req) -> dict:
    """Fetch the required per-request columns from a DataFrame or a dict of arrays."""
    missing = [c for c in REQUEST_COLUMNS if c not in req]
    if missing:
        raise KeyError(f"per-request input lacks columns: {missing}")
    cols = {}
    for c in REQUEST_COLUMNS:
        col = req[c]
        if hasattr(col, "to_numpy"):
            col = col.to_numpy()
        if c == "terminal_status":
            cols[c] = np.asarray(col, dtype=object)
        elif c.endswith("_ms"):
            cols[c] = np.asarray(col, dtype=np.float64)
        else:
            cols[c] = np.asarray(col, dtype=np.int64)
    return cols


def _role_pair(value):
    """(prefill, decode) from a 2-sequence or a mapping with 'prefill'/'decode' keys."""
    if isinstance(value, Mapping):
        return value["prefill"], value["decode"]
    prefill, decode = value
    return prefill, decode


def _sla_bounds(sla):
    """Validated (ttft_ms, itl_ms, e2e_ms) bounds, None where unset; None if no bound."""
    if sla is None:
        return None
    bounds = []
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        v = sla.get(name)
        if v is not None:
            v = float(v)
            if not (math.isfinite(v) and v > 0.0):
                raise ValueError(f"sla.{name} must be finite and > 0, got {v}")
        bounds.append(v)
    ttft_ms, itl_ms, e2e_ms = bounds
    if e2e_ms is not None and (ttft_ms is not None or itl_ms is not None):
        raise ValueError("sla.e2e_ms is mutually exclusive with sla.ttft_ms / sla.itl_ms")
    if ttft_ms is None and itl_ms is None and e2e_ms is None:
        return None
    return ttft_ms, itl_ms, e2e_ms


def _goodput_count(ttft_ms, e2e_ms, n_out, e2e_terminal_ms, bounds):
    """(good requests, their output tokens) over the sample set (spec 12.6).

    ttft_ms/e2e_ms are NaN for zero-output requests; e2e_terminal_ms = max(terminal - arrival, 0).
    Bounds pass on equality; any '>' fails the request.
    """
    ttft_bound, itl_bound, e2e_bound = bounds
    with_tokens = n_out >= 1
    good = with_tokens.copy()
    if ttft_bound is not None:
        good &= ttft_ms <= ttft_bound
    if e2e_bound is not None:
        good &= e2e_ms <= e2e_bound
    if itl_bound is not None:
        multi = n_out > 1
        # Per-request mean gap in this exact form (not tpot; they differ in the last bits).
        mean_gap_ms = np.where(multi, (e2e_ms - ttft_ms) / np.maximum(n_out - 1, 1), 0.0)
        good &= ~multi | (mean_gap_ms <= itl_bound)
    if e2e_bound is not None and ttft_bound is None and itl_bound is None:
        # Zero-output completions count only under an e2e-only SLA, on terminal time.
        good |= ~with_tokens & (e2e_terminal_ms <= e2e_bound)
    return int(good.sum()), int(n_out[good].sum())


def summarize(
    req,
    token_stat_row,
    token_hist_row,
    *,
    sla=None,
    worker_seconds=None,
    gpus_per_worker=None,
    committed_prefill_tokens=None,
    num_requests=None,
    wall_time_ms=None,
) -> dict:
    """Reference summary dict for one simulation.

    req:             DataFrame or dict of arrays with REQUEST_COLUMNS, one row per request,
                     in request-id order (times in ms, NaN when absent)
    token_stat_row:  float64[TOKEN_STAT_WIDTH] row of the token accumulator, or None to
                     leave out the itl / per-user-rate keys
    token_hist_row:  int64[TOKEN_HIST_WIDTH] row of the token accumulator (or None)
    sla:             mapping with optional ttft_ms / itl_ms / e2e_ms; goodput keys appear
                     only if at least one bound is set
    worker_seconds:  (prefill_s, decode_s) or {"prefill": .., "decode": ..}
    gpus_per_worker: (prefill, decode) or mapping; with worker_seconds adds gpu_hours
    committed_prefill_tokens: passed through when given
    num_requests:    requests that arrived, when not every row of ``req`` is one (a run
                     with a time cap reports its arrivals by the cap, rows for its
                     terminal requests only)
    wall_time_ms:    host wall time; adds wall_time_ms and the processed_*_per_s keys
    Returns a dict with the reference's key names, sorted by key.
    """
    c = _columns(req)
    in_sample = np.isfinite(c["first_admit_ms"]) & (c["terminal_status"] == STATUS_COMPLETED)

    arrival_ms = c["arrival_ms"][in_sample]
    first_ms = c["first_token_ms"][in_sample]
    second_ms = c["second_token_ms"][in_sample]
    last_ms = c["last_token_ms"][in_sample]
    terminal_ms = c["completion_ms"][in_sample]
    n_in = c["input_tokens"][in_sample]
    n_out = c["output_tokens"][in_sample]
    n_cached = c["cached_tokens"][in_sample]
    n_first_cached = c["first_admission_cached_tokens"][in_sample]

    completed = int(in_sample.sum())
    total_input = int(n_in.sum())
    total_output = int(n_out.sum())
    # Report start is t = 0, so idle lead-in counts; the reference clamps at 0.
    duration_ms = max(float(terminal_ms.max()), 0.0) if completed else 0.0
    duration_s = max(duration_ms / MS_PER_S, MIN_DURATION_S)

    out = {
        "num_requests": int(np.isfinite(c["arrival_ms"]).sum()) if num_requests is None else int(num_requests),
        "completed_requests": completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "processed_tokens": total_input + total_output,
        "duration_ms": duration_ms,
        "request_throughput_rps": completed / duration_s,
        "input_throughput_tok_s": total_input / duration_s,
        "output_throughput_tok_s": total_output / duration_s,
        "total_throughput_tok_s": (total_input + total_output) / duration_s,
    }

    # One sample per request (spec 12.3); tokens t_0 .. t_{n-1}.
    has1 = n_out >= 1
    has2 = n_out >= 2
    ttft_all_ms = np.where(has1, np.maximum(first_ms - arrival_ms, 0.0), np.nan)
    e2e_all_ms = np.where(has1, np.maximum(last_ms - arrival_ms, 0.0), np.nan)
    ttst_ms = np.maximum(second_ms[has2] - first_ms[has2], 0.0)
    tpot_ms = np.maximum(last_ms[has2] - first_ms[has2], 0.0) / (n_out[has2] - 1).astype(np.float64)
    for name, values in (
        ("ttft", ttft_all_ms[has1]),
        ("ttst", ttst_ms),
        ("tpot", tpot_ms),
        ("e2e_latency", e2e_all_ms[has1]),
    ):
        for stat, v in exact_distribution(values).items():
            out[f"{stat}_{name}_ms"] = v
    out["num_ttft_samples"] = int(has1.sum())
    out["num_e2e_latency_samples"] = int(has1.sum())
    out["num_tpot_samples"] = int(has2.sum())

    # Pooled token streams from the accumulator (spec 12.4).
    if token_stat_row is not None:
        itl = sketch_distribution(token_stat_row, token_hist_row, _sk.ITL_STAT_BASE, _sk.ITL_HIST_BASE)
        for stat, v in itl.items():
            out[f"{stat}_itl_ms"] = v
        out["max_itl_ms"] = itl["max"]
        rate = sketch_distribution(
            token_stat_row, token_hist_row, _sk.RATE_STAT_BASE, _sk.RATE_HIST_BASE
        )
        for stat, v in rate.items():
            out[f"{stat}_output_token_throughput_per_user"] = v

    # Prefix reuse over the sample set (spec 12.5).
    out["prefix_cache_reused_ratio"] = int(n_cached.sum()) / total_input if total_input else 0.0
    out["first_admission_prefix_cache_reused_ratio"] = (
        int(n_first_cached.sum()) / total_input if total_input else 0.0
    )

    bounds = _sla_bounds(sla)
    if bounds is not None:
        good, good_output = _goodput_count(
            ttft_all_ms, e2e_all_ms, n_out, np.maximum(terminal_ms - arrival_ms, 0.0), bounds
        )
        out["goodput_completed_requests"] = good
        out["goodput_request_throughput_rps"] = good / duration_s
        out["goodput_output_throughput_tok_s"] = good_output / duration_s

    if worker_seconds is not None:
        prefill_ws, decode_ws = _role_pair(worker_seconds)
        out["prefill_worker_seconds"] = float(prefill_ws)
        out["decode_worker_seconds"] = float(decode_ws)
    if gpus_per_worker is not None:
        prefill_gpus, decode_gpus = _role_pair(gpus_per_worker)
        out["prefill_gpus_per_worker"] = int(prefill_gpus)
        out["decode_gpus_per_worker"] = int(decode_gpus)
        if worker_seconds is not None:
            out["gpu_hours"] = (
                float(prefill_ws) * prefill_gpus + float(decode_ws) * decode_gpus
            ) / S_PER_HOUR
    if committed_prefill_tokens is not None:
        out["committed_prefill_tokens"] = int(committed_prefill_tokens)
    if wall_time_ms is not None:
        # Host-side simulator speed, not simulated throughput (spec 12.8).
        out["wall_time_ms"] = float(wall_time_ms)
        out["processed_tokens_per_s"] = (total_input + total_output) / wall_time_ms * MS_PER_S
        out["processed_output_tokens_per_s"] = total_output / wall_time_ms * MS_PER_S
    return dict(sorted(out.items()))
