"""Report parity: summary keys recomputed from golden per-request CSVs and token times.

Pins (spec replay.md 6.2 and 12):
* per-request keys of every golden with a CSV: bit-exact, except the four per-request
  ``std_*`` keys (<= 1e-12 rel; the reference sums them in a Rust-introselect order);
* token-level keys (itl, per-user rate) of tiny20 from its per-token times folded through
  the njit accumulator: percentiles/min/max bit-exact, mean/std <= 1e-12 rel;
* sketch accuracy, Welford and rank properties with hypothesis.
"""

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from aisim_fast.kernels.stats import sketch as sk
from aisim_fast.report import metrics as report
from aisim_fast.report.metrics import percentile_rank, summarize
from support.paths import DATA_DIR

LOCAL_DIR = DATA_DIR / "report"
SHARED_DIR = Path(os.environ.get("AISIM_GOLDEN_DIR", "/work/shared/reference/golden"))
REL_TOL = 1e-12

# Keys that the CSV cannot give (need every token time) or that are host-side / metadata.
TOKEN_LEVEL_MARKERS = ("_itl_ms", "_output_token_throughput_per_user")
NOT_RECOMPUTED = {
    "wall_time_ms",
    "processed_tokens_per_s",
    "processed_output_tokens_per_s",
    "kv_eviction_policy",
    "power_w",
    "power_coverage",
    "power_diagnostics",
    "prediction_provenance",
}


def _golden_paths():
    """name -> (csv, report) for every golden CSV; shared copies win over local ones."""
    found = {}
    for base in (LOCAL_DIR, SHARED_DIR):
        if base.is_dir():
            for csv_path in sorted(base.glob("*.csv")):
                rep = csv_path.with_name(csv_path.stem + ".report.json")
                if rep.exists():
                    found[csv_path.stem] = (csv_path, rep)
    return found


GOLDENS = _golden_paths()


def load_requests(csv_path):
    """Golden CSV -> summarize() input, rows in reference summation (uuid) order."""
    df = pd.read_csv(csv_path)
    uuid_key = np.array([int(u.replace("-", ""), 16) for u in df["uuid"]])
    df = df.iloc[np.argsort(uuid_key, kind="stable")].reset_index(drop=True)
    if "decode_cached_tokens" in df:
        # Reused tokens are the max over all admissions, decode side included (spec 12.5).
        decode_cached = df["decode_cached_tokens"].fillna(0).astype(np.int64)
        df["cached_tokens"] = np.maximum(df["cached_tokens"], decode_cached)
    return df


def load_report(rep_path):
    doc = json.loads(Path(rep_path).read_text())
    sla = doc.get("meta", {}).get("payload", {}).get("spec", {}).get("sla") or None
    return doc["report"], sla


def summarize_golden(name, token_stat_row=None, token_hist_row=None):
    csv_path, rep_path = GOLDENS[name]
    golden, sla = load_report(rep_path)
    got = summarize(
        load_requests(csv_path),
        token_stat_row,
        token_hist_row,
        sla=sla,
        worker_seconds=(golden["prefill_worker_seconds"], golden["decode_worker_seconds"]),
        gpus_per_worker=(golden["prefill_gpus_per_worker"], golden["decode_gpus_per_worker"]),
        committed_prefill_tokens=golden["committed_prefill_tokens"],
        wall_time_ms=golden["wall_time_ms"],
    )
    return got, golden


def assert_keys_match(got, golden, keys):
    """Bit-exact, except std_* keys within REL_TOL; reports every mismatch at once."""
    bad = []
    for k in keys:
        g, v = golden[k], got[k]
        if k.startswith("std_"):
            ok = math.isclose(v, g, rel_tol=REL_TOL, abs_tol=0.0) or v == g
        else:
            # same value and same JSON kind (integer counts stay integers)
            ok = v == g and isinstance(v, int) == isinstance(g, int)
        if not ok:
            bad.append(f"{k}: got {v!r}, golden {g!r}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------
# (a) per-request keys on every golden CSV
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_per_request_keys_match_golden(name):
    got, golden = summarize_golden(name)
    expected = {
        k
        for k in golden
        if k not in NOT_RECOMPUTED and not any(m in k for m in TOKEN_LEVEL_MARKERS)
    }
    assert expected <= set(got), sorted(expected - set(got))
    assert_keys_match(got, golden, sorted(expected))
    # Host-side keys are exact given the golden's own wall time (spec 12.8).
    for k in ("processed_tokens_per_s", "processed_output_tokens_per_s"):
        assert got[k] == golden[k], k


def test_goodput_golden_is_covered():
    got, golden = summarize_golden("1k_vllm_agg2_aic")
    assert golden["goodput_completed_requests"] == 1000
    for k in (
        "goodput_completed_requests",
        "goodput_request_throughput_rps",
        "goodput_output_throughput_tok_s",
    ):
        assert got[k] == golden[k], k


def test_summation_follows_row_order():
    """sess200 rows are not in uuid order; CSV order gives a different mean_e2e."""
    csv_path, rep_path = GOLDENS["sess200_vllm_agg2"]
    golden, _ = load_report(rep_path)
    in_uuid_order = summarize(load_requests(csv_path), None, None)
    in_csv_order = summarize(pd.read_csv(csv_path), None, None)
    assert in_uuid_order["mean_e2e_latency_ms"] == golden["mean_e2e_latency_ms"]
    assert in_csv_order["mean_e2e_latency_ms"] != golden["mean_e2e_latency_ms"]


# ---------------------------------------------------------------------------------------
# (b) token-level keys on tiny20 from every output token time
# ---------------------------------------------------------------------------------------
def tiny20_token_times():
    """uuid -> token times (emission order) and the outputs list in global emission order."""
    outputs = json.loads((LOCAL_DIR / "tiny20_vllm_agg1.token_times.json").read_text())["outputs"]
    per_request = {}
    for o in outputs:
        per_request.setdefault(o["request_id"], []).append(o["observed_at_ms"])
    return per_request, outputs


def fold_tiny20(stat, hist, s, order="terminal"):
    """Fold tiny20's gaps into simulation s.

    terminal: per request, requests in termination order (the reference's fold order);
    emission: gaps in global token-emission order, as a batch kernel would fold them.
    """
    per_request, outputs = tiny20_token_times()
    df = load_requests(LOCAL_DIR / "tiny20_vllm_agg1.csv")
    if order == "terminal":
        for uuid in df.sort_values("completion_ms", kind="stable")["uuid"]:
            times_ms = per_request[uuid]
            for k in range(len(times_ms) - 1):
                sk.fold_gap(stat, hist, s, times_ms[k + 1] - times_ms[k])
    else:
        last_ms = {}
        for o in outputs:
            u, t_ms = o["request_id"], o["observed_at_ms"]
            if u in last_ms:
                sk.fold_gap(stat, hist, s, t_ms - last_ms[u])
            last_ms[u] = t_ms
    return df


TOKEN_KEYS = [
    f"{stat}_{name}"
    for name in ("itl_ms", "output_token_throughput_per_user")
    for stat in report.STAT_NAMES
] + ["max_itl_ms"]


@pytest.mark.parametrize("order", ["terminal", "emission"])
def test_tiny20_token_level_keys(order):
    golden, _ = load_report(LOCAL_DIR / "tiny20_vllm_agg1.report.json")
    num_sims, s = 3, 1
    stat, hist = sk.token_stats_new(num_sims)
    df = fold_tiny20(stat, hist, s, order)
    got = summarize(df, stat[s], hist[s])
    bad = []
    for k in TOKEN_KEYS:
        if k.startswith(("mean_", "std_")):
            ok = math.isclose(got[k], golden[k], rel_tol=REL_TOL, abs_tol=0.0)
        else:
            ok = got[k] == golden[k]
        if not ok:
            bad.append(f"{k}: got {got[k]!r}, golden {golden[k]!r}")
    assert not bad, "\n".join(bad)
    # Sample counts: one ITL sample per gap, no zero gaps in tiny20.
    n_gaps = int((df["output_tokens"] - 1).clip(lower=0).sum())
    assert stat[s, sk.ITL_STAT_BASE + sk.STAT_COUNT] == n_gaps
    assert stat[s, sk.RATE_STAT_BASE + sk.STAT_COUNT] == n_gaps
    # Other simulations' rows are untouched.
    fresh_stat, fresh_hist = sk.token_stats_new(1)
    for other in (0, 2):
        assert np.array_equal(stat[other], fresh_stat[0])
        assert not hist[other].any()


def test_tiny20_full_report_in_termination_fold_order():
    """Every golden key except metadata / wall-time ones, from CSV + token accumulator."""
    stat, hist = sk.token_stats_new(1)
    fold_tiny20(stat, hist, 0, "terminal")
    got, golden = summarize_golden("tiny20_vllm_agg1", stat[0], hist[0])
    keys = sorted(k for k in golden if k not in NOT_RECOMPUTED)
    assert set(keys) <= set(got)
    # In the reference's fold order even Welford mean/std come out bit-identical.
    assert_keys_match(got, golden, [k for k in keys if not k.startswith("std_")])
    for k in ("std_itl_ms", "std_output_token_throughput_per_user"):
        assert got[k] == golden[k], k


# ---------------------------------------------------------------------------------------
# Hand-made edge cases
# ---------------------------------------------------------------------------------------
def _requests(rows):
    cols = {c: [] for c in report.REQUEST_COLUMNS}
    for r in rows:
        for c in report.REQUEST_COLUMNS:
            cols[c].append(r.get(c, np.nan))
    return {c: np.asarray(v) for c, v in cols.items()}


def _req(arrival, admit, tokens, status="completed", n_in=10, cached=0, terminal=None):
    tokens = list(tokens)
    return {
        "arrival_ms": arrival,
        "first_admit_ms": admit,
        "first_token_ms": tokens[0] if tokens else np.nan,
        "second_token_ms": tokens[1] if len(tokens) > 1 else np.nan,
        "last_token_ms": tokens[-1] if tokens else np.nan,
        "completion_ms": terminal if terminal is not None else (tokens[-1] if tokens else arrival),
        "input_tokens": n_in,
        "output_tokens": len(tokens),
        "cached_tokens": cached,
        "first_admission_cached_tokens": cached,
        "terminal_status": status,
    }


def test_empty_run_reports_zeros():
    stat, hist = sk.token_stats_new(1)
    got = summarize(_requests([]), stat[0], hist[0])
    assert got["num_requests"] == 0 and got["completed_requests"] == 0
    assert got["duration_ms"] == 0.0 and got["request_throughput_rps"] == 0.0
    for k, v in got.items():
        if any(m in k for m in ("ttft", "ttst", "tpot", "e2e", "itl", "per_user")):
            assert v == 0, k


def test_sample_set_counts_and_zero_output():
    rows = [
        _req(0.0, 0.0, [10.0, 15.0, 20.0]),
        _req(1.0, 2.0, [], terminal=30.0),  # completed, zero output
        _req(2.0, np.nan, [], status="rejected", terminal=2.0),
        _req(3.0, 3.0, [12.0], status="canceled"),
        {**_req(4.0, np.nan, []), "arrival_ms": np.nan},  # never arrived (after the cap)
    ]
    got = summarize(_requests(rows), None, None)
    assert got["num_requests"] == 4
    assert got["completed_requests"] == 2
    assert got["total_input_tokens"] == 20 and got["total_output_tokens"] == 3
    assert got["duration_ms"] == 30.0  # zero-output completion still counts
    assert got["num_ttft_samples"] == 1 and got["num_tpot_samples"] == 1
    assert got["mean_tpot_ms"] == 5.0 and got["mean_ttst_ms"] == 5.0
    assert "mean_itl_ms" not in got  # no accumulator given


def test_goodput_rules():
    rows = [
        _req(0.0, 0.0, [10.0, 20.0, 30.0]),  # ttft 10, avg gap 10, e2e 30
        _req(0.0, 0.0, [50.0]),  # ttft 50, single token: itl check skipped
        _req(0.0, 0.0, [], terminal=40.0),  # zero output, e2e 40
    ]
    req = _requests(rows)

    def good(**sla):
        return summarize(req, None, None, sla=sla)["goodput_completed_requests"]

    assert good(ttft_ms=10.0) == 1  # equality passes
    assert good(ttft_ms=50.0, itl_ms=10.0) == 2
    assert good(itl_ms=9.999) == 1  # the single-token request has no gaps
    assert good(e2e_ms=50.0) == 3  # e2e-only counts the zero-output completion
    assert good(e2e_ms=40.0) == 2
    assert good(e2e_ms=39.0) == 1
    assert "goodput_completed_requests" not in summarize(req, None, None, sla={})
    with pytest.raises(ValueError):
        summarize(req, None, None, sla={"e2e_ms": 5.0, "ttft_ms": 5.0})
    with pytest.raises(ValueError):
        summarize(req, None, None, sla={"ttft_ms": 0.0})


def test_rank_ties_round_up():
    # Spec 12.3 proof runs: n = 6 median -> index 3 (2.5 rounds up), n = 7 p75 -> index 5.
    assert percentile_rank(6, 50.0) == 3
    assert percentile_rank(7, 75.0) == 5
    dist = report.exact_distribution([6.0, 1.0, 5.0, 2.0, 4.0, 3.0])
    assert dist["median"] == 4.0


def test_fold_gap_streams():
    stat, hist = sk.token_stats_new(1)
    for gap_ms in (0.0, 4.0, -1.0, 2.0):
        sk.fold_gap(stat, hist, 0, gap_ms)
    itl, rate = sk.ITL_STAT_BASE, sk.RATE_STAT_BASE
    assert stat[0, itl + sk.STAT_COUNT] == 4  # negative gap clamped to 0 and kept
    assert stat[0, itl + sk.STAT_ZERO_COUNT] == 2
    assert stat[0, itl + sk.STAT_MIN] == 0.0 and stat[0, itl + sk.STAT_MAX] == 4.0
    assert stat[0, rate + sk.STAT_COUNT] == 2  # zero gaps skipped in the rate stream
    assert stat[0, rate + sk.STAT_MIN] == 250.0 and stat[0, rate + sk.STAT_MAX] == 500.0
    assert hist[0, sk.ITL_HIST_BASE : sk.RATE_HIST_BASE].sum() == 2
    assert hist[0, sk.RATE_HIST_BASE :].sum() == 2
    got = summarize(_requests([]), stat[0], hist[0])
    # sorted ITL [0, 0, 2, 4]: p50 -> rank round(1.5) = 2, p99 -> rank 3 (q = 1.0)
    assert got["median_itl_ms"] == sk.sketch_value(sk.sketch_key(2.0))
    assert got["p99_itl_ms"] == sk.sketch_value(sk.sketch_key(4.0))
    assert got["max_itl_ms"] == 4.0
    # a rank inside the zero bucket reports 0: [0, 0, 0, 5] at p50 -> rank 2
    stat, hist = sk.token_stats_new(1)
    for gap_ms in (0.0, 0.0, 0.0, 5.0):
        sk.fold_gap(stat, hist, 0, gap_ms)
    assert summarize(_requests([]), stat[0], hist[0])["median_itl_ms"] == 0.0


def test_single_sample_reports_the_sample():
    stat, hist = sk.token_stats_new(1)
    sk.fold_gap(stat, hist, 0, 7.123456789)
    got = summarize(_requests([]), stat[0], hist[0])
    for name, _ in report.PERCENTILES:
        assert got[f"{name}_itl_ms"] == 7.123456789
        assert got[f"{name}_output_token_throughput_per_user"] == 1000.0 / 7.123456789
    assert got["std_itl_ms"] == 0.0


def test_sketch_mapping_constants():
    assert sk.SKETCH_VALUE_LN_STEP == 1.0 / sk.SKETCH_INV_GAMMA_LN
    assert 0 <= sk.sketch_key(1e-7) + sk.SKETCH_KEY_OFFSET
    assert sk.sketch_key(2e9) + sk.SKETCH_KEY_OFFSET < sk.SKETCH_NUM_BINS
    assert sk.sketch_bin(1e-12) == 0  # clamped into the first bin
    assert sk.sketch_bin(1e15) == sk.SKETCH_NUM_BINS - 1  # clamped into the last bin


# ---------------------------------------------------------------------------------------
# (c) properties
# ---------------------------------------------------------------------------------------
positive_ms = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)


@settings(deadline=None, max_examples=200)
@given(
    values=st.lists(st.one_of(positive_ms, st.just(0.0)), min_size=1, max_size=300),
    p=st.sampled_from([0.0, 1.0, 50.0, 75.0, 90.0, 95.0, 99.0, 100.0]),
)
def test_sketch_estimate_within_alpha_of_order_statistic(values, p):
    stat, hist = sk.token_stats_new(1)
    for x in values:
        sk.fold_value(stat, hist, 0, sk.ITL_STAT_BASE, sk.ITL_HIST_BASE, x)
    n = len(values)
    exact = sorted(values)[percentile_rank(n, p)]
    est = sk.sketch_quantile_value(
        hist[0, sk.ITL_HIST_BASE : sk.ITL_HIST_BASE + sk.SKETCH_NUM_BINS],
        stat[0, sk.ITL_STAT_BASE + sk.STAT_ZERO_COUNT],
        n,
        p,
        stat[0, sk.ITL_STAT_BASE + sk.STAT_MIN],
    )
    if n == 1:
        assert est == values[0]
    elif exact == 0.0:
        assert est == 0.0
    else:
        # alpha bound; the 1e-12 slack covers the rounding of exp() in value(k)
        assert abs(est - exact) <= sk.SKETCH_ALPHA * exact * (1.0 + 1e-12)


@settings(deadline=None, max_examples=200)
@given(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=300))
def test_welford_matches_numpy(values):
    stat, hist = sk.token_stats_new(1)
    for gap_ms in values:
        sk.fold_gap(stat, hist, 0, gap_ms)
    x = np.asarray(values)
    base = sk.ITL_STAT_BASE
    n = stat[0, base + sk.STAT_COUNT]
    assert n == x.size
    assert math.isclose(stat[0, base + sk.STAT_MEAN], x.mean(), rel_tol=1e-12)
    std = math.sqrt(stat[0, base + sk.STAT_M2] / n)
    assert math.isclose(std, x.std(), rel_tol=1e-9, abs_tol=1e-12 * x.max())
    assert stat[0, base + sk.STAT_MIN] == x.min() and stat[0, base + sk.STAT_MAX] == x.max()
    rate = 1000.0 / x
    rbase = sk.RATE_STAT_BASE
    assert math.isclose(stat[0, rbase + sk.STAT_MEAN], rate.mean(), rel_tol=1e-12)
    rstd = math.sqrt(stat[0, rbase + sk.STAT_M2] / n)
    assert math.isclose(rstd, rate.std(), rel_tol=1e-9, abs_tol=1e-12 * rate.max())


@settings(deadline=None, max_examples=300)
@given(
    n=st.integers(min_value=1, max_value=10**7),
    p_int=st.sampled_from([0, 1, 25, 50, 75, 90, 95, 99, 100]),
)
def test_percentile_rank_is_round_half_up(n, p_int):
    # Exact rational reference: floor((n - 1) * p / 100 + 1/2), capped at n - 1.
    expected = min((2 * (n - 1) * p_int + 100) // 200, n - 1)
    assert percentile_rank(n, float(p_int)) == expected


@settings(deadline=None, max_examples=300)
@given(positive_ms)
def test_bin_value_within_alpha(x):
    v = sk.sketch_value(sk.sketch_key(x))
    assert abs(v - x) <= sk.SKETCH_ALPHA * x * (1.0 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.one_of(st.just(0.0), st.floats(1e-9, 1e10)), max_size=30),
                min_size=1, max_size=6),
       st.integers(1, 3))
def test_hist_rows_merge_reads_only_touched_bins(parts, n_runs):
    """add_hist_rows over the bins between each row's min and max equals the dense sum."""
    stat, hist = sk.token_stats_new(len(parts))
    owner = np.array([u % n_runs for u in range(len(parts))], np.int64)
    for u, gaps in enumerate(parts):
        for gap in gaps:
            sk.fold_gap(stat, hist, u, gap)
    merged = np.zeros((n_runs, hist.shape[1]), hist.dtype)
    sk.add_hist_rows(merged, owner, stat, hist)
    for r in range(n_runs):
        np.testing.assert_array_equal(merged[r], hist[owner == r].sum(axis=0))
