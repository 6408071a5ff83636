"""SGLang's host loop (kernels.sglang.host_loop) and frontend stages
(kernels.sglang.frontend) against reference runs (tests/data/golden_sglang_host_loop):
every request's timeline bit for bit, its frontend-ready / received / selected /
prefill-complete milestones, the report's stage means, the predict configs lowered as
the reference's CLI lowers them, and the iteration timeline's rules on their own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.config.predict_config import read_predict_config
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.sglang import host_loop as hl
from aisim_fast.report.summary import host_loop_means
from support import goldens
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_sglang_host_loop"
CASES = sorted(p.name[:-len(".payload.json")] for p in GOLDEN.glob("*.payload.json"))
_RUNS: dict = {}


def payload_of(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.payload.json").read_text())


def run(case: str):
    if case not in _RUNS:
        payload = payload_of(case)
        trace = DATA_DIR / "traces" / Path(payload["traffic"]["trace_path"]).name
        setup = parse_payload(payload, GOLDEN, trace_override=str(trace))
        assert setup.rank.sglang_host_loop
        _RUNS[case] = run_batch([simulation_from_setup(setup)]).check().requests[0]
    return _RUNS[case]


def reference_rows(case: str) -> dict:
    return goldens.read_golden(case, GOLDEN)


def test_cases_present():
    assert len(CASES) == 10 and sum(case.startswith("fe_") for case in CASES) == 4


@pytest.mark.parametrize("case", CASES)
def test_requests_match_the_reference(case):
    gold = reference_rows(case)
    cand = goldens.index_frame(run(case))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    diffs = timeline_differences(gold, cand)
    assert not diffs, f"{case}: {len(diffs)} cells differ, first {diffs[:3]}"


@pytest.mark.parametrize("case", CASES)
def test_milestones_and_stage_means_match_the_reference(case):
    requests = run(case)
    want = pd.read_csv(GOLDEN / f"{case}.milestones.csv", dtype={"request_id": str})
    got = requests.set_index(["request_id", "turn_index"])
    want = want.set_index(["request_id", "turn_index"]).loc[got.index]
    columns = ["scheduler_received_ms", "selected_ms", "prefill_complete_ms"]
    if "frontend_ready_ms" in want:
        columns.append("frontend_ready_ms")
    for column in columns:
        assert np.array_equal(got[column].to_numpy(), want[column].to_numpy()), column
    report = json.loads((GOLDEN / f"{case}.report.json").read_text())
    means = host_loop_means(requests)
    for key, value in means.items():
        # sums in the reference's row order: equal to the last bits
        assert value == pytest.approx(report[key], rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("case", ["hl_tiny20", "fe_tiny20"])
def test_predict_config_lowers_to_the_captured_payload(case):
    mine = read_predict_config(GOLDEN / f"{case}.predict.yaml")
    captured = payload_of(case)
    assert mine["spec"]["engine"] == captured["spec"]["engine"]
    assert mine["spec"]["engine"]["rank"]["sglang"] == {"chunked_prefill_size": 8192, "host_loop": True}


@pytest.mark.parametrize("edit, words", [
    ({"sglang": {"host_loop": False}}, "frontend stages run ahead of the scheduler loop"),
    ({"frontend": {"stages": []}}, r"frontend\.stages: must be a list of at least one stage"),
    ({"frontend": {"stages": [{"workers": 0, "service_ms": 1.0}]}}, r"stages\[0\]\.workers"),
    ({"frontend": {"stages": [{"workers": 1, "service_ms": -1.0}]}}, r"stages\[0\]\.service_ms"),
    ({"frontend": {"stages": [{"workers": 1, "service_ms": 1.0, "concurrency_scale": [0.0]}]}},
     r"concurrency_scale\[0\]: must be finite and > 0"),
    ({"frontend": {"stages": [{"workers": 1, "service_ms": 1.0, "speed": 2}]}}, r"stages\[0\]\.speed: unknown"),
])
def test_bad_frontend_stages_are_refused_by_field(edit, words):
    payload = payload_of("fe_tiny20")
    rank = payload["spec"]["engine"]["rank"]
    for key, value in edit.items():
        rank[key] = {**rank[key], **value} if key == "sglang" else value
    with pytest.raises(ConfigError, match=r"^spec\.engine\.rank\.(frontend|sglang)") as err:
        parse_payload(payload, GOLDEN, trace_override=str(DATA_DIR / "traces" / "mooncake_tiny20.jsonl"))
    assert re.search(words, str(err.value)), str(err.value)


def test_host_loop_is_refused_where_the_reference_refuses_it():
    payload = payload_of("hl_tiny20")
    rank = payload["spec"]["engine"]["rank"]
    disagg = {"spec": {**payload["spec"], "topology": {"kind": "disaggregated",
                                                       "prefill": {"initial_workers": 1},
                                                       "decode": {"initial_workers": 1}},
                       "engine": {"prefill": {"rank": rank}, "decode": {"rank": {**rank, "sglang": {}}}}},
              "traffic": payload["traffic"]}
    with pytest.raises(ConfigError, match=r"^spec\.engine\.prefill\.rank\.sglang\.host_loop: sglang\.host_loop is "
                                          "supported only for aggregated ranks"):
        parse_payload(disagg, GOLDEN)
    dp = json.loads(json.dumps(payload))
    dp["spec"]["engine"]["dp_size"] = 2
    with pytest.raises(ConfigError, match="host_loop: the SGLang host loop with attention DP"):
        parse_payload(dp, GOLDEN)


class _Worker:
    def __init__(self):
        self.i64 = np.zeros((1, L.WK_FIELDS), np.int64)


def test_iteration_timeline_rules():
    """The reference's own cases: a forward is observed when the next iteration
    synchronizes with it; one launched behind it queues on the GPU; an iteration
    without a batch only observes."""
    wk = _Worker()
    forward_end, iteration_end = hl.forward_end.py_func, hl.iteration_end.py_func  # (kernel-only)
    gpu_end = forward_end(wk, 0, 0.0, 20.0)  # launched at 0 for 20 ms
    assert gpu_end == 20.0
    assert iteration_end(wk, 0, 0.0, True, gpu_end) == (0.0, False)  # nothing to observe yet
    gpu_end = forward_end(wk, 0, 5.0, 15.0)  # 10 ms launched at 5 runs 20..30
    assert gpu_end == 30.0
    assert iteration_end(wk, 0, 5.0, True, gpu_end) == (20.0, True)
    assert iteration_end(wk, 0, 12.0, False, 0.0) == (30.0, True)  # observes, launches nothing
    assert wk.i64[0, L.WK_HL_IN_FLIGHT] == 0
    assert iteration_end(wk, 0, 40.0, False, 0.0) == (40.0, False)
