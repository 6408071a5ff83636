"""Agentic Dynamo request traces: ``request_end`` records that all carry
``agent_context``, lowered to the dependency graph an agentic Mooncake trace spells
out (``agentic_graph``), as the reference lowers them.

* Requests are ordered by (start, end, request id) (``dynamo_requests``) and grouped
  by ``agent_context.session_id``. Each request of a session depends on the one before
  it: a completion edge, relation ``sequence``, delayed by its start less the earlier
  one's end. A request that started before the earlier one ended is refused (the
  delay would be negative), as the reference refuses it.
* ``request.replay.dependencies`` (``request_id``, ``relation``, ``trigger``): edges an
  exporter knew, to an earlier request; delayed by the start less the source's start
  (dispatch) or end (completion).
* A session with ``parent_session_id`` is a child. When a terminal tool event of the
  parent (``tool.claude``: ``source_request_id``, ``consumer_request_id``,
  ``child_session_id``, ``execution_mode`` blocking | background) names it, the child's
  first request is spawned from the tool's source request (dispatch) and the
  consumer, when given, joins the child's last request (completion). Without such a
  tool, the spawn comes from the parent request that started last at or before the
  child's first start, and the join goes to the parent request that starts first at or
  after the child's last end, when there are such requests.
* An edge from the same request with the same trigger as one already there is
  dropped. A request without edges (a root) starts at its start less the trace's first
  start; the others at 0 plus their edges. Plays are the graph's connected
  components, named ``dynamo-play:<root with the smallest (start, request id)>``.
* The graph's source is ``{format: dynamo.request.trace.v1, digest:
  "requests:N;tools:M"}`` (M: the tool events with ``agent_context`` and ``tool``).
"""

from __future__ import annotations

import json

from aisim_fast.trace.agentic_graph import (TRIGGER_COMPLETION, TRIGGER_DISPATCH, RELATIONS, TRIGGERS, GraphRow,
                                            check_speedup, component_play_ids, graph_workload)
from aisim_fast.trace.workload import TraceError, Workload

SOURCE_FORMAT = "dynamo.request.trace.v1"
_SEQUENCE, _SPAWN, _JOIN = RELATIONS.index("sequence"), RELATIONS.index("spawn"), RELATIONS.index("join")


def lower_agentic(path: str, requests: list, tools: list, block: int, *, arrival_speedup_ratio: float,
                  lanes: int | None, max_rows: int | None, cut=None) -> Workload:
    """The graph of ``requests`` (``dynamo_requests.DynamoRequest``, in (start, end,
    request id) order, every one with a session) and ``tools``
    (``dynamo_requests.DynamoTool``) as a ``Workload``; errors in the reference's words,
    placed at the record when one is to blame."""
    ratio = check_speedup(arrival_speedup_ratio)
    index = {r.request_id: i for i, r in enumerate(requests)}
    sessions: dict[str, list[int]] = {}
    parent_of: dict[str, str] = {}
    for i, r in enumerate(requests):
        if not r.session_id.strip():
            raise TraceError(r.path, r.line_no, "session_id must be nonempty")
        sessions.setdefault(r.session_id, []).append(i)
        if r.parent_session_id is not None:
            known = parent_of.setdefault(r.session_id, r.parent_session_id)
            if known != r.parent_session_id:
                raise TraceError(r.path, r.line_no, f"session {_debug(r.session_id)} has conflicting "
                                                    f"parent_session_id values {_debug(known)} and "
                                                    f"{_debug(r.parent_session_id)}")
    edges: list[list[tuple]] = [[] for _ in requests]

    def link(source: int, target: int, trigger: int, relation: int) -> None:
        src = requests[source]
        at_ms = src.start_ms if trigger == TRIGGER_DISPATCH else src.end_ms
        if any(e[0] == src.request_id and e[1] == trigger for e in edges[target]):
            return
        edges[target].append((src.request_id, trigger, float(requests[target].start_ms - at_ms), relation))

    for members in sessions.values():
        for a, b in zip(members, members[1:]):
            link(a, b, TRIGGER_COMPLETION, _SEQUENCE)
    for i, r in enumerate(requests):
        for rid, relation, trigger in r.dependencies:
            j = index.get(rid)
            if j is None:
                raise TraceError(r.path, r.line_no, f"request {_debug(r.request_id)} depends on unknown request_id "
                                                    f"{_debug(rid)}")
            if j >= i:
                raise TraceError(r.path, r.line_no, f"request {_debug(r.request_id)} depends on later request "
                                                    f"{_debug(rid)}")
            link(j, i, TRIGGERS.index(trigger), RELATIONS.index(relation))
    by_child = _tools_by_child(tools, requests, index, sessions)
    for child, parent in parent_of.items():
        kids = sessions[child]
        if parent not in sessions:
            r = requests[kids[0]]
            raise TraceError(r.path, r.line_no, f"child session {_debug(child)} references unknown parent session "
                                                f"{_debug(parent)}")
        elders = sessions[parent]
        first = kids[0]
        last = max(kids, key=lambda k: (requests[k].end_ms, requests[k].start_ms, requests[k].request_id.encode()))
        tool = by_child.get(child)
        if tool is not None:

            def parent_request(role: str, rid: str) -> int:
                k = index[rid]
                if k not in elders:
                    raise TraceError(tool.path, tool.line_no, f"tool {_debug(tool.tool_call_id)} {role} request "
                                                              f"{_debug(rid)} is not in parent session {_debug(parent)}")
                return k
            link(parent_request("source", tool.source_request_id), first, TRIGGER_DISPATCH, _SPAWN)
            if tool.consumer_request_id is not None:
                link(last, parent_request("consumer", tool.consumer_request_id), TRIGGER_COMPLETION, _JOIN)
            continue
        # the parent request that started last at or before the child (the later of equal
        # starts), and the one that starts first at or after the child's end (the earlier)
        before = [e for e in elders if requests[e].start_ms <= requests[first].start_ms]
        if before:
            latest = max(requests[e].start_ms for e in before)
            link([e for e in before if requests[e].start_ms == latest][-1], first, TRIGGER_DISPATCH, _SPAWN)
        after = [e for e in elders if requests[e].start_ms >= requests[last].end_ms]
        if after:
            link(last, min(after, key=lambda e: requests[e].start_ms), TRIGGER_COMPLETION, _JOIN)
    first_ms = min(r.start_ms for r in requests)
    rows = []
    for i, r in enumerate(requests):
        g = GraphRow()
        g.line, g.origin = i + 2, (r.path, r.line_no)
        g.request_id, g.play_id, g.session_id = r.request_id, None, r.session_id
        g.model = r.model if r.model is not None else "unknown"
        g.input_length, g.output_length, g.hash_ids = r.input_length, r.output_tokens, r.hashes
        g.output_token_ids = g.recorded_api_time_ms = g.source_play_ordinal = g.policy_class = None
        g.priority = g.strict_priority = 0
        g.dependencies = edges[i]
        g.not_before_ms = 0.0 if edges[i] else float(r.start_ms - first_ms)
        g.recorded_interval = (float(r.start_ms - first_ms), float(r.end_ms - first_ms))
        rows.append(g)
    component_play_ids(rows, "dynamo-play")
    header = (block, SOURCE_FORMAT, f"requests:{len(rows)};tools:{len(tools)}")
    return graph_workload(path, header, rows, input_format="dynamo", ratio=ratio, lanes=lanes, max_rows=max_rows,
                          cut=cut)


def _tools_by_child(tools: list, requests: list, index: dict, sessions: dict) -> dict:
    """The tool event that names each child session (of those with requests), checked
    as the reference checks every tool with ``claude`` metadata."""
    by_child: dict = {}
    for t in tools:
        if t.execution_mode is None:
            continue
        if t.execution_mode not in ("blocking", "background"):
            raise TraceError(t.path, t.line_no, f"tool {_debug(t.tool_call_id)} ({t.tool_class}) has unsupported "
                                                f"execution_mode {_debug(t.execution_mode)}")
        for rid in (t.source_request_id, t.consumer_request_id):
            if rid is None:
                continue
            if rid not in index:
                raise TraceError(t.path, t.line_no, f"tool {_debug(t.tool_call_id)} references unknown request_id "
                                                    f"{_debug(rid)}")
            owner = requests[index[rid]].session_id
            if owner != t.session_id:
                raise TraceError(t.path, t.line_no, f"tool {_debug(t.tool_call_id)} request {_debug(rid)} belongs "
                                                    f"to session {_debug(owner)}, expected {_debug(t.session_id)}")
        if t.child_session_id is None or t.child_session_id not in sessions:
            continue
        if t.child_session_id in by_child:
            raise TraceError(t.path, t.line_no, "multiple tool events reference child session "
                                                f"{_debug(t.child_session_id)}")
        by_child[t.child_session_id] = t
    return by_child


def _debug(s: str) -> str:
    """A string as Rust's Debug writes it (quoted, escaped)."""
    return json.dumps(s, ensure_ascii=False)
