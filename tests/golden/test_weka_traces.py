"""Weka / AgentX corpora (``trace_format: weka``, ``trace.weka``) against reference runs
(tests/data/golden_weka).

Runs: the two payloads the reference's CLI writes for Weka configs (two plays on two
lanes, and their seeded snapshot) and ten crafted corpora: blocking and background
subagents, relative nested times on SGLang, a preamble with partial and missing hash
blocks, a seam spliced back with a cascade, a disjoint stream anchored to the root
with replay barriers, a subagent of two streams sped up, three plays of one JSONL file
on one lane, an inner preamble under the absolute basis, a seam gap under a snapshot,
and a directory corpus. Every request's timeline is bit-exact, and the report's agentic
keys (the graph and its digest, the source digest, outcomes, trajectories, lifecycle,
snapshots) and ``weka_nested_timestamp_basis`` equal.

Loader: fifteen corpora (``golden_weka/loader``) lower to the graph the reference
builds, checked on its graph digest (every node and edge) and source digest (recorded
from the reference's runs of the same files).
"""

from __future__ import annotations

import json

import pytest

from aisim_fast.cli import app as cli
from aisim_fast.report.agentic import graph_digest
from aisim_fast.trace.weka import load_weka
from aisim_fast.trace.workload import TraceError
from support import goldens
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_weka"
CASES = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json"))
LOADER = GOLDEN / "loader"
EXPECTED = json.loads((LOADER / "expected.json").read_text())
REPORT_KEYS = ("num_requests", "completed_requests", "agentic_graph", "agentic_input_format", "agentic_lanes",
               "agentic_play_outcomes", "agentic_lifecycle_event_count", "agentic_lifecycle_digest",
               "total_trajectories", "completed_trajectories", "mean_trajectory_e2e_latency_ms",
               "weka_nested_timestamp_basis")


def test_cases_present():
    assert CASES == ["cli_weka", "cli_weka_snapshot", "dir_corpus", "t10_two_streams_speedup",
                     "t12_three_plays_lane1", "t14_inner_preamble", "t16_seam_gap", "t1_blocking_background",
                     "t5_relative_sglang", "t6_preamble_partial", "t8_seam_cascade", "t9_anchor_barriers"]


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory):
    case = request.param
    return (case, *goldens.replay_spec_case(case, GOLDEN, tmp_path_factory.mktemp(case) / "run"))


def test_requests_match_the_reference(run):
    case, requests, _ = run
    goldens.assert_matches_golden(case, GOLDEN, requests)


def test_report_keys_match_the_reference(run):
    case, requests, summary = run
    report = json.loads((GOLDEN / f"{case}.report.json").read_text())
    keys = REPORT_KEYS + (("agentic_snapshots",) if "agentic_snapshots" in report else ())
    for key in keys:
        if isinstance(report[key], float):
            assert summary[key] == pytest.approx(report[key], rel=1e-12), key
        else:
            assert summary[key] == report[key], key
    records = {(r["play_id"], r["request_id"]): r for r in map(json.loads, (GOLDEN / f"{case}.jsonl").read_text()
                                                               .splitlines())}
    for row in requests.itertuples():
        ref = records[(row.play_id, row.request_id)]
        assert (row.session_id, row.agentic_request_id, row.dispatched_at_ms) == (
            ref["session_id"], ref["agentic"]["request_id"], ref["dispatched_at_ms"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_lowers_to_the_references_graph(name):
    w = load_weka(LOADER / name)
    assert (graph_digest(w.agentic), w.agentic.source_digest) == (EXPECTED[name]["graph_digest"],
                                                                  EXPECTED[name]["source_digest"])
    assert w.agentic.input_format == "weka" and w.agentic.source_format == "weka"


def _corpus(tmp_path, *plays, name="c.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(p) + "\n" for p in plays))
    return path


def _play(**over):
    play = {"id": "p", "models": ["m"], "block_size": 4, "hash_id_scope": "local",
            "requests": [{"t": 0, "type": "n", "model": "m", "in": 8, "out": 1, "hash_ids": [1, 2]}]}
    play.update(over)
    return play


@pytest.mark.parametrize("play, words", [
    (_play(id=" "), "Weka trace c.jsonl#000000 has an empty id"),
    (_play(hash_id_scope="global"), 'Weka trace c.jsonl#000000 has unsupported hash_id_scope "global"; expected local'),
    (_play(models=["x"]), 'Weka trace c.jsonl#000000 contains request models absent from its declaration: '
                          'declared {"x"}, found {"m"}'),
    (_play(requests=[{"t": 0, "type": "n", "model": "m", "in": 0, "out": 1}]),
     "Weka trace c.jsonl#000000 has a zero-length request"),
    (_play(requests=[{"t": 0, "type": "n", "model": "m", "in": 4, "out": 1},
                     {"t": 1, "type": "subagent", "agent_id": "f", "subagent_type": "x", "status": "failed",
                      "requests": []}]),
     'Weka trace c.jsonl#000000 has unsupported non-success subagent status "failed" for f'),
    (_play(requests=[{"t": 0, "type": "n", "model": "m", "in": 4, "out": 1},
                     {"t": 1, "type": "subagent", "agent_id": "f", "subagent_type": "x", "status": "completed",
                      "requests": []}]),
     "Weka trace c.jsonl#000000 has blocking subagent f with no replayable requests; external waits are not "
     "modeled"),
    (_play(requests=[{"t": 1, "type": "subagent", "agent_id": "o", "subagent_type": "x", "status": "async_launched",
                      "requests": [{"t": 1, "type": "n", "model": "m", "in": 4, "out": 1}]},
                     {"t": 2, "type": "n", "model": "m", "in": 4, "out": 1}]),
     "Weka trace c.jsonl#000000 has subagent o at outer index 0 without a preceding parent request"),
])
def test_refusals_are_the_references(tmp_path, play, words):
    with pytest.raises(TraceError) as err:
        load_weka(_corpus(tmp_path, play))
    assert err.value.reason == words


def test_mixed_block_sizes_and_the_payloads_block_size(tmp_path):
    with pytest.raises(TraceError, match="Weka corpus mixes block sizes: c.jsonl#000001 has 8, expected 4"):
        load_weka(_corpus(tmp_path, _play(), _play(block_size=8)))
    with pytest.raises(TraceError, match="Weka source block size 4 does not match configured block size 8"):
        load_weka(_corpus(tmp_path, _play()), trace_block_size=8)


@pytest.mark.parametrize("case", ["cli_weka", "cli_weka_snapshot"])
def test_predict_config_lowers_as_the_references_cli(case):
    """The captured configs (``cli-payloads/formats/weka*``) lower to the payloads the
    reference's CLI wrote, key for key."""
    from aisim_fast.config.predict_config import read_predict_config
    assert read_predict_config(GOLDEN / f"{case}.predict.yaml") == json.loads((GOLDEN / f"{case}.spec.json")
                                                                               .read_text())


def test_replay_from_flags(tmp_path):
    """``--trace-format weka`` takes the corpus's own block size and names a target model."""
    out = tmp_path / "run"
    assert cli.main(["replay", str(GOLDEN / "weka_2plays.jsonl"), "--trace-format", "weka", "--agentic-lanes", "2",
                     "--backend", "vllm", "--workers", "1", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agentic_input_format"] == "weka" and summary["num_requests"] == 6
