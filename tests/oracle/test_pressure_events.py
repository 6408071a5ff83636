"""Pressure events (the seed's PressureEvent): every vLLM preemption and SGLang
retraction, with the worker's state before and after, against the plain-Python
oracles (tests/support/oracle.py, tests/support/oracle_sglang.py) event by event, and their count
against the reference's re-admissions on reference runs."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pandas as pd
import pytest
import test_oracle_parity
import test_oracle_sglang

from aisim_fast.config.payload import parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from support import oracle
from support.goldens import simulation
from support.paths import DATA_DIR

DATA = DATA_DIR
GOLDEN = DATA / "golden"
TRACES = DATA / "traces"

COMPARED = ("at_ms", "request_id", "running_before", "running_after", "waiting_before",
            "waiting_after", "active_blocks_before", "active_blocks_after",
            "request_active_blocks_before", "logical_available_blocks_before",
            "required_blocks_before")


def _optional(value):
    return None if value is None or pd.isna(value) else int(value)


def _kernel_events(frame: pd.DataFrame) -> list[dict]:
    rows = []
    for event in frame.to_dict("records"):
        row = {"worker": int(event["worker"]), "at_ms": float(event["at_ms"]),
               "request_id": (event["request_id"], int(event["turn_index"]))}
        for col in COMPARED[2:]:
            row[col] = _optional(event[col])
        rows.append(row)
    return rows


def _oracle_events(passes: list[dict]) -> list[dict]:
    rows = []
    for p in passes:
        for event in p["pressure"]:
            row = {"worker": p["worker"], "at_ms": float(event["at_ms"]),
                   "request_id": (str(event["request_id"][0]), int(event["request_id"][1]))}
            for col in COMPARED[2:]:
                row[col] = _optional(event[col])
            rows.append(row)
    return rows


def _in_time_order(events):
    # the engines' order within one worker's pass; workers at one instant by id
    return sorted(events, key=lambda e: (e["at_ms"], e["worker"]))


def _assert_same_events(kernel, expected):
    kernel, expected = _in_time_order(kernel), _in_time_order(expected)
    assert len(kernel) == len(expected), f"{len(kernel)} pressure events, the oracle {len(expected)}"
    for i, (got, want) in enumerate(zip(kernel, expected)):
        assert got == want, f"event {i}: {got} != {want}"


def _reference_readmissions(csv_path: Path) -> int:
    with open(csv_path, newline="") as f:
        return sum(int(row["readmission_count"] or 0) for row in csv.DictReader(f))


def test_kvpressure_golden_has_the_reference_preemptions_with_the_oracle_states():
    """1k_vllm_agg1_kvpressure: 74 preemptions as the reference counts them, each
    event's state before and after equal to the oracle's."""
    res = run_batch([simulation("1k_vllm_agg1_kvpressure")], record_pressure=True).check()
    frame = res.pressure_events[0]
    assert len(frame) == _reference_readmissions(GOLDEN / "1k_vllm_agg1_kvpressure.csv") == 74
    assert set(frame["kind"]) == {"vllm_preemption"}
    assert (frame["running_after"] == frame["running_before"] - 1).all()
    assert (frame["active_blocks_after"] < frame["active_blocks_before"]).all()
    spec = json.loads((GOLDEN / "1k_vllm_agg1_kvpressure.spec.json").read_text())
    _, passes = oracle.run(spec, str(TRACES / spec["traffic"]["trace_path"]))
    _assert_same_events(_kernel_events(frame), _oracle_events(passes))
    # the same events ride along in the full event log
    full = run_batch([simulation("1k_vllm_agg1_kvpressure")], record_events=True).check()
    pd.testing.assert_frame_equal(full.pressure_events[0], frame)


def _kernel_and_oracle(rows, spec, write_trace):
    path = write_trace(rows)
    try:
        try:
            _, passes = oracle.run(spec, path)
        except RuntimeError as error:
            assert "dead end" in str(error)
            return None, None
        setup = parse_payload(spec, Path(path).parent, trace_override=path)
        res = run_batch([simulation_from_setup(setup)], record_pressure=True)
    finally:
        os.unlink(path)
    assert res.status[0] == "ok", res.error[0]
    return res, passes


VLLM_SEEDS = range(60)


@pytest.mark.parametrize("seed", VLLM_SEEDS)
def test_vllm_pressure_events_match_the_oracle(seed):
    """Random small vLLM / TRT-LLM replays with tight pools (test_oracle_parity's
    generator): the same preemptions with the same states."""
    rows, spec, _ = test_oracle_parity._random_case(seed)
    res, passes = _kernel_and_oracle(rows, spec, test_oracle_parity._write_trace)
    if res is None:
        return
    frame = res.pressure_events[0]
    assert len(frame) == int(res.requests[0]["preemptions"].sum())
    _assert_same_events(_kernel_events(frame), _oracle_events(passes))


SGLANG_SEEDS = range(40)


@pytest.mark.parametrize("seed", SGLANG_SEEDS)
def test_sglang_pressure_events_match_the_oracle(seed):
    """Random small SGLang replays (tight page pools, page sizes 1 to 16): the same
    retractions with the same states, the logical available and required blocks of
    each decision included."""
    rows, spec = test_oracle_sglang._random_case(seed)
    res, passes = _kernel_and_oracle(rows, spec, test_oracle_sglang._write_trace)
    if res is None:
        return
    frame = res.pressure_events[0]
    assert len(frame) == int(res.requests[0]["preemptions"].sum())
    assert set(frame["kind"]) <= {"sglang_retraction"}
    assert frame["waiting_before"].isna().all()
    assert frame["logical_available_blocks_before"].notna().all()
    _assert_same_events(_kernel_events(frame), _oracle_events(passes))


def test_random_sglang_cases_retract():
    """The generator above reaches retraction often enough to test it."""
    retracting = 0
    for seed in SGLANG_SEEDS:
        rows, spec = test_oracle_sglang._random_case(seed)
        res, _ = _kernel_and_oracle(rows, spec, test_oracle_sglang._write_trace)
        retracting += res is not None and len(res.pressure_events[0]) > 0
    assert retracting >= 5


@pytest.mark.parametrize("case", ["sx-r1", "sx-lpm2", "sx-clip1", "sx-ps16b"])
def test_sglang_reference_runs_have_the_reference_retractions(case):
    """SGLang reference runs with retraction: one event per re-admission the
    reference counts (sx-r1 11, sx-lpm2 23, sx-clip1 232, sx-ps16b 17; in SGLang only
    a retraction re-admits)."""
    folder = DATA / "golden_sglang" / case
    setup = parse_payload(json.loads((folder / "spec.json").read_text()), folder,
                          trace_override=str(folder / "trace.jsonl"))
    res = run_batch([simulation_from_setup(setup)], record_pressure=True).check()
    frame = res.pressure_events[0]
    assert len(frame) == _reference_readmissions(folder / "ref.csv") > 0
    assert (frame["required_blocks_before"] > frame["logical_available_blocks_before"]).all()


def test_random_vllm_cases_preempt():
    """The vLLM generator above reaches preemption often enough to test it."""
    preempting = 0
    for seed in VLLM_SEEDS:
        rows, spec, _ = test_oracle_parity._random_case(seed)
        res, _ = _kernel_and_oracle(rows, spec, test_oracle_parity._write_trace)
        preempting += res is not None and len(res.pressure_events[0]) > 0
    assert preempting >= 4


@pytest.mark.parametrize("case", ["tiny35", "tiny40"])
def test_decode_side_preemptions_of_disaggregated_runs(case):
    """Disaggregated runs whose decode workers preempt (reference runs tiny35 and tiny40):
    one event per preemption of the request records, on decode workers only, each a
    vLLM preemption whose waiting count grows by one."""
    sim = simulation(case)
    res = run_batch([sim], record_pressure=True).check()
    frame = res.pressure_events[0]
    assert len(frame) == int(res.requests[0]["preemptions"].sum()) > 0
    assert set(frame["kind"]) == {"vllm_preemption"}
    assert frame["worker"].min() >= sim.prefill_workers  # prefill workers come first
    assert (frame["waiting_after"] == frame["waiting_before"] + 1).all()
    assert (frame["active_blocks_after"] <= frame["active_blocks_before"]).all()
