"""Agentic Dynamo request traces (``trace.dynamo_agentic``): the graph the reference
lowers sessions, child sessions, tool events and ``replay.dependencies`` to, checked on
its graph digest (which covers every edge: source, trigger, relation, delay), and its
refusals in its words, each placed at the record to blame. The digests and messages
are the reference's, from runs of these same traces (``aisimulate`` 0.13.0.dev, run by
hand: ``benchmarks/ref_payload_run.py`` on ``golden_agentic/cli_dynamo_agentic.spec.json``
with the trace swapped)."""

from __future__ import annotations

import json

import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.engine.simulation import setup_workload
from aisim_fast.report.agentic import graph_digest
from aisim_fast.trace.formats import load_trace
from aisim_fast.trace.workload import TraceError
from support.paths import DATA_DIR

EPOCH = 1_000_000


def req(rid, start, session, parent=None, dur=100, inlen=128, hashes=None, deps=None):
    """A request_end record; its hash ids are drawn from its id (same ids, same prompt)."""
    n = -(-inlen // 64)
    seed = sum(ord(c) * 31 ** k for k, c in enumerate(rid)) % 100_000
    replay = {"trace_block_size": 64, "input_length": inlen,
              "input_sequence_hashes": hashes if hashes is not None else [seed + i for i in range(n)]}
    if deps is not None:
        replay["dependencies"] = deps
    ctx = {"session_id": session} if session is not None else None
    if parent:
        ctx["parent_session_id"] = parent
    ev = {"schema": "dynamo.request.trace.v1", "event_type": "request_end", "event_time_unix_ms": EPOCH + start + dur,
          "request": {"request_id": rid, "model": "m", "output_tokens": 5, "request_received_ms": EPOCH + start,
                      "total_time_ms": float(dur), "replay": replay}}
    if ctx is not None:
        ev["agent_context"] = ctx
    return ev


def tool(session, source, child, consumer=None, mode="blocking", tid="t1"):
    claude = {"source_request_id": source, "execution_mode": mode, "child_session_id": child}
    if consumer:
        claude["consumer_request_id"] = consumer
    return {"schema": "dynamo.request.trace.v1", "event_type": "tool_end", "event_time_unix_ms": EPOCH + 10,
            "agent_context": {"session_id": session},
            "tool": {"tool_call_id": tid, "tool_class": "agent", "started_at_unix_ms": EPOCH,
                     "ended_at_unix_ms": EPOCH + 10, "claude": claude}}


def dep(rid, relation="join", trigger="completion"):
    return {"request_id": rid, "relation": relation, "trigger": trigger}


def write(tmp_path, events, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


GRAPHS = {
    # a blocking tool names the child: spawned from its source, joined into its consumer
    "tool_child": ([req("p0", 0, "P"), tool("P", "p0", "C", "p2"), req("c0", 120, "C", "P"),
                    req("c1", 300, "C", "P"), req("p1", 150, "P"), req("p2", 700, "P")],
                   "305beea47e1b2f034866a1a68ff514bfaafae847d1f42304a6439d43cc2741bd", 1),
    # a child linked by its times: spawned by the parent request started last before it,
    # joined into the first that starts after its end
    "timed_child": ([req("p0", 0, "P"), req("p1", 100, "P"), req("c0", 120, "C", "P"), req("c1", 250, "C", "P"),
                     req("p2", 400, "P")],
                    "372bf83d14e495fb67167fadf184aca02348fe6c9ef27660919d897b66877fdb", 1),
    # an exporter's edge across sessions joins two plays
    "explicit_join": ([req("a0", 0, "S"), req("b0", 10, "T"), req("a1", 300, "S", deps=[dep("b0")])],
                      "ce5df58c4e5d0f35d4a4bf45d933f1bcccfd02c46d1c93f3bb3426c9bdf9b09b", 1),
    # an exporter's edge repeating the session's own (same source, same trigger): dropped
    "explicit_repeat": ([req("a0", 0, "S"), req("a1", 300, "S", deps=[dep("a0")])],
                        "cb74614aafed809be07d557b133627091a3fdcc0aa720c62b59c73875e0f270c", 1),
    # a dispatch edge: the child starts with its source's dispatch plus the gap
    "explicit_dispatch": ([req("a0", 0, "S"), req("b0", 30, "T", deps=[dep("a0", "spawn", "dispatch")])],
                          "065ccb86e962223540a511269f4c9e4c371062846805487b290fbf4bdb6b0178", 1),
    # a tool naming a session without parent_session_id links nothing
    "unparented_child": ([req("p0", 0, "P"), tool("P", "p0", "C", "p1"), req("c0", 120, "C"), req("p1", 600, "P")],
                         "3d982f132869ea8e49cde15026dc8c59751950cdcb761620dc081307349e9bb0", 2),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_digest_is_the_references(tmp_path, name):
    events, digest, plays = GRAPHS[name]
    w = load_trace(write(tmp_path, events), "dynamo", agentic_lanes=2)
    assert (graph_digest(w.agentic), len(w.agentic.play_names)) == (digest, plays)
    assert w.agentic.input_format == "dynamo"
    assert w.agentic.source_format == "dynamo.request.trace.v1"
    assert w.agentic.source_digest == f"requests:{w.agentic.num_nodes};tools:{sum('tool' in e for e in events)}"


REFUSALS = {
    # a request that starts before the one before it ended: a negative delay
    "overlap": ([req("a0", 0, "S", dur=200), req("a1", 100, "S")], 2, "trace line 3 has invalid dependency delay -100"),
    "later": ([req("a0", 0, "S", deps=[dep("b0")]), req("b0", 30, "T")], 1,
              'request "a0" depends on later request "b0"'),
    "unknown_dep": ([req("a0", 0, "S"), req("b0", 30, "T", deps=[dep("zz")])], 2,
                    'request "b0" depends on unknown request_id "zz"'),
    "dep_without_trigger": ([req("a0", 0, "S"), req("b0", 30, "T", deps=[{"request_id": "a0", "relation": "join"}])],
                            2, "missing field `trigger`"),
    "hash_count": ([req("a0", 0, "S"), req("b0", 30, "T", hashes=[1, 2, 3])], 2,
                   "trace line 3 has input_length 128 at block_size 64 and requires exactly 2 hash_ids, got 3"),
    "unknown_parent": ([req("p0", 0, "P"), req("c0", 120, "C", "Q")], 2,
                       'child session "C" references unknown parent session "Q"'),
    "two_parents": ([req("p0", 0, "P"), req("c0", 120, "C", "P"), req("c1", 300, "C", "X"), req("x0", 5, "X")], 3,
                    'session "C" has conflicting parent_session_id values "P" and "X"'),
    "tool_mode": ([req("p0", 0, "P"), tool("P", "p0", "C", mode="weird"), req("c0", 120, "C", "P")], 2,
                  'tool "t1" (agent) has unsupported execution_mode "weird"'),
    "tool_unknown": ([req("p0", 0, "P"), tool("P", "zz", "C"), req("c0", 120, "C", "P")], 2,
                     'tool "t1" references unknown request_id "zz"'),
    "tool_session": ([req("p0", 0, "P"), tool("P", "c0", "C"), req("c0", 120, "C", "P")], 2,
                     'tool "t1" request "c0" belongs to session "C", expected "P"'),
    "two_tools": ([req("p0", 0, "P"), tool("P", "p0", "C"), tool("P", "p0", "C", tid="t2"),
                   req("c0", 120, "C", "P")], 3, 'multiple tool events reference child session "C"'),
    "tool_source_elsewhere": ([req("p0", 0, "P"), req("x0", 0, "X"), tool("X", "x0", "C"), req("c0", 120, "C", "P")],
                              3, 'tool "t1" source request "x0" is not in parent session "P"'),
    "mixed": ([req("p0", 0, "P"), req("z", 5, None)], None,
              "Dynamo request trace cannot mix requests with and without agent_context"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_are_the_references(tmp_path, name):
    events, line, words = REFUSALS[name]
    path = write(tmp_path, events)
    with pytest.raises(TraceError) as err:
        load_trace(path, "dynamo")
    assert (err.value.line_no, err.value.reason) == (line, words)
    assert err.value.path == path


def test_lanes_need_an_agentic_trace(tmp_path):
    path = write(tmp_path, [{k: v for k, v in req("a", 0, None).items()}])
    with pytest.raises(ValueError, match="^agentic_lanes requires an agentic Dynamo trace$"):
        load_trace(path, "dynamo", agentic_lanes=2)


def test_max_rows_keeps_whole_plays(tmp_path):
    events = [req("a0", 0, "S"), req("a1", 200, "S"), req("b0", 1000, "T"), req("b1", 1200, "T")]
    w = load_trace(write(tmp_path, events), "dynamo", max_rows=3)
    assert list(w.request_name) == ["a0", "a1"]


CLI_SPEC = DATA_DIR / "golden_agentic" / "cli_dynamo_agentic.spec.json"


@pytest.mark.parametrize("edit, field, words", [
    ({"execution_model": None}, "traffic.execution_model", "agentic execution requires a configured target model"),
    ({"replay_concurrency": 2}, "traffic.replay_concurrency", "agentic Dynamo trace does not support concurrency load"),
    ({"max_sim_time_ms": 500}, "traffic.max_sim_time_ms", "agentic Dynamo trace does not support max virtual time"),
    # the model is checked first, as the reference checks it
    ({"execution_model": None, "max_sim_time_ms": 500}, "traffic.execution_model",
     "agentic execution requires a configured target model"),
])
@pytest.mark.filterwarnings("ignore::aisim_fast.config.payload.ConfigWarning")  # traffic.max_sim_time_ms
def test_payload_refusals_once_the_trace_is_agentic(edit, field, words):
    payload = json.loads(CLI_SPEC.read_text())
    for key, value in edit.items():
        if value is None:
            payload["traffic"].pop(key, None)
        else:
            payload["traffic"][key] = value
    setup = parse_payload(payload, CLI_SPEC.parent)  # the payload alone cannot tell
    with pytest.raises(ConfigError) as err:
        setup_workload(setup)
    assert str(err.value) == f"{field}: {words}"


def test_predict_config_lowers_as_the_references_cli():
    """The captured config (``cli-payloads/formats/dynamo_agentic``, its trace renamed)
    lowers to the payload the reference's CLI wrote, key for key: lanes and the target
    model included."""
    from aisim_fast.config.predict_config import read_predict_config
    lowered = read_predict_config(CLI_SPEC.parent / "cli_dynamo_agentic.predict.yaml")
    assert lowered == json.loads(CLI_SPEC.read_text())
