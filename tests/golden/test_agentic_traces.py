"""Agentic traces (``trace_format: agentic_mooncake``, and ``dynamo`` records with
``agent_context``) against reference runs (tests/data/golden_agentic).

``cli_*``: the three payloads the reference's CLI writes for agentic configs (a v2
graph of three plays with spawns and joins, on two lanes and without; legacy rows on
two lanes). ``agentic_*``: random graphs of the differential's generator
(``benchmarks/differential.py``: plays of up to 12 requests, completion and dispatch
triggers, delays, second roots, prompts over a play's shared prefix, authored output
ids, a prompt no pool holds so its play fails and skips its unsent requests) on two
vLLM workers over 900 KV blocks with lanes, one vLLM worker of ``max_num_seqs`` 2,
two SGLang workers, disaggregated vLLM 1P1D, and legacy rows sped up. ``*dynamo*``:
the CLI's agentic Dynamo payload (three sessions on two lanes) and random agent plays
of the differential's generator (``random_dynamo_agentic``: sessions in sequence, child
sessions linked by tool events or by their times, explicit ``replay.dependencies``, a
prompt no pool holds) on the same four configurations, with and without lanes and
sped up and slowed down. ``*snapshot*``: seeded snapshots (``agentic_snapshot``): the CLI's payload (two lanes
over four sequence plays) and random graphs (v2 on three lanes, SGLang, disaggregated,
agentic Dynamo records on four lanes), each lane a play cut at its sampled instant;
the report's ``agentic_snapshots`` evidence is compared too.
``agentic_vllm_agg1_failed_root``: a play of two roots whose first is rejected
before the second's start, which is then never sent. ``agentic_vllm_agg3_tie``: two
one-request plays whose
passes end at one instant on two of three workers (fixed timing); the reference
applies both pass ends as one feedback batch, so its lifecycle records both terminals
before either quiescence. Every request's
timeline is bit-exact, its graph identity (play, session, root, spawning parent, the
lane the run gave its play, dispatch time) equal, and the report's agentic keys equal:
the graph and its digest, play outcomes, trajectory statistics, the lifecycle's event
count and digest.
"""

from __future__ import annotations

import json

import pytest

from support import goldens
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_agentic"
CASES = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json"))
TRAJECTORY_KEYS = ("total_trajectories", "completed_trajectories", "incomplete_trajectories",
                   *(f"{s}_trajectory_e2e_latency_ms" for s in ("mean", "median", "min", "max", "std", "p50", "p75",
                                                                   "p90", "p95", "p99")))
AGENTIC_KEYS = ("agentic_input_format", "agentic_lanes", "agentic_qualification", "agentic_model_projection",
                "agentic_play_outcomes", "agentic_lifecycle_event_count", "agentic_lifecycle_digest")


def test_cases_present():
    assert CASES == ["agentic_sglang_agg2", "agentic_vllm_agg1_failed_root", "agentic_vllm_agg1_legacy",
                     "agentic_vllm_agg1_seqs2", "agentic_vllm_agg2_kv900", "agentic_vllm_agg3_tie",
                     "agentic_vllm_disagg1p1d", "cli_agentic_legacy", "cli_agentic_snapshot", "cli_agentic_v2",
                     "cli_agentic_v2_nolanes", "cli_dynamo_agentic", "dynamo_sglang_agg2", "dynamo_vllm_agg1_seqs2",
                     "dynamo_vllm_agg2_lanes2", "dynamo_vllm_disagg1p1d", "snapshot_dynamo_vllm_agg1_lanes4",
                     "snapshot_sglang_agg2_lanes2", "snapshot_vllm_agg2_lanes3", "snapshot_vllm_disagg1p1d_lanes2"]


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory):
    case = request.param
    return (case, *goldens.replay_spec_case(case, GOLDEN, tmp_path_factory.mktemp(case) / "run"))


def test_requests_match_the_reference(run):
    case, requests, _ = run
    goldens.assert_matches_golden(case, GOLDEN, requests)


def test_graph_identity_matches_the_reference(run):
    case, requests, _ = run
    records = {r["request_id"]: r for r in map(json.loads, (GOLDEN / f"{case}.jsonl").read_text().splitlines())}
    assert set(records) == set(requests["request_id"])
    for row in requests.itertuples():
        ref = records[row.request_id]
        ours = {"request_id": row.agentic_request_id, "play_id": row.play_id,
                "conversation_id": row.agentic_conversation_id, "root_id": row.agentic_root_id,
                "parent_id": row.agentic_parent_id, "lane_id": row.agentic_lane_id, "cache_id": row.agentic_cache_id}
        assert {k: v for k, v in ours.items() if isinstance(v, str)} == ref["agentic"], row.request_id
        assert (row.play_id, row.session_id, row.dispatched_at_ms) == (ref["play_id"], ref["session_id"],
                                                                       ref["dispatched_at_ms"])


def test_report_keys_match_the_reference(run):
    case, _, summary = run
    report = json.loads((GOLDEN / f"{case}.report.json").read_text())
    snapshots = ("agentic_snapshots",) if "agentic_snapshots" in report else ()
    for key in ("num_requests", "completed_requests", *TRAJECTORY_KEYS, *AGENTIC_KEYS, *snapshots):
        assert summary[key] == pytest.approx(report[key], rel=1e-12, abs=1e-9) if isinstance(report[key], float) \
            else summary[key] == report[key], key
    graph, ref_graph = dict(summary["agentic_graph"]), dict(report["agentic_graph"])
    if ref_graph["source"]["format"] == "legacy_agentic_mooncake":
        # a legacy trace's provenance is the path the payload names, then its row count
        named = json.loads((GOLDEN / f"{case}.spec.json").read_text())["traffic"]["trace_path"]
        assert graph.pop("source") == {"format": "legacy_agentic_mooncake", "digest": f"{named}:{graph['node_count']}"}
        ref_graph.pop("source")
    assert graph == ref_graph
