"""Dynamo request traces (``trace_format: dynamo``, schema
``dynamo.request.trace.v1``): the records Dynamo's frontend writes, read as the
reference reads them.

Each ``request_end`` event (bare, or wrapped as ``{"event": {...}}``) is one request:
its prompt is ``request.replay.input_sequence_hashes``, each hash
``replay.trace_block_size`` tokens (the trace's own block size: every row's must be
equal, and a payload's ``trace_block_size``, when given, must match it), cut at
``replay.input_length``; it generates ``request.output_tokens``. ``request_payload``
and ``tool_start`` events are skipped, any other event type but tool ends refused.
Several files (``trace_paths``, ``.gz`` by name) are read as one trace: requests are
ordered by (start, end, request id), start being ``request_received_ms`` (or the event
time less the rounded ``total_time_ms``) and end ``received + round(total_time_ms)`` (or
the event time).

Without ``agent_context`` on its requests the trace is single-turn traffic: a request
arrives at ``start - the first start`` (divided by ``arrival_speedup_ratio``) and is
named ``request_<its place in that order>``, the names the reference reports; hash ids
are interned in first appearance over that order. The result is the Mooncake trace the
reference lowers it to, request for request. With ``agent_context`` on every request
it is an agentic trace: sessions, tools and parents become a dependency graph
(``dynamo_agentic``). A trace cannot mix the two.
"""

from __future__ import annotations

import gzip
import json
import math

import numpy as np

from aisim_fast.trace.workload import TraceError, Workload, intern_hash_ids

SCHEMA = "dynamo.request.trace.v1"
_SKIPPED = ("request_payload", "tool_start")
_TOOL_ENDS = ("tool_end", "tool_error")


class DynamoRequest:
    """One ``request_end`` record as the loaders use it (times in epoch ms)."""
    __slots__ = ("start_ms", "end_ms", "request_id", "path", "line_no", "block", "input_length", "hashes",
                 "output_tokens", "model", "session_id", "parent_session_id", "dependencies")


class DynamoTool:
    """One terminal tool event with ``agent_context`` and ``tool`` (what an agentic
    trace links child sessions by)."""
    __slots__ = ("session_id", "tool_call_id", "tool_class", "source_request_id", "consumer_request_id",
                 "child_session_id", "execution_mode", "path", "line_no")


def load_dynamo(paths, *, trace_block_size: int | None = None, arrival_speedup_ratio: float = 1.0,
                max_rows: int | None = None, agentic_lanes: int | None = None,
                cut=None) -> Workload:
    """Load one or more Dynamo request-trace files as one ``Workload``
    (``trace_block_size``: the payload's, None when it gives none; ``max_rows``: the
    first that many requests after ordering, whole plays of an agentic trace;
    ``agentic_lanes``: plays of an agentic trace run N at a time, None: all at once;
    ``cut``: an agentic trace's seeded cuts, as ``agentic_graph.graph_workload``'s)."""
    paths = [str(p) for p in ([paths] if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__")
                              else paths)]
    requests, tools = _read(paths)
    contextual = sum(r.session_id is not None for r in requests)
    if contextual not in (0, len(requests)):
        raise TraceError(paths[0], None, "Dynamo request trace cannot mix requests with and without "
                                         "agent_context")
    block = requests[0].block
    if block <= 0:
        raise TraceError(requests[0].path, requests[0].line_no, "embedded trace block size must be positive")
    if any(r.block != block for r in requests):
        raise TraceError(paths[0], None, "mixed replay trace_block_size values are not supported")
    if trace_block_size is not None and trace_block_size != block:
        raise TraceError(paths[0], None, f"trace_block_size {trace_block_size} does not match embedded Dynamo "
                                         f"request trace block size {block}")
    requests.sort(key=lambda r: (r.start_ms, r.end_ms, r.request_id.encode()))  # stable: ties keep file order
    if contextual:
        from aisim_fast.trace.dynamo_agentic import lower_agentic
        return lower_agentic(paths[0], requests, tools, block, arrival_speedup_ratio=arrival_speedup_ratio,
                             lanes=agentic_lanes, max_rows=max_rows, cut=cut)
    if agentic_lanes is not None:
        raise ValueError("agentic_lanes requires an agentic Dynamo trace")
    if max_rows is not None:
        requests = requests[:max_rows]
    for i, r in enumerate(requests):
        if r.input_length > len(r.hashes) * block:
            raise TraceError(r.path, r.line_no, f"trace line {i + 1} input_length {r.input_length} exceeds hash_ids "
                                                f"capacity {len(r.hashes) * block}")
    n = len(requests)
    first_ms = min(r.start_ms for r in requests)
    counts = np.array([len(r.hashes) for r in requests], np.int64)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    names = np.empty(n, dtype=object)
    names[:] = [f"request_{i + 1}" for i in range(n)]
    start_ms = np.array([r.start_ms - first_ms for r in requests], np.float64) / float(arrival_speedup_ratio)
    return Workload(
        path=paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)",
        trace_block_size=int(block),
        line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names,
        session=np.arange(n, dtype=np.int32),
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=np.array([r.input_length for r in requests], np.int64),
        output_len=np.array([r.output_tokens for r in requests], np.int64),
        hash_indptr=indptr,
        hash_ids=intern_hash_ids([h for r in requests for h in r.hashes]),
        order=np.argsort(start_ms, kind="stable").astype(np.int64),
    )


def _read(paths: list) -> tuple[list, list]:
    """Every request of the files, in file order, and every tool event an agentic
    trace could link by, with the reference's checks and words."""
    requests: list[DynamoRequest] = []
    tools: list[DynamoTool] = []
    seen: dict[str, tuple[str, int]] = {}
    for path in paths:
        for line_no, obj in _records(path):
            event = obj.get("event", obj)
            if type(event) is not dict:
                raise TraceError(path, line_no, '"event" must be an object')
            kind = event.get("event_type", obj.get("event_type"))
            if kind in _SKIPPED:
                continue
            if kind not in ("request_end", *_TOOL_ENDS):
                raise TraceError(path, line_no, "request trace supports request_end, terminal tool events, "
                                                f"request_payload, and tool_start; got {kind!r}")
            for key in ("schema", "event_type", "event_time_unix_ms"):
                if key not in event:
                    raise TraceError(path, line_no, f"missing field `{key}`")
            if event["schema"] != SCHEMA:
                raise TraceError(path, line_no, f"unsupported Dynamo request trace schema {event['schema']!r}")
            event_ms = _u64(event["event_time_unix_ms"], "event_time_unix_ms", path, line_no)
            context = _context(event.get("agent_context"), path, line_no)
            if kind in _TOOL_ENDS:
                tool = _tool(event, context, event_ms, path, line_no)
                if tool is not None:
                    tools.append(tool)
                continue
            r = _request(event, context, event_ms, path, line_no)
            if r.request_id in seen:
                first = seen[r.request_id]
                raise TraceError(path, line_no, f"duplicate request_id {r.request_id!r} (first at {first[0]}:"
                                                f"{first[1]})")
            seen[r.request_id] = (path, line_no)
            requests.append(r)
    if not requests:
        raise TraceError(paths[0], None, "Dynamo trace contains no request_end records")
    return requests, tools


def _context(raw, path: str, line_no: int) -> tuple | None:
    """``agent_context`` as (session id, parent session id or None), None when absent."""
    if raw is None:
        return None
    if type(raw) is not dict:
        raise TraceError(path, line_no, "agent_context must be an object")
    session = _str(raw, "session_id", path, line_no, required=True)
    return session, _str(raw, "parent_session_id", path, line_no)


def _request(event: dict, context, event_ms: int, path: str, line_no: int) -> DynamoRequest:
    request = event.get("request")
    if request is None:
        raise TraceError(path, line_no, "request_end is missing request metrics")
    if type(request) is not dict:
        raise TraceError(path, line_no, "`request` must be an object")
    r = DynamoRequest()
    r.path, r.line_no = path, line_no
    r.request_id = _str(request, "request_id", path, line_no, required=True)
    if not r.request_id.strip():
        raise TraceError(path, line_no, "request_id must be nonempty")
    r.model = _str(request, "model", path, line_no)
    replay = request.get("replay")
    if type(replay) is not dict:
        raise TraceError(path, line_no, "missing field `replay`")
    for key in ("trace_block_size", "input_length", "input_sequence_hashes"):
        if key not in replay:
            raise TraceError(path, line_no, f"missing field `replay.{key}`")
    r.block = _u64(replay["trace_block_size"], "replay.trace_block_size", path, line_no)
    r.input_length = _u64(replay["input_length"], "replay.input_length", path, line_no)
    hashes = replay["input_sequence_hashes"]
    if type(hashes) is not list:
        raise TraceError(path, line_no, "replay.input_sequence_hashes must be a list")
    r.hashes = [_u64(h, "replay.input_sequence_hashes[]", path, line_no) for h in hashes]
    r.dependencies = _dependencies(replay.get("dependencies"), path, line_no)
    if request.get("output_tokens") is None:
        raise TraceError(path, line_no, f"request {r.request_id!r}: missing output_tokens")
    r.output_tokens = _u64(request["output_tokens"], "output_tokens", path, line_no)
    received = request.get("request_received_ms")
    received = None if received is None else _u64(received, "request_received_ms", path, line_no)
    total = request.get("total_time_ms")
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, (int, float)) or not math.isfinite(total) or total < 0:
            raise TraceError(path, line_no, "request duration must be finite and nonnegative")
        total = math.floor(total + 0.5)  # Rust's f64::round: half away from zero
    r.end_ms = received + total if received is not None and total is not None else event_ms
    r.start_ms = received if received is not None else max(0, event_ms - (total or 0))
    r.session_id, r.parent_session_id = context if context is not None else (None, None)
    return r


_RELATIONS = ("sequence", "spawn", "join", "replay_barrier")
_TRIGGERS = ("dispatch", "completion")


def _dependencies(raw, path: str, line_no: int) -> list:
    """``replay.dependencies``: the edges an exporter knew (request id, relation,
    trigger), every field required."""
    if raw is None:
        return []
    if type(raw) is not list:
        raise TraceError(path, line_no, "replay.dependencies must be a list")
    out = []
    for d in raw:
        if type(d) is not dict:
            raise TraceError(path, line_no, "a replay dependency must be an object")
        rid = _str(d, "request_id", path, line_no, required=True)
        relation = _str(d, "relation", path, line_no, required=True)
        if relation not in _RELATIONS:
            raise TraceError(path, line_no, f"unknown variant `{relation}`, expected one of `sequence`, `spawn`, "
                                            "`join`, `replay_barrier`")
        trigger = _str(d, "trigger", path, line_no, required=True)
        if trigger not in _TRIGGERS:
            raise TraceError(path, line_no, f"unknown variant `{trigger}`, expected `dispatch` or `completion`")
        out.append((rid, relation, trigger))
    return out


def _tool(event: dict, context, event_ms: int, path: str, line_no: int) -> DynamoTool | None:
    """A terminal tool event with both ``agent_context`` and ``tool``, checked; None
    for one without either (it links nothing)."""
    raw = event.get("tool")
    if raw is not None and type(raw) is not dict:
        raise TraceError(path, line_no, "`tool` must be an object")
    if raw is not None:
        tool_call_id = _str(raw, "tool_call_id", path, line_no, required=True)
        tool_class = _str(raw, "tool_class", path, line_no, required=True)
        claude = raw.get("claude")
        if claude is not None:
            if type(claude) is not dict:
                raise TraceError(path, line_no, "`tool.claude` must be an object")
            source = _str(claude, "source_request_id", path, line_no, required=True)
            consumer = _str(claude, "consumer_request_id", path, line_no)
            child = _str(claude, "child_session_id", path, line_no)
            mode = _str(claude, "execution_mode", path, line_no, required=True)
        started, ended = raw.get("started_at_unix_ms"), raw.get("ended_at_unix_ms")
        started = None if started is None else _u64(started, "started_at_unix_ms", path, line_no)
        ended = None if ended is None else _u64(ended, "ended_at_unix_ms", path, line_no)
        duration = raw.get("duration_ms")
        if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))):
            raise TraceError(path, line_no, "duration_ms must be a number")
    if context is None or raw is None:
        return None
    if not context[0].strip():
        raise TraceError(path, line_no, "tool session_id must be nonempty")
    if not tool_call_id.strip():
        raise TraceError(path, line_no, "tool_call_id must be nonempty")
    if not tool_class.strip():
        raise TraceError(path, line_no, "tool_class must be nonempty")
    if duration is not None and not (math.isfinite(duration) and duration >= 0):
        raise TraceError(path, line_no, "tool duration must be finite and nonnegative")
    end = ended if ended is not None else event_ms
    start = started if started is not None else (end - math.floor(duration + 0.5) if duration is not None else end)
    if end < start:
        raise TraceError(path, line_no, "tool end time precedes start time")
    t = DynamoTool()
    t.session_id, t.tool_call_id, t.tool_class, t.path, t.line_no = context[0], tool_call_id, tool_class, path, line_no
    t.source_request_id = t.consumer_request_id = t.child_session_id = t.execution_mode = None
    if claude is not None:
        t.source_request_id, t.consumer_request_id, t.child_session_id, t.execution_mode = source, consumer, child, mode
    return t


def _str(obj: dict, key: str, path: str, line_no: int, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise TraceError(path, line_no, f"missing field `{key}`")
        return None
    if type(value) is not str:
        raise TraceError(path, line_no, f"`{key}` must be a string, got {json.dumps(value)[:60]}")
    return value


def _records(path: str):
    """(line number, JSON object) of every non-blank line that holds an object (others
    are skipped, as the reference skips them)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise TraceError(path, None, f"cannot read ({exc.strerror or exc})") from None
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceError(path, None, f"not a readable gzip file ({exc})") from None
    for line_no, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(path, line_no, f"invalid JSON: {exc}") from None
        if type(obj) is dict:
            yield line_no, obj


def _u64(value, name: str, path: str, line_no: int) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise TraceError(path, line_no, f"{name} must be an unsigned integer, got {value!r}")
    return value
