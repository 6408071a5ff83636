"""aisim_fast against the reference goldens (tests/data/golden).

Per request, with the rules of the reference's parity tool
(/work/shared/reference/parity.py): rows joined on (request_id, turn_index),
ttft_ms / tpot_ms / e2e_ms / cached_tokens / output_tokens within
rtol = atol = 1e-6, every golden request present. On top of that the timeline
columns are held bit-exact (the kernels follow the reference's float sequence,
so any difference there is a logic change, not rounding), and a batch of all
cases must give every simulation exactly its solo result.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config import load_spec
from aisim_fast.output import requests_in_uuid_order, summarize_aggregated_run
from aisim_fast.kernels import layout as L
from aisim_fast.kernels.event_loop import replay_batch
from aisim_fast.replay import (Simulation, SimulationError, build_state, run_batch,
                               simulation_from_setup)
from aisim_fast.workload import load_mooncake
from support.parity_rules import (ATOL, EXACT_INT_COLUMNS, EXACT_TIME_COLUMNS, RTOL, as_key_part, as_number,
                                  row_differences, values_outside_run, within)
from support.lanes import lane

TESTS_DIR = Path(__file__).resolve().parent
GOLDEN = TESTS_DIR / "data" / "golden"
TRACES = TESTS_DIR / "data" / "traces"
# Small disaggregated runs of the reference made for the corners the big goldens do
# not reach (decode-side preemption, full decode pools, TRT-LLM, destination_missing,
# fallback latency, fixed timing, max_num_seqs); traces next to the specs.
MINI_GOLDEN = TESTS_DIR / "data" / "golden_disagg"
MINI_CASES = ["dm1", "fb1", "fx1", "tiny40", "tiny35", "seqs2", "ptiny2", "trt1", "trt_tiny",
              "trt_tiny2", "dead25", "disagg_conc8", "disagg_sess"]


def golden_dir(case):
    return MINI_GOLDEN if case in MINI_CASES else GOLDEN

FAST_CASES = [
    "tiny20_vllm_agg1",
    "1k_vllm_agg1",
    "1k_vllm_agg2",
    "1k_vllm_agg1_fixed",
    "1k_vllm_agg1_conc16",
    "1k_vllm_agg1_kvpressure",
    "1k_vllm_agg2_noprefix",
    "1k_trtllm_agg2",
    "sess200_vllm_agg2",
    "sess200_vllm_agg2_conc6",
    "1k_vllm_disagg1p2d",
    "1k_vllm_disagg1p2d_bw",
    "1k_sglang_agg2",
    "10k_sglang_agg8",
    "1k_sglang_disagg1p2d",
] + MINI_CASES
SLOW_CASES = ["10k_vllm_agg8", "10k_vllm_disagg2p4d"]
ALL_CASES = FAST_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES]

# parity.py's default metric set and tolerance
PARITY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "cached_tokens", "output_tokens")
# Columns compared bit for bit where the golden has them. The golden's
# second_token_ms is written as first + ttst (a float sum), so it is left out.
# ------------------------------------------------------------------------------------------------
# parity.py rules (reimplemented so the test needs nothing outside the repo; the same
# tool is also run as-is in test_reference_parity_tool when it is available)
# ------------------------------------------------------------------------------------------------
def read_golden(case):
    with open(golden_dir(case) / (case + ".csv"), newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    return {(row["request_id"].strip(), as_key_part(row.get("turn_index"))): row for row in rows}


def index_frame(frame):
    out = {}
    for row in frame.to_dict("records"):
        key = (str(row["request_id"]).strip(), as_key_part(row["turn_index"]))
        assert key not in out, "duplicate candidate key %r" % (key,)
        out[key] = row
    return out


def parity_failures(gold, cand, metrics=PARITY_METRICS, rtol=RTOL, atol=ATOL):
    """Missing keys and [(rel, abs, key, metric, golden, candidate)] worst first."""
    missing = [k for k in gold if k not in cand]
    bad = []
    for key in gold:
        if key not in cand:
            continue
        for metric in metrics:
            try:
                g = as_number(gold[key].get(metric))
                c = as_number(cand[key].get(metric))
            except ValueError:  # an unparsable cell counts as a mismatch
                g, c = 0.0, None
            ok, err, rel = within(g, c, rtol, atol)
            if not ok:
                bad.append((rel, err, key, metric, g, c))
    bad.sort(key=lambda e: (e[0], e[1]), reverse=True)
    return missing, bad


def failure_report(case, missing, bad, limit=5):
    lines = ["%s: %d missing, %d values out of tolerance" % (case, len(missing), len(bad))]
    if missing:
        lines.append("  first missing: " + ", ".join("/".join(k) for k in missing[:5]))
    for rel, err, key, metric, g, c in bad[:limit]:
        lines.append("  %-24s %-14s golden %-22r candidate %-22r abs %.3e rel %.3e"
                     % ("/".join(key), metric, g, c, err, rel))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# running the cases
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _workload(trace_path, trace_block_size, ratio):
    # one Workload object per trace: cases on the same trace then share the
    # kernel's workload table rows when they run in one batch
    return load_mooncake(trace_path, trace_block_size=trace_block_size,
                         arrival_speedup_ratio=ratio)


@functools.lru_cache(maxsize=None)
def simulation(case) -> Simulation:
    spec_path = golden_dir(case) / (case + ".spec.json")
    trace_name = json.loads(spec_path.read_text())["traffic"]["trace_path"]
    trace_dir = MINI_GOLDEN if (MINI_GOLDEN / Path(trace_name).name).exists() else TRACES
    setup = load_spec(spec_path, trace_override=str(trace_dir / Path(trace_name).name))
    wl = _workload(setup.trace_path, setup.trace_block_size, setup.arrival_speedup_ratio)
    return simulation_from_setup(setup, wl)


@functools.lru_cache(maxsize=None)
def solo(case):
    """(requests frame, passes frame, token_stat row, token_hist row) of a solo run."""
    res = run_batch([simulation(case)])
    return res.requests[0], res.passes[0], res.token_stat[0].copy(), res.token_hist[0].copy()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", lane(ALL_CASES))
def test_golden_parity(case):
    gold = read_golden(case)
    frame = solo(case)[0]
    cand = index_frame(frame)
    missing, bad = parity_failures(gold, cand)
    assert not missing and not bad, failure_report(case, missing, bad)
    extra = [k for k in cand if k not in gold]
    assert not extra, "%s: %d requests not in the golden, e.g. %s" % (case, len(extra), extra[:3])


@pytest.mark.parametrize("case", lane(ALL_CASES))
def test_golden_timeline_bit_exact(case):
    gold = read_golden(case)
    cand = index_frame(solo(case)[0])
    gold_cols = next(iter(gold.values())).keys()
    bad = []
    for col in EXACT_TIME_COLUMNS + EXACT_INT_COLUMNS:
        if col not in gold_cols:
            continue
        for key, row in gold.items():
            g = as_number(row[col])
            c = as_number(cand[key].get(col))  # aggregated runs have no handoff columns
            # bit equality; two missing values agree
            if not (g is None and c is None) and g != c:
                bad.append((key, col, g, c))
    for key, row in gold.items():
        if row["terminal_status"] != cand[key]["terminal_status"]:
            bad.append((key, "terminal_status", row["terminal_status"],
                        cand[key]["terminal_status"]))
    assert not bad, "%s: %d cells differ, first: %s" % (case, len(bad), bad[:5])


@pytest.mark.parametrize("case", lane(ALL_CASES))
def test_golden_every_column(case):
    """Every column the reference wrote, not only the parity tool's metrics (workers,
    admission counts, decode reuse, status; empty only against null)."""
    gold = read_golden(case)
    cand = index_frame(solo(case)[0])
    bad = [(key, col, g, c) for key, row in gold.items() for col, g, c in row_differences(row, cand[key])]
    assert not bad, "%s: %d cells differ, first: %s" % (case, len(bad), bad[:5])


@pytest.mark.parametrize("case", lane(ALL_CASES))
def test_no_value_outside_the_run(case):
    """No float cell of any golden run lies outside the run (rejected rows included:
    their unset times are NaN, never leftover memory)."""
    assert not values_outside_run(solo(case)[0])


@pytest.mark.parametrize("case", lane(FAST_CASES))
def test_reference_parity_tool(case, reference_dir, tmp_path):
    """The reference's own parity.py accepts the candidate table."""
    cand_csv = tmp_path / (case + ".csv")
    solo(case)[0].to_csv(cand_csv, index=False)
    proc = subprocess.run([sys.executable, str(reference_dir / "parity.py"),
                           str(golden_dir(case) / (case + ".csv")), str(cand_csv)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def _assert_same_result(case, got, want):
    requests, passes, token_stat, token_hist = got
    pd.testing.assert_frame_equal(requests, want[0], check_exact=True, obj=case + " requests")
    pd.testing.assert_frame_equal(passes, want[1], check_exact=True, obj=case + " passes")
    np.testing.assert_array_equal(token_stat, want[2], err_msg=case + " token_stat")
    np.testing.assert_array_equal(token_hist, want[3], err_msg=case + " token_hist")


def test_batch_equals_solo_runs():
    """Simulations in one batch share kernel calls and workload tables but must not
    influence each other: every one gives exactly its solo result."""
    sims = [simulation(c) for c in FAST_CASES]
    res = run_batch(sims)
    for s, case in enumerate(FAST_CASES):
        got = (res.requests[s], res.passes[s], res.token_stat[s], res.token_hist[s])
        _assert_same_result(case, got, solo(case))


def test_batch_order_and_repeats_do_not_matter():
    """A reversed batch with a case repeated (same Workload object twice) gives the
    same per-simulation results."""
    cases = list(reversed(FAST_CASES[:4])) + [FAST_CASES[0]]
    res = run_batch([simulation(c) for c in cases])
    for s, case in enumerate(cases):
        got = (res.requests[s], res.passes[s], res.token_stat[s], res.token_hist[s])
        _assert_same_result(case, got, solo(case))


@pytest.mark.parametrize("case", lane(["tiny20_vllm_agg1", "sess200_vllm_agg2_conc6",
                                  "1k_vllm_agg1_kvpressure", "1k_vllm_disagg1p2d"]))
def test_pass_log_flushes_are_transparent(case):
    """A tiny pass log makes the kernel stop for a flush every few passes and resume;
    the run must be identical to one that never stops."""
    res = run_batch([simulation(case)], pass_log_rows=7)
    assert res.kernel_calls > 1
    got = (res.requests[0], res.passes[0], res.token_stat[0], res.token_hist[0])
    _assert_same_result(case, got, solo(case))


@pytest.mark.parametrize("case", lane(["sess200_vllm_agg2_conc6", "1k_vllm_agg2", "1k_vllm_disagg1p2d"]))
def test_spilled_pass_log_is_the_same_table(case, monkeypatch):
    """A pass log spilled to a temporary file as it drains (spill_passes, the CLI's
    way) reads back as the same table, whole or part by part."""
    import aisim_fast.replay as replay_module
    monkeypatch.setattr(replay_module, "PASS_PART_ROWS", 100)
    res = run_batch([simulation(case)], pass_log_rows=7, spill_passes=True)
    got = (res.requests[0], res.passes[0], res.token_stat[0], res.token_hist[0])
    _assert_same_result(case, got, solo(case))
    parts = list(res.pass_parts(0))
    assert len(parts) > 1
    joined = pd.concat([part.to_pandas() for part in parts], ignore_index=True).sort_values(
        ["start_ms", "worker"], kind="stable", ignore_index=True)
    pd.testing.assert_frame_equal(joined, res.passes[0], check_exact=True)


@pytest.mark.bounds
@pytest.mark.parametrize("case", lane(["tiny20_vllm_agg1", "1k_vllm_agg1_kvpressure",
                                  "sess200_vllm_agg2", "1k_vllm_disagg1p2d_bw"]))
def test_arena_size_does_not_change_results(case):
    """The per-worker block arena is an allocation detail: sizing it to the full pool
    gives the same run as the workload-based estimate."""
    sim = simulation(case)
    full = dataclasses.replace(sim, arena_blocks=sim.rank.num_gpu_blocks)
    res = run_batch([full])
    got = (res.requests[0], res.passes[0], res.token_stat[0], res.token_hist[0])
    _assert_same_result(case, got, solo(case))


def test_disaggregated_dead_end_matches_reference():
    """With 24 decode blocks the reference aborts: a preempted head that does not fit
    blocks the activated requests behind it (spec engine.md 10.3). aisim_fast stops
    at the same point with the same number of requests in flight."""
    expected = (MINI_GOLDEN / "dead24.error.txt").read_text()
    in_flight = int(re.search(r"with (\d+) in-flight", expected).group(1))
    setup = load_spec(MINI_GOLDEN / "dead24.spec.json")
    with pytest.raises(SimulationError, match=rf"with {in_flight} in-flight requests"):
        run_batch([simulation_from_setup(setup)]).check()


AGGREGATED_CASES = [c for c in FAST_CASES if "disagg" not in c and c not in MINI_CASES]


@pytest.mark.parametrize("case", lane(AGGREGATED_CASES + [pytest.param("10k_vllm_agg8", marks=pytest.mark.slow)]))
def test_aggregated_summary_matches_reference_report(case):
    """Every summary key of the reference report, token-level sketches included,
    from the kernel's own run (the disaggregated cases: test_disagg.py)."""
    from test_cli import NOT_COMPARED, assert_summary_matches
    requests, _, token_stat, token_hist = solo(case)
    sim = simulation(case)
    setup = load_spec(golden_dir(case) / (case + ".spec.json"),
                      trace_override=str(TRACES / "unused.jsonl"))
    ordered = requests_in_uuid_order(requests, sim.workload.session, sim.workload.turn_index)
    summary = summarize_aggregated_run(ordered, token_stat, token_hist, workers=sim.workers,
                                       gpus_per_worker=setup.tensor_parallel_size, sla=setup.sla)
    golden = json.loads((golden_dir(case) / (case + ".report.json")).read_text())["report"]
    assert_summary_matches(summary, golden, [k for k in golden if k not in NOT_COMPARED])


def _decode_run_share(case):
    cfg, pool, rq, wl, wk, sims, max_lease, max_bs = build_state([simulation(case)], 0)
    replay_batch(cfg, pool, rq, wl, wk, sims, np.arange(1), max_lease, max_bs)
    assert sims.i64[0, L.SM_STATUS] == L.SIM_DONE
    return sims.i64[0, L.SM_DECODE_RUN_PASSES] / wk.i64[:, L.WK_PASS_STAMP].sum()


@pytest.mark.parametrize("case,at_least", lane([("1k_vllm_agg1", 0.45), ("1k_vllm_agg1_conc16", 0.7),
                                           ("1k_vllm_agg1_fixed", 0.55)]))
def test_many_passes_of_a_lone_worker_run_inside_decode_runs(case, at_least):
    """The decode-run fast path (kernels/decode_run.py) carries many passes of these
    one-worker runs (49%, 78% and 63% today; a run is tried only when the next event
    leaves room for three passes), as of each round-robin worker unit, so losing it
    cannot go unnoticed; the parity tests above hold those same runs to the
    reference."""
    assert _decode_run_share(case) >= at_least


@pytest.mark.parametrize("case", lane(["1k_vllm_agg2", "sess200_vllm_agg2"]))
def test_workers_run_together_take_no_decode_runs(case):
    """Beside other workers a decode run ends at each of their pass ends and costs
    more than the plain passes it replaces (kernels.event_loop), so a simulation run
    whole with several workers takes none; its results are those of the runs it
    had (the parity tests above)."""
    assert _decode_run_share(case) == 0
