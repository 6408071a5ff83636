"""Seeded agentic snapshots (``traffic.agentic_snapshot``, ``trace.agentic_snapshot``)
beyond the goldens of ``test_agentic_traces.py``: five lanes over four plays, so lane 4
replays play 0 again as an instance of its own (its prompts numbered apart, so the two
instances share no cache), against a reference run of the CLI's snapshot payload with
``agentic_lanes: 5`` (``golden_agentic/snapshot_repeat``); and the payload's checks."""

from __future__ import annotations

import json

import pytest

from aisim_fast.cli import app as cli
from aisim_fast.config.payload import ConfigError, parse_payload
from support.paths import DATA_DIR

CASE = DATA_DIR / "golden_agentic" / "snapshot_repeat"


def test_a_play_on_two_lanes_runs_as_two_instances(tmp_path):
    import pandas as pd

    assert cli.main(["replay", "--spec", str(CASE / "spec.json"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    frame = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    ours = {(r.play_id, r.request_id): r for r in frame.itertuples()}
    records = [json.loads(line) for line in (CASE / "ref.jsonl").read_text().splitlines()]
    assert len(records) == len(ours) == 8
    # the same source request in two instances
    assert len({r["request_id"] for r in records}) < len(records)
    for ref in records:
        row = ours[(ref["play_id"], ref["request_id"])]
        assert (row.arrival_ms, row.first_token_ms, row.completion_ms, row.cached_tokens) == (
            ref["arrival_time_ms"], ref["first_token_ms"], ref["terminal_time_ms"], ref["reused_input_tokens"])
        assert row.agentic_request_id == ref["agentic"]["request_id"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    report = json.loads((CASE / "ref.report.json").read_text())
    for key in ("agentic_snapshots", "agentic_play_outcomes", "agentic_lifecycle_digest", "total_trajectories",
                "completed_trajectories", "agentic_graph", "agentic_lanes"):
        assert summary[key] == report[key], key


@pytest.mark.parametrize("edit, words", [
    ({"agentic_lanes": None}, "traffic.agentic_snapshot: agentic_snapshot requires trace_timestamps agentic input "
                              "with positive agentic_lanes"),
    ({"agentic_snapshot": {"seed": 7, "x": 1}}, "traffic.agentic_snapshot.x: unknown field; allowed: seed"),
    ({"agentic_snapshot": {}}, "traffic.agentic_snapshot.seed: missing (an unsigned integer)"),
    ({"agentic_snapshot": {"seed": -1}}, "traffic.agentic_snapshot.seed: must be an unsigned 64-bit integer, got -1"),
    ({"agentic_snapshot": {"seed": 7, "initial_selections": []}}, "traffic.agentic_snapshot.initial_selections: "
     "chosen snapshot cuts (initial_selections, corpus_cursor) are not simulated yet"),
    ({"agentic_warmup": True}, "traffic.agentic_warmup: agentic warm-up and profiles are not simulated yet"),
])
def test_payload_checks(edit, words):
    payload = json.loads((CASE / "spec.json").read_text())
    for key, value in edit.items():
        if value is None:
            payload["traffic"].pop(key)
        else:
            payload["traffic"][key] = value
    with pytest.raises(ConfigError) as err:
        parse_payload(payload, CASE)
    assert str(err.value).startswith(words)


def test_trtllm_is_refused_once_the_graph_is_read_and_cut():
    """The reference reads and cuts the graph before it refuses a TRT-LLM rank, so a
    cut that crosses an unresolved dependency is the error it names (differential seed
    504 cases 35, 165, 252 keep such runs); a clean cut names the backend."""
    from aisim_fast.engine.simulation import simulation_from_setup

    payload = json.loads((CASE / "spec.json").read_text())
    payload["spec"]["engine"]["rank"]["backend"] = "trtllm"
    setup = parse_payload(payload, CASE)  # the payload alone is accepted
    with pytest.raises(ConfigError) as err:
        simulation_from_setup(setup)
    assert str(err.value) == "spec.engine.rank.backend: agentic replay supports only vLLM and SGLang backends"


def test_predict_config_lowers_as_the_references_cli():
    """The captured config (``cli-payloads/formats/agentic_snapshot``, its trace renamed)
    lowers to the payload the reference's CLI wrote, key for key."""
    from aisim_fast.config.predict_config import read_predict_config
    golden = DATA_DIR / "golden_agentic"
    assert read_predict_config(golden / "cli_agentic_snapshot.predict.yaml") == json.loads(
        (golden / "cli_agentic_snapshot.spec.json").read_text())
