"""``applied_compute_agentic`` traces: tool-calling agents as sessions, read as the
reference reads them.

A row ``{num_turns, input_prompt_length, assistant_response_length[],
tool_call_output_length[], tool_call_latency[] (seconds),
final_assistant_response_length}`` on line L is one session,
``applied_compute_agentic_session_L`` (blank lines count), of ``num_turns + 1``
turns. Turn k (k < num_turns) sends ``len_k`` prompt tokens and generates
``assistant_response_length[k]``; the last turn generates
``final_assistant_response_length``; ``len_0 = input_prompt_length`` and ``len_{k+1}
= len_k + assistant_response_length[k] + tool_call_output_length[k]``. Turn k + 1
arrives ``tool_call_latency[k]`` seconds (divided by ``arrival_speedup_ratio``)
after turn k ends.

Prompts are synthesised, not the model's output: each session owns a run of
``ceil(len_last / trace_block_size)`` block ids from one file-wide counter (line
order, then block order, from 0), and turn k's prompt is its first ``len_k`` tokens
(each id repeated ``trace_block_size`` times), so a turn extends its predecessor's
prompt token for token whatever that turn emitted. Every session starts at 0 (the
reference's CLI runs the format under a concurrency load). Shared prefixes across
sessions are off, as in the reference's runtime.
"""

from __future__ import annotations

import json
import math

import numpy as np

from aisim_fast.trace.workload import TraceError, Workload, read_trace_bytes

_LISTS = ("assistant_response_length", "tool_call_output_length", "tool_call_latency")


def load_applied_compute(path, *, trace_block_size: int = 512, arrival_speedup_ratio: float = 1.0,
                         max_rows: int | None = None) -> Workload:
    """Load an ``applied_compute_agentic`` JSONL trace (gzip too) as a ``Workload``
    (``max_rows``: the first that many sessions)."""
    path_str = str(path)
    block = int(trace_block_size)
    names, session, turn, input_len, output_len, delay_ms, line_nos = [], [], [], [], [], [], []
    starts, spans = [], []  # per session: its first block id, its block count
    next_id = 0
    for line_no, raw in enumerate(read_trace_bytes(path_str).split(b"\n"), 1):
        if not raw.strip():
            continue
        if max_rows is not None and len(starts) >= max_rows:
            break
        row = _row(path_str, line_no, raw)
        s = len(starts)
        lengths = [row["input_prompt_length"]]
        for k in range(row["num_turns"]):
            lengths.append(lengths[-1] + row["assistant_response_length"][k] + row["tool_call_output_length"][k])
        outputs = list(row["assistant_response_length"]) + [row["final_assistant_response_length"]]
        for k, (n_in, n_out) in enumerate(zip(lengths, outputs)):
            names.append(f"applied_compute_agentic_session_{line_no}")
            session.append(s)
            turn.append(k)
            input_len.append(n_in)
            output_len.append(n_out)
            delay_ms.append(0.0 if k == 0 else row["tool_call_latency"][k - 1] * 1000.0)
            line_nos.append(line_no)
        n_blocks = -(-lengths[-1] // block)
        starts.append(next_id)
        spans.append(n_blocks)
        next_id += n_blocks
    if not starts:
        raise TraceError(path_str, None, "no requests (the file is empty or has only blank lines)")
    if next_id > 1 << 32:
        raise TraceError(path_str, None, "more block ids than u32 can represent")
    n = len(names)
    session_arr = np.array(session, np.int32)
    turn_arr = np.array(turn, np.int32)
    first = turn_arr == 0
    start_ms = np.where(first, 0.0, np.nan)
    request_name = np.empty(n, dtype=object)
    request_name[:] = names
    # a session's turns share its run of ids (Workload: starts only, the last entry the
    # array's length): turn k reads the first ceil(len_k / block) of them
    return Workload(
        path=path_str,
        trace_block_size=block,
        line_no=np.array(line_nos, np.int64),
        request_name=request_name,
        session=session_arr,
        turn_index=turn_arr,
        start_ms=start_ms,
        delay_ms=np.array(delay_ms, np.float64) / float(arrival_speedup_ratio),
        input_len=np.array(input_len, np.int64),
        output_len=np.array(output_len, np.int64),
        hash_indptr=np.append(np.array(starts, np.int64)[session_arr], next_id).astype(np.int64),
        hash_ids=np.arange(next_id, dtype=np.uint32),
        order=np.flatnonzero(first).astype(np.int64),
    )


def _row(path: str, line_no: int, raw: bytes) -> dict:
    """One row, checked as the reference checks it (its words)."""
    def fail(reason: str):
        raise TraceError(path, line_no, reason)

    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail(f"invalid JSON: {exc}")
    if type(row) is not dict:
        fail("a row must be a JSON object")
    for key in ("num_turns", "input_prompt_length", *_LISTS, "final_assistant_response_length"):
        if key not in row:
            fail(f"missing field `{key}`")
    for key in ("num_turns", "input_prompt_length", "final_assistant_response_length"):
        if type(row[key]) is not int or row[key] < 0:
            fail(f"{key} must be a non-negative integer, got {row[key]!r}")
    if row["input_prompt_length"] == 0:
        fail("input_prompt_length must be positive")
    for key in _LISTS:
        values = row[key]
        if type(values) is not list:
            fail(f"{key} must be a list, got {values!r}")
        if len(values) != row["num_turns"]:
            fail(f"field {key} length {len(values)} does not match num_turns {row['num_turns']}")
        for k, v in enumerate(values):
            if key == "tool_call_latency":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    fail(f"tool_call_latency[{k}] must be a finite non-negative number")
            elif type(v) is not int or v < 0:
                fail(f"{key}[{k}] must be a non-negative integer, got {v!r}")
    return row
