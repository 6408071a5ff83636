"""Attention DP (``spec.engine.dp_size`` > 1, kernels.dp.attention_dp): reference runs on
every column, the group barrier in the pass log, the per-rank outputs, and the
configurations it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from support import goldens
from support.parity_rules import assert_rows_match_reference_csv
from support.paths import DATA_DIR

DATA = DATA_DIR
CASES = sorted(p for p in (DATA / "attention_dp").iterdir() if p.is_dir())


def _payload(case: Path) -> dict:
    return json.loads((case / "spec.json").read_text())


def _setup(payload: dict):
    return parse_payload(payload, DATA / "traces")


def _sim(case: Path, **edits):
    payload = _payload(case)
    for key, value in edits.items():
        node = payload
        *parents, leaf = key.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return simulation_from_setup(_setup(payload))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference_on_every_column(case):
    sim = _sim(case)
    assert max(sim.dp_size, sim.prefill_dp_size) > 1
    res = run_batch([sim], record_passes=False)
    res.check()
    frame = res.requests[0]
    # the reference numbers a request's worker by its rank's scheduler id (in its pool)
    frame = goldens.with_scheduler_numbers(frame, sim.dp_size, sim.prefill_dp_size)
    assert_rows_match_reference_csv(case / "ref.csv", frame)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_summary_matches_reference_report(case):
    """Every summary key the reference reports (latencies, token-level distributions,
    throughput, worker-seconds and GPU-hours with tensor parallelism x attention-DP
    GPUs per worker in each pool) equals the run's report."""
    from aisim_fast.io.request_order import requests_in_uuid_order
    from aisim_fast.report.summary import summarize_replay
    from support.cli_runs import NOT_COMPARED, assert_summary_matches

    setup = _setup(_payload(case))
    sim = simulation_from_setup(setup)
    res = run_batch([sim], record_passes=False)
    res.check()
    requests = requests_in_uuid_order(res.requests[0], sim.workload.session, sim.workload.turn_index)
    summary = summarize_replay(setup, requests, res.token_stat[0], res.token_hist[0],
                               end_ms=float(res.end_ms[0]))
    golden = json.loads((case / "ref.report.json").read_text())
    assert summary["decode_gpus_per_worker"] == setup.gpus_per_worker > 1 or setup.disaggregated
    assert_summary_matches(summary, golden, [k for k in golden if k not in NOT_COMPARED])


def test_ranks_pass_behind_one_barrier():
    """Every pass of a worker's ranks that starts together ends together (the group's
    end), the group has one pass in flight, and every rank takes requests in turn."""
    case = DATA / "attention_dp" / "s_dp4w2"
    sim = _sim(case)
    res = run_batch([sim])
    res.check()
    passes = res.passes[0]
    assert set(passes["rank"]) == {0, 1, 2, 3} and set(passes["worker"]) == {0, 1}
    for _, group in passes.groupby("worker"):
        ends = group.groupby("start_ms")["end_ms"].agg(["min", "max"])
        assert (ends["min"] == ends["max"]).all()
        starts = ends.index.to_numpy()
        assert np.all(starts[1:] >= ends["max"].to_numpy()[:-1])
        assert not group.duplicated(["start_ms", "rank"]).any()  # one pass per rank
    requests = res.requests[0]
    # round robin over workers, then each worker's ranks in turn (arrival order)
    order = requests.sort_values(["arrival_ms", "trace_line"], kind="stable")
    expected_worker = np.arange(len(order)) % 2
    expected_rank = (np.arange(len(order)) // 2) % 4
    assert (order["worker"].to_numpy() == expected_worker).all()
    assert (order["dp_rank"].to_numpy() == expected_rank).all()
    # a token is visible at its group's end: every first token is some pass's end
    assert set(requests["first_token_ms"]) <= set(passes["end_ms"])


def test_split_run_equals_whole_run():
    """Round robin runs each worker's group as its own unit; the whole run (one unit,
    as a run with recorded events takes it) gives the same rows bit for bit."""
    sim = _sim(DATA / "attention_dp" / "s_dp4w2")
    split = run_batch([sim], record_passes=False)
    whole = run_batch([sim], record_passes=False, record_pressure=True)
    split.check()
    whole.check()
    pd.testing.assert_frame_equal(split.requests[0], whole.requests[0])


@pytest.mark.parametrize("name", ["v_cadence_dp2w1_i4", "s_dp2_pdi2", "d_s_p3d2_tight"])
def test_stepped_run_equals_one_call(name):
    """Advancing to horizons 137 ms apart (as progress slices and the rank protocol do)
    pauses group passes, waves and interval countdowns in flight and resumes them
    exactly."""
    from aisim_fast.engine.batch_run import BatchRun

    sim = _sim(DATA / "attention_dp" / name)
    whole = run_batch([sim], record_passes=False)
    whole.check()
    run = BatchRun([sim], record_passes=False)
    horizon_ms = 0.0
    while run.status[0] in ("running", "paused"):
        horizon_ms += 137.0
        run.advance(horizon_ms)
    assert run.status[0] == "done" and run.kernel_calls > 100
    pd.testing.assert_frame_equal(whole.requests[0], run.requests(0))


@pytest.mark.parametrize("name", ["v_dp2w1", "d_v_p2d2", "s_dp2_pdi2"])
def test_requests_added_between_steps_equal_one_run(name):
    """A growable run given the second half of the trace at its first arrival equals
    one run of the whole trace: the groups' queues, cursors and waves survive the
    state's growth."""
    import dataclasses

    from aisim_fast.engine.batch_run import BatchRun
    from aisim_fast.trace.workload import select_rows

    sim = _sim(DATA / "attention_dp" / name)
    wl = sim.workload
    whole = BatchRun([sim], record_passes=False, growable=True)
    whole.advance()
    cut = wl.start_ms[wl.order][wl.num_requests // 2]
    early = [q for q in range(wl.num_requests) if wl.start_ms[q] < cut]
    late = [q for q in range(wl.num_requests) if wl.start_ms[q] >= cut]
    run = BatchRun([dataclasses.replace(sim, workload=select_rows(wl, early))], record_passes=False,
                   growable=True)
    run.advance(cut - 1e-6)
    run.add_requests(0, select_rows(wl, late))
    run.advance()
    assert run.status[0] == whole.status[0] == "done"
    by_id = ["request_id", "turn_index"]
    a = whole.requests(0).sort_values(by_id, ignore_index=True)
    b = run.requests(0).sort_values(by_id, ignore_index=True)
    columns = [c for c in a.columns if c not in ("trace_line",)]
    pd.testing.assert_frame_equal(a[columns], b[columns])


def test_retractions_are_pressure_events_of_their_rank():
    res = run_batch([_sim(DATA / "attention_dp" / "s_dp3w1_tight")], record_pressure=True)
    res.check()
    pressure, requests = res.pressure_events[0], res.requests[0]
    assert len(pressure) == int(requests["preemptions"].sum()) > 0
    assert set(pressure["kind"]) == {"sglang_retraction"} and set(pressure["worker"]) == {0}
    retracted = requests[requests["preemptions"] > 0].set_index("request_id")["dp_rank"]
    assert (pressure["rank"].to_numpy() == retracted.loc[pressure["request_id"]].to_numpy()).all()


def test_outputs_name_worker_and_rank():
    sim = _sim(DATA / "attention_dp" / "v_dp2w1")
    res = run_batch([sim], record_events=True, record_outputs=True)
    res.check()
    kv = res.kv_events[0]
    assert set(kv["worker"]) == {0} and set(kv["dp_rank"]) == {0, 1}
    # event ids count per rank, from 0
    for _, rank in kv.groupby("dp_rank"):
        assert rank["event_id"].min() == 0
    outputs = res.output_events[0]
    assert set(outputs["dp_rank"]) == {0, 1}
    assert set(outputs["time_ms"]) <= set(res.passes[0]["end_ms"])
    assert len(outputs) == int(res.requests[0]["output_tokens"].sum())
    engine = res.engine_events[0]
    assert set(engine["dp_rank"]) == {0, 1}


def test_gpus_per_worker_count_every_rank():
    payload = _payload(DATA / "attention_dp" / "t_dp3w2")
    payload["spec"]["engine"]["tensor_parallel_size"] = 2
    setup = _setup(payload)
    assert (setup.dp_size, setup.gpus_per_worker) == (3, 6)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["spec"]["engine"].update(dp_size=0), "spec.engine.dp_size: must be an integer >= 1"),
    (lambda p: p["spec"]["engine"]["rank"].update(sglang={"chunked_prefill_size": 1}),
     "spec.engine.rank.sglang.chunked_prefill_size: each of the 2 attention-DP ranks"),
])
def test_refused_configurations(edit, message):
    payload = _payload(DATA / "attention_dp" / "s_dp2w1")
    edit(payload)
    with pytest.raises(ConfigError) as err:
        _setup(payload)
    assert message in str(err.value)


@pytest.mark.parametrize("backend_case, value, message", [
    ("s_dp2w1", 2, "spec.engine.rank.prefill_schedule_interval: vLLM only (the reference refuses it for "
                   "sglang unless 1; use prefill_decode_interval)"),
    ("t_dp3w2", 2, "spec.engine.rank.prefill_schedule_interval: vLLM only"),
    ("v_dp2w1", 0, "spec.engine.rank.prefill_schedule_interval: must be an integer >= 1, got 0"),
])
def test_prefill_cadence_is_vllm_only_and_positive(backend_case, value, message):
    payload = _payload(DATA / "attention_dp" / backend_case)
    payload["spec"]["engine"]["rank"]["prefill_schedule_interval"] = value
    with pytest.raises(ConfigError) as err:
        _setup(payload)
    assert message in str(err.value)


def test_prefill_cadence_needs_attention_dp():
    """With one rank per worker the interval changes nothing (engine.md 5.7)."""
    payload = json.loads((DATA / "golden" / "1k_vllm_agg2.spec.json").read_text())
    plain = run_batch([simulation_from_setup(_setup(payload))], record_passes=False).requests[0]
    payload["spec"]["engine"]["rank"]["prefill_schedule_interval"] = 4
    cadenced = run_batch([simulation_from_setup(_setup(payload))], record_passes=False).requests[0]
    pd.testing.assert_frame_equal(plain, cadenced)


def test_prefill_cadence_defers_prefills_off_the_wave():
    """dp 2, interval 4 (reference run v_cadence_dp2w1_i4): a rank prefills on a group
    pass off the cadence only when it has no decode to protect or its last prefilling
    pass left requests waiting, so most prefill work lands on every 4th group pass."""
    res = run_batch([_sim(DATA / "attention_dp" / "v_cadence_dp2w1_i4")])
    res.check()
    passes = res.passes[0]
    groups = passes.drop_duplicates("start_ms").reset_index(drop=True)
    assert len(groups) > 1000
    prefill_starts = set(passes.loc[passes["sum_prefill_tokens"] > 0, "start_ms"])
    on_cadence = groups.index % 4 == 0  # no drained gap in this run resets the wave
    share = groups.loc[on_cadence, "start_ms"].isin(prefill_starts).mean()
    share_off = groups.loc[~on_cadence, "start_ms"].isin(prefill_starts).mean()
    assert share > 10 * share_off, (share, share_off)


def test_disaggregated_outputs_name_pool_workers_and_ranks():
    """Prefill dp 2 on one worker, decode dp 2 on two: the requests name both sides'
    workers and ranks; passes and events number the prefill worker 0 and the decode
    workers 1 and 2 (as without attention DP), each with its rank."""
    sim = _sim(DATA / "attention_dp" / "d_v_p2d2")
    assert (sim.prefill_ranks, sim.ranks) == (2, 4)
    res = run_batch([sim], record_events=True)
    res.check()
    requests, passes, kv = res.requests[0], res.passes[0], res.kv_events[0]
    assert set(requests["prefill_worker"]) == {0} and set(requests["prefill_dp_rank"]) == {0, 1}
    assert set(requests["worker"]) == {0, 1} and set(requests["dp_rank"]) == {0, 1}
    assert set(zip(passes["worker"], passes["rank"])) == {(w, r) for w in (0, 1, 2) for r in (0, 1)}
    assert set(zip(kv["worker"], kv["dp_rank"])) == {(w, r) for w in (0, 1, 2) for r in (0, 1)}
    # a group's ranks pass together: one end per group pass
    for _, group in passes.groupby(["worker", "start_ms"]):
        assert group["end_ms"].nunique() == 1
