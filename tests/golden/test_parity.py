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

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import load_spec
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.build import build_state
from aisim_fast.engine.simulation import SimulationError, simulation_from_setup
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.kernels.loop.event_loop import replay_batch
from aisim_fast.kernels.schema import layout as L
from aisim_fast.report.summary import summarize_aggregated_run
from support.goldens import (AGGREGATED_CASES, ALL_CASES, FAST_CASES, MINI_GOLDEN, TRACES, failure_report,
                             golden_dir, index_frame, parity_failures, read_golden, simulation, solo)
from support.lanes import lane
from support.parity_rules import row_differences, timeline_differences, values_outside_run


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
    bad = timeline_differences(gold, cand)
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
    from aisim_fast.engine import batch
    monkeypatch.setattr(batch, "PASS_PART_ROWS", 100)
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




@pytest.mark.parametrize("case", lane(AGGREGATED_CASES + [pytest.param("10k_vllm_agg8", marks=pytest.mark.slow)]))
def test_aggregated_summary_matches_reference_report(case):
    """Every summary key of the reference report, token-level sketches included,
    from the kernel's own run (the disaggregated cases: test_disagg.py)."""
    from support.cli_runs import NOT_COMPARED, assert_summary_matches
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
    """The decode-run fast path (kernels/vllm/decode_run.py) carries many passes of these
    one-worker runs (49%, 78% and 63% today; a run is tried only when the next event
    leaves room for three passes), as of each round-robin worker unit, so losing it
    cannot go unnoticed; the parity tests above hold those same runs to the
    reference."""
    assert _decode_run_share(case) >= at_least


@pytest.mark.parametrize("case", lane(["1k_vllm_agg2", "sess200_vllm_agg2"]))
def test_workers_run_together_take_no_decode_runs(case):
    """Beside other workers a decode run ends at each of their pass ends and costs
    more than the plain passes it replaces (kernels.loop.event_loop), so a simulation run
    whole with several workers takes none; its results are those of the runs it
    had (the parity tests above)."""
    assert _decode_run_share(case) == 0
