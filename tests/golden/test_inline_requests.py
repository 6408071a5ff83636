"""Requests given inline in a payload (``spec.requests``), against reference runs.

``tests/data/golden_inline/NAME.payload.json`` lists its requests inline: length-only
ones (the reference synthesizes their tokens), ones whose ``input_token_ids`` repeat the
first request's synthesized tokens (0, 1, 2, ...), and ones sharing a random prefix;
``inline_tight`` on two workers of 40 blocks (queueing, a preemption), ``inline_roomy``
on one. ``NAME.csv`` is the reference's per-request record (``run_replay_json`` of the
payload, canonical request ids: a request's uuid is its place in the list), keyed by the
request's id; ``NAME.report.json`` keys of its report.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import ConfigError, ConfigWarning, parse_payload
from aisim_fast.trace.inline_requests import inline_workload, parse_inline_requests
from aisim_fast.trace.workload import prompt_tokens
from support.cli_runs import run_cli
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_inline"
CASES = sorted(p.name[:-len(".payload.json")] for p in GOLDEN.glob("*.payload.json"))
TIMES = ("arrival_ms", "first_admit_ms", "first_token_ms", "last_token_ms", "completion_ms")
COUNTS = ("cached_tokens", "output_tokens", "worker", "admission_count")


def payload_of(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.payload.json").read_text())


def test_cases_present():
    assert CASES == ["inline_roomy", "inline_tight"]


@pytest.mark.parametrize("case", CASES)
def test_requests_and_report_match_the_reference(case, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(payload_of(case)))
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", "--spec", spec, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    ours = pd.read_parquet(out / "requests.parquet").set_index("request_id")
    gold = pd.read_csv(GOLDEN / f"{case}.csv").set_index("request_id")
    assert sorted(ours.index) == sorted(gold.index)
    ours = ours.loc[gold.index]
    for col in TIMES:
        assert np.abs(ours[col].to_numpy(float) - gold[col].to_numpy(float)).max() <= 1e-9, col
    for col in COUNTS:
        assert (ours[col].to_numpy(np.int64) == gold[col].to_numpy(np.int64)).all(), col
    assert (ours["terminal_status"] == gold["terminal_status"]).all()
    summary = json.loads((out / "summary.json").read_text())
    for key, want in json.loads((GOLDEN / f"{case}.report.json").read_text()).items():
        assert math.isclose(summary[key], want, rel_tol=1e-9, abs_tol=1e-12), key
    assert summary["aisim_fast.config"]["trace_path"] is None


def test_prompts_are_the_references():
    """Length-only request i: tokens i * 1,000,003 + 0, 1, 2, ... (u32); the first one's
    are 0, 1, 2, ...; explicit ids as written. One-token trace blocks hold them."""
    reqs = parse_inline_requests([
        {"id": "a", "arrival_time_ms": 5.0, "input_tokens": 3, "output_tokens": 1},
        {"id": "b", "arrival_time_ms": 1.0, "input_tokens": 2, "output_tokens": 2},
        {"id": "c", "arrival_time_ms": 1.0, "input_tokens": 2, "input_token_ids": [7, 4294967295],
         "output_tokens": 1, "metadata": {"priority": 0}},
    ])
    w = inline_workload(reqs)
    assert w.trace_block_size == 1 and list(w.request_name) == ["a", "b", "c"]
    assert prompt_tokens(w, 0).tolist() == [0, 1, 2]
    assert prompt_tokens(w, 1).tolist() == [1_000_003, 1_000_004]
    assert prompt_tokens(w, 2).tolist() == [7, 4294967295]
    # arrivals as written (not re-based), equal ones in list order
    assert w.start_ms.tolist() == [5.0, 1.0, 1.0] and w.order.tolist() == [1, 2, 0]
    assert inline_workload(reqs, max_rows=1).num_requests == 1


def _payload(requests, **extra) -> dict:
    return {"spec": {"topology": {"kind": "aggregated", "workers": {"initial_workers": 1}},
                     "engine": {"rank": {"backend": "vllm"}}, "requests": requests, **extra}}


REQ = {"id": "a", "arrival_time_ms": 0.0, "input_tokens": 4, "output_tokens": 2}


@pytest.mark.parametrize("requests, extra, words", [
    ([REQ, REQ], {}, r"spec\.requests\[1\]\.id: duplicate request id 'a'"),
    ([dict(REQ, input_token_ids=[1, 2])], {}, r"spec\.requests\[0\]\.input_token_ids: declares 4 input tokens"),
    ([dict(REQ, input_token_ids=[1, 2, 3, -1])], {}, r"spec\.requests\[0\]\.input_token_ids: must be a list"),
    ([dict(REQ, arrival_time_ms=-1.0)], {}, r"spec\.requests\[0\]\.arrival_time_ms: must be finite"),
    ([dict(REQ, dp_rank=1)], {}, r"spec\.requests\[0\]\.dp_rank: a preferred attention-DP rank"),
    ([dict(REQ, metadata={"priority": 3})], {}, r"spec\.requests\[0\]\.metadata\.priority: request priorities"),
    ([dict(REQ, colour=1)], {}, r"spec\.requests\[0\]\.colour: unknown field"),
    ([REQ], {"max_in_flight": 2}, r"spec\.max_in_flight: a cap on inline requests"),
])
def test_bad_inline_requests_are_named(requests, extra, words):
    with pytest.raises(ConfigError, match="^" + words):
        parse_payload(_payload(requests, **extra))


def test_requests_and_a_trace_do_not_mix():
    with pytest.raises(ConfigError, match="inline requests or a traffic source, not both"):
        parse_payload(dict(_payload([REQ]), traffic={"trace_path": "t.jsonl"}))
    with pytest.raises(ConfigError, match="a trace cannot replace them"):
        parse_payload(_payload([REQ]), trace_override="t.jsonl")


def test_a_list_out_of_arrival_order_runs_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = parse_payload(_payload([dict(REQ, arrival_time_ms=5.0), dict(REQ, id="b")]))
    assert [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)][0].startswith(
        "spec.requests: not in arrival order")
    assert len(setup.requests) == 2


def test_max_in_flight_apart_from_the_replay_concurrency_warns_and_caps_nothing():
    """The reference's workload driver reads no spec.max_in_flight beside a traffic
    source (measured on open and closed loops, tests/data/golden_synthetic/syn_conc8_cap4):
    a different cap warns once and runs as without it."""
    payload = {"spec": {"topology": {"kind": "aggregated", "workers": {"initial_workers": 1}},
                        "engine": {"rank": {"backend": "vllm"}}, "max_in_flight": 4},
               "traffic": {"trace_path": "t.jsonl"}}
    with pytest.warns(ConfigWarning, match=r"spec\.max_in_flight: 4 differs from replay_concurrency \(none\)"):
        capped = parse_payload(payload)
    assert capped.concurrency == 0
    payload["traffic"].update(load_type="concurrency", replay_concurrency=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_payload(payload).concurrency == 4
    payload["spec"]["max_in_flight"] = 0
    with pytest.raises(ConfigError, match=r"^spec\.max_in_flight: must be an integer >= 1"):
        parse_payload(payload)
