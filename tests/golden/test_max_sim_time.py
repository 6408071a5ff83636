"""A simulated-time cap (``spec.max_sim_time_ms``, spec/replay.md 12.11): reference runs
on every column and every summary key, the cap's inclusive edge, and what a capped
run leaves in its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aisim_fast.cli import app as cli
from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.batch_run import BatchRun
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.report.summary import summarize_replay
from support.cli_runs import NOT_COMPARED, assert_summary_matches
from support.parity_rules import assert_rows_match_reference_csv
from support.paths import DATA_DIR

DATA = DATA_DIR
CASES = sorted(p for p in (DATA / "max_sim_time").iterdir() if p.is_dir())


def _payload(case: Path) -> dict:
    return json.loads((case / "spec.json").read_text())


def _setup(payload: dict):
    return parse_payload(payload, DATA / "traces")


def _scheduler_ids(frame: pd.DataFrame, dp_size: int) -> pd.DataFrame:
    """Workers numbered as the reference numbers schedulers (worker x dp + rank)."""
    if dp_size == 1:
        return frame
    scheduler = frame["worker"] * dp_size + frame["dp_rank"]
    return frame.assign(worker=scheduler, decode_worker=scheduler)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference_rows_and_report(case):
    """The requests terminal by the cap, on every column, and every summary key of
    the run's report: arrivals by the cap, worker-seconds to the last instant by it,
    prefill committed by passes that end by it, token statistics of the completed
    requests only."""
    setup = _setup(_payload(case))
    assert setup.max_sim_time_ms is not None
    sim = simulation_from_setup(setup)
    res = run_batch([sim], record_passes=False).check()
    frame = _scheduler_ids(res.requests[0], sim.dp_size)
    assert_rows_match_reference_csv(case / "ref.csv", frame)

    requests = requests_in_uuid_order(res.requests[0], sim.workload.session, sim.workload.turn_index)
    summary = summarize_replay(setup, requests, res.token_stat[0], res.token_hist[0],
                               end_ms=float(res.end_ms[0]), cap=res.capped[0])
    golden = json.loads((case / "ref.report.json").read_text())
    assert_summary_matches(summary, golden, [k for k in golden if k not in NOT_COMPARED])


AS_RUN = object()


def _sim(name: str, cap_ms=AS_RUN):
    """The case's simulation, with its cap as run, another cap, or none (None)."""
    payload = _payload(DATA / "max_sim_time" / name)
    if cap_ms is not AS_RUN:
        payload["spec"]["max_sim_time_ms"] = cap_ms
    return simulation_from_setup(_setup(payload))


def test_only_what_happened_by_the_cap_is_kept():
    """Every kept request ended by the cap, every kept pass ends by it (one that ends
    after it is dropped whole), and the rows are those of the uncapped run."""
    sim = _sim("vllm_disagg1p2d_cap20000")
    capped = run_batch([sim], record_handoffs=True).check()
    whole = run_batch([_sim("vllm_disagg1p2d_cap20000", None)]).check()
    cap = sim.max_sim_time_ms
    req, all_req = capped.requests[0], whole.requests[0]
    assert (req["completion_ms"] <= cap).all() and len(req) < len(all_req)
    pd.testing.assert_frame_equal(req, all_req[all_req["completion_ms"] <= cap])
    passes, all_passes = capped.passes[0], whole.passes[0]
    assert (passes["end_ms"] <= cap).all()
    assert len(passes) == int((all_passes["end_ms"] <= cap).sum())
    assert (capped.handoffs[0]["time_ms"] <= cap).all()
    facts = capped.capped[0]
    assert facts.num_requests == int((all_req["arrival_ms"] <= cap).sum())
    assert facts.last_instant_ms <= cap
    assert capped.end_ms[0] == facts.last_instant_ms


def test_token_statistics_leave_out_the_unfinished_requests():
    """A capped run's token gaps are those of its completed requests: as many as their
    output tokens minus one each (fewer than the run emitted by the cap)."""
    sim = _sim("vllm_agg2_cap20000")
    res = run_batch([sim], record_outputs=True).check()
    from aisim_fast.kernels.stats import sketch
    done = res.requests[0]
    done = done[done["terminal_status"] == "completed"]
    n_gaps = res.token_stat[0, sketch.ITL_STAT_BASE + sketch.STAT_COUNT]
    assert n_gaps == (done["output_tokens"] - 1).clip(lower=0).sum()
    emitted = res.output_events[0]
    assert len(emitted) > done["output_tokens"].sum()  # the unfinished ones emitted too


def test_a_cap_at_a_pass_end_keeps_that_pass():
    """The cap is inclusive: a request that completes exactly at the cap has its row."""
    sim = _sim("vllm_agg2_cap_at_a_completion")
    res = run_batch([sim]).check()
    assert (res.requests[0]["completion_ms"] == sim.max_sim_time_ms).sum() == 1
    assert (res.passes[0]["end_ms"] == sim.max_sim_time_ms).any()


@pytest.mark.parametrize("name", ["vllm_agg2_cap20000", "sglang_disagg1p2d_cap20000"])
def test_stepping_a_capped_run_equals_one_call(name):
    """Advancing to horizons 137 ms apart, past the cap, ends where one call ends."""
    sim = _sim(name)
    one = BatchRun([sim])
    one.advance()
    stepped = BatchRun([sim])
    for horizon in np.arange(0.0, sim.max_sim_time_ms + 1000.0, 137.0):
        stepped.advance(horizon)
    stepped.advance()
    assert one.status == stepped.status == ["done"]
    pd.testing.assert_frame_equal(one.requests(0), stepped.requests(0))
    np.testing.assert_array_equal(one.state.st.token_stat, stepped.state.st.token_stat)


def test_a_batch_mixes_caps():
    """Simulations with different caps (and none) share a batch, each with its own."""
    sims = [_sim("vllm_agg2_cap20000"), _sim("vllm_agg2_cap20000", 35000.5),
            _sim("vllm_agg2_cap20000", None)]
    batch = run_batch(sims).check()
    for i, sim in enumerate(sims):
        alone = run_batch([sim]).check()
        pd.testing.assert_frame_equal(batch.requests[i], alone.requests[0])
        np.testing.assert_array_equal(batch.token_stat[i], alone.token_stat[0])
    assert batch.capped[2] is None and len(batch.requests[2]) == 1000
    assert len(batch.requests[0]) < len(batch.requests[1]) < 1000


@pytest.mark.parametrize("value", [-1, "20000", float("nan"), True])
def test_a_bad_cap_names_the_field(value):
    payload = _payload(DATA / "max_sim_time" / "vllm_agg2_cap20000")
    payload["spec"]["max_sim_time_ms"] = value
    with pytest.raises(ConfigError, match=r"spec\.max_sim_time_ms"):
        _setup(payload)


def test_cli_writes_the_capped_run(tmp_path, capsys):
    """``--max-sim-time-ms`` on the flag path, and a spec's cap: the rows written are the
    requests terminal by the cap, the summary counts the others as arrivals."""
    out = tmp_path / "run"
    code = cli.main(["replay", str(DATA / "traces" / "mooncake_1k.jsonl"), "--backend", "vllm",
                     "--workers", "2", "--max-sim-time-ms", "20000", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "394 arrived, 373 completed, 0 rejected, 21 unfinished at the 20,000.000 ms cap" in text
    written = pd.read_parquet(out / "requests.parquet")
    assert len(written) == 373 and (written["completion_ms"] <= 20000).all()
    summary = json.loads((out / "summary.json").read_text())
    golden = json.loads((DATA / "max_sim_time" / "vllm_agg2_cap20000" / "ref.report.json").read_text())
    for key in ("num_requests", "completed_requests", "decode_worker_seconds", "committed_prefill_tokens",
                "mean_itl_ms", "p99_itl_ms"):
        assert summary[key] == pytest.approx(golden[key], rel=1e-9), key
    passes = pd.read_parquet(out / "passes.parquet")
    assert (passes["end_ms"] <= 20000).all()

    spec_out = tmp_path / "spec_run"
    code = cli.main(["replay", "--spec", str(DATA / "max_sim_time" / "vllm_agg2_cap25" / "spec.json"),
                     "--trace", str(DATA / "traces" / "mooncake_1k.jsonl"), "--out", str(spec_out)])
    assert code == 0  # nothing completes by 25 ms: still a run, with its arrivals
    summary = json.loads((spec_out / "summary.json").read_text())
    assert summary["completed_requests"] == 0 and summary["num_requests"] >= 1


def test_cli_refuses_a_negative_cap(tmp_path, capsys):
    code = cli.main(["replay", "--backend", "vllm", "--workers", "1", "--max-sim-time-ms", "-5",
                     "--out", str(tmp_path / "run")])
    assert code == 2
    assert "--max-sim-time-ms: must be a finite number >= 0" in capsys.readouterr().err


def test_a_sweep_over_caps_reports_each_points_cap(tmp_path):
    """``spec.max_sim_time_ms`` is a sweep axis like any other: the capped point's row
    is the reference's report of that cap, the uncapped point's the whole run."""
    from aisim_fast.studies.sweeps import run_sweep

    case = DATA / "max_sim_time" / "vllm_agg2_cap20000"
    base = _payload(case)
    base["traffic"]["trace_path"] = str(DATA / "traces" / base["traffic"]["trace_path"])
    rows = run_sweep({"base": {"spec": base}, "grid": {"spec.max_sim_time_ms": [20000, None]}},
                     None, quiet=True)
    golden = json.loads((case / "ref.report.json").read_text())
    capped, whole = rows.iloc[0], rows.iloc[1]
    for key in ("num_requests", "completed_requests", "decode_worker_seconds",
                "committed_prefill_tokens", "mean_itl_ms", "p99_ttft_ms"):
        assert capped[key] == pytest.approx(golden[key], rel=1e-9), key
    assert whole["num_requests"] == whole["completed_requests"] == 1000


CAPPED_DIFFERENTIAL_CASES = [c for c in sorted(DATA.glob("differential/seed*"))
                             if json.loads((c / "spec.json").read_text())["spec"].get("max_sim_time_ms")
                             is not None and (c / "ref.report.json").exists()]


@pytest.mark.parametrize("case", CAPPED_DIFFERENTIAL_CASES, ids=[c.name for c in CAPPED_DIFFERENTIAL_CASES])
def test_capped_differential_cases_match_their_report(case):
    """Capped cases the differential kept (their rows are checked in
    test_reference_runs): every summary key of the reference's report. seed89_case0029
    put the last instant at a KV transfer's completion, after the last pass end."""
    payload = json.loads((case / "spec.json").read_text())
    setup = parse_payload(payload, case, trace_override=str(case / "trace.jsonl"))
    sim = simulation_from_setup(setup)
    res = run_batch([sim], record_passes=False).check()
    requests = requests_in_uuid_order(res.requests[0], sim.workload.session, sim.workload.turn_index)
    summary = summarize_replay(setup, requests, res.token_stat[0], res.token_hist[0],
                               end_ms=float(res.end_ms[0]), cap=res.capped[0])
    golden = json.loads((case / "ref.report.json").read_text())
    assert_summary_matches(summary, golden, [k for k in golden if k not in NOT_COMPARED])
