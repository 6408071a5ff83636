"""Dynamo request traces (``trace_format: dynamo``, schema
``dynamo.request.trace.v1``): the records Dynamo's frontend writes, read as the
reference reads them when they carry no ``agent_context``.

Each ``request_end`` event (bare, or wrapped as ``{"event": {...}}``) is one
single-turn request: its prompt is ``request.replay.input_sequence_hashes``, each
hash ``replay.trace_block_size`` tokens (the trace's own block size: every row's must
be equal, and a payload's ``trace_block_size``, when given, must match it), cut at
``replay.input_length``; it generates ``request.output_tokens``. ``request_payload``
and ``tool_start`` events are skipped, tool ends without ``agent_context`` ignored,
any other event type refused. Several files (``trace_paths``, ``.gz`` by name) are
read as one trace: requests are ordered by (start, end, request id), start being
``request_received_ms`` (or the event time less the rounded ``total_time_ms``) and
end ``received + round(total_time_ms)`` (or the event time); a request arrives at
``start - the first start`` (divided by ``arrival_speedup_ratio``) and is named
``request_<its place in that order>``, the names the reference reports. Hash ids are
interned in first appearance over that order. The result is the Mooncake trace the
reference lowers it to, request for request.

Traces with ``agent_context`` (agentic sessions, tools, parents) are refused: agentic
replay is not simulated yet.
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


def load_dynamo(paths, *, trace_block_size: int | None = None, arrival_speedup_ratio: float = 1.0,
                max_rows: int | None = None) -> Workload:
    """Load one or more Dynamo request-trace files as one ``Workload``
    (``trace_block_size``: the payload's, None when it gives none; ``max_rows``: the
    first that many requests after ordering)."""
    paths = [str(p) for p in ([paths] if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__")
                              else paths)]
    entries = []  # (start, end, request id bytes, file, line, block, input_length, hashes, output)
    seen: dict[str, tuple[str, int]] = {}
    agentic = plain = False
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
            if event.get("agent_context") is not None:
                agentic = True
            if kind in _TOOL_ENDS:
                continue  # a tool's end matters to agentic traces only
            plain = plain or event.get("agent_context") is None
            request = event.get("request")
            if type(request) is not dict:
                raise TraceError(path, line_no, "a request_end event needs its `request`")
            rid = request.get("request_id")
            if type(rid) is not str or not rid.strip():
                raise TraceError(path, line_no, "request_id must be a non-empty string")
            if rid in seen:
                raise TraceError(path, line_no, f"duplicate request_id {rid!r} (first at {seen[rid][0]}:{seen[rid][1]})")
            seen[rid] = (path, line_no)
            replay = request.get("replay")
            if type(replay) is not dict:
                raise TraceError(path, line_no, "missing field `replay`")
            for key in ("trace_block_size", "input_length", "input_sequence_hashes"):
                if key not in replay:
                    raise TraceError(path, line_no, f"missing field `replay.{key}`")
            block = _u64(replay["trace_block_size"], "replay.trace_block_size", path, line_no)
            n_in = _u64(replay["input_length"], "replay.input_length", path, line_no)
            hashes = replay["input_sequence_hashes"]
            if type(hashes) is not list:
                raise TraceError(path, line_no, "replay.input_sequence_hashes must be a list")
            hashes = [_u64(h, "replay.input_sequence_hashes[]", path, line_no) for h in hashes]
            if request.get("output_tokens") is None:
                raise TraceError(path, line_no, f"request {rid!r}: missing output_tokens")
            n_out = _u64(request["output_tokens"], "output_tokens", path, line_no)
            received = request.get("request_received_ms")
            received = None if received is None else _u64(received, "request_received_ms", path, line_no)
            total = request.get("total_time_ms")
            if total is not None:
                if isinstance(total, bool) or not isinstance(total, (int, float)) or not math.isfinite(total) \
                        or total < 0:
                    raise TraceError(path, line_no, "total_time_ms must be a finite number >= 0")
                total = math.floor(total + 0.5)  # Rust's f64::round: half away from zero
            end = received + total if received is not None and total is not None else event_ms
            start = received if received is not None else max(0, event_ms - (total or 0))
            entries.append((start, end, rid.encode(), path, line_no, block, n_in, hashes, n_out))
    if not entries:
        raise TraceError(paths[0], None, "Dynamo trace contains no request_end records")
    if agentic:
        if plain:
            raise TraceError(paths[0], None, "Dynamo request trace cannot mix requests with and without "
                                             "agent_context")
        raise TraceError(paths[0], None, "requests with agent_context (an agentic Dynamo trace) are not "
                                         "simulated yet; a trace without it replays as the reference's")
    block = entries[0][5]
    if block <= 0:
        raise TraceError(entries[0][3], entries[0][4], "embedded trace block size must be positive")
    if any(e[5] != block for e in entries):
        raise TraceError(paths[0], None, "mixed replay trace_block_size values are not supported")
    if trace_block_size is not None and trace_block_size != block:
        raise TraceError(paths[0], None, f"trace_block_size {trace_block_size} does not match embedded Dynamo "
                                         f"request trace block size {block}")
    entries.sort(key=lambda e: (e[0], e[1], e[2]))  # stable: equal keys keep file order
    if max_rows is not None:
        entries = entries[:max_rows]
    for i, e in enumerate(entries):
        if e[6] > len(e[7]) * block:
            raise TraceError(e[3], e[4], f"trace line {i + 1} input_length {e[6]} exceeds hash_ids capacity "
                                         f"{len(e[7]) * block}")
    n = len(entries)
    first_ms = min(e[0] for e in entries)
    counts = np.array([len(e[7]) for e in entries], np.int64)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    names = np.empty(n, dtype=object)
    names[:] = [f"request_{i + 1}" for i in range(n)]
    start_ms = np.array([e[0] - first_ms for e in entries], np.float64) / float(arrival_speedup_ratio)
    return Workload(
        path=paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)",
        trace_block_size=int(block),
        line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names,
        session=np.arange(n, dtype=np.int32),
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=np.array([e[6] for e in entries], np.int64),
        output_len=np.array([e[8] for e in entries], np.int64),
        hash_indptr=indptr,
        hash_ids=intern_hash_ids([h for e in entries for h in e[7]]),
        order=np.argsort(start_ms, kind="stable").astype(np.int64),
    )


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
