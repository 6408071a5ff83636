"""Mooncake JSONL trace loader.

A trace is lowered into a ``Workload``: a structure of numpy arrays with one row per trace
row (= one request = one turn of a session), in file order.  The semantics follow the
reference simulator's native Mooncake loader (spec replay.md section 3.1):

* every non-blank line is one JSON object = one turn; rows sharing ``session_id`` form a
  session in file order, a row without ``session_id`` is its own session named
  ``request_<line number>`` (1-based, blank lines count) -- that name is also the request
  identity the reference writes into its per-request CSV;
* a session's first turn starts at its ``timestamp``; starts are re-based so that the
  earliest one is 0 and then divided by ``arrival_speedup_ratio``;
* a later turn is released ``delay_ms`` after the PREVIOUS TURN COMPLETES (think time), not
  at an absolute time, so it has no ``start_ms`` (NaN);
* hash ids are interned to dense uint32 ids in order of first appearance in the file and
  the prompt is synthesized from them block by block (``prompt_tokens``).

Parsing is plain ``json.loads`` per line; the per-row work is kept to dictionary lookups
and type checks so that a 100k-row trace loads in about a second.  Interning and the
CSR layout of the hash ids are done once at the end with numpy.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aisim_fast.kernels.jit import compile_notice, mark_compiled
from aisim_fast.kernels.trace.output_plan import output_token_ids, plan_offsets
from aisim_fast.kernels.trace.scan import SCAN_OK, scan_simple_trace
from aisim_fast.trace.growing_arrays import append_into

__all__ = [
    "DEFAULT_TRACE_NAME",
    "TraceError",
    "Workload",
    "concat_workloads",
    "sequence_tokens",
    "default_trace_path",
    "load_default_trace",
    "load_mooncake",
    "prompt_tokens",
    "rows_output_plan",
    "select_rows",
]

# Bundled default trace: the first 3000 rows of the public Mooncake conversation trace
# (see datasets/README.md), installed as package data of ``aisim_fast.datasets``.
DEFAULT_TRACE_NAME = "mooncake_conversation_3k.jsonl"
_DATASETS_PACKAGE = "aisim_fast.datasets"

_U64_END = 1 << 64
_U32_END = 1 << 32
_I32_MIN, _I32_END = -(1 << 31), 1 << 31
# Lengths are stored as int64; anything at or above 2**63 cannot be a real token count.
_I64_END = 1 << 63


class TraceWarning(UserWarning):
    """A trace the loader reads as the reference does, but whose rows look like a
    mistake (a field left out, a misspelt key). The message is ``<path>:<line>: ...``
    with the first such row and how many there are; the CLI prints it as one line."""


# the row fields the reference's Mooncake loader knows (with their aliases), and the
# trace's own workers for kv_router's pin_to_trace_worker (aggregated: ``worker``;
# disaggregated: ``prefill_worker`` and ``decode_worker``, each an index in its pool)
PIN_KEYS = ("worker", "prefill_worker", "decode_worker")
ROW_KEYS = frozenset({
    "timestamp", "created_time", "input_length", "input_tokens", "output_length", "output_tokens",
    "hash_ids", "session_id", "delay", "delay_ms", "request_id", "output_token_ids", "priority",
    "strict_priority", "policy_class", *PIN_KEYS})


def _encoding_guess(raw: bytes) -> str:
    """What a line that is not UTF-8 looks like, for the error message."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw:
        return "it looks like UTF-16 or UTF-32 (byte order mark or NUL bytes); save it as UTF-8"
    try:
        raw.decode("cp1252")
    except UnicodeDecodeError:
        return "its encoding is unknown; save it as UTF-8"
    return "it looks like Latin-1 / Windows-1252; save it as UTF-8"


def _warn_rows(path: str, line_no: int, count: int, what: str) -> None:
    rows = "this row" if count == 1 else f"{count:,} rows like this one"
    warnings.warn(f"{path}:{line_no}: {what} ({rows})", TraceWarning, stacklevel=3)


def _warn_lenient_rows(path: str, no_timestamp: list, derived: list, unknown: dict) -> None:
    """One warning per kind of lenient row: (first line, count) lists, and the first
    line of each unknown key."""
    if no_timestamp:
        _warn_rows(path, no_timestamp[0], len(no_timestamp),
                   'no "timestamp": the session starts at 0 ms (before re-basing), as in the '
                   "reference; give one for an open-loop replay")
    if derived:
        _warn_rows(path, derived[0], len(derived),
                   'no "input_length": taken as its hash_ids x trace_block_size tokens, as the '
                   "reference does")
    for key, (line_no, count) in unknown.items():
        _warn_rows(path, line_no, count, f"unknown field {key!r} ignored, as the reference does "
                                         "(known: " + ", ".join(sorted(ROW_KEYS)) + ")")


class TraceError(ValueError):
    """A trace file that cannot be loaded.

    The message is ``<path>:<line>: <what is wrong>`` (``<path>: ...`` for problems that
    concern the whole file, e.g. no rows at all).  ``path``, ``line_no`` (1-based, or None)
    and ``reason`` are kept as attributes for callers that want to re-format it.
    """

    def __init__(self, path: str, line_no: int | None, reason: str):
        self.path = path
        self.line_no = line_no
        self.reason = reason
        where = path if line_no is None else f"{path}:{line_no}"
        super().__init__(f"{where}: {reason}")


class Workload(NamedTuple):
    """One row per trace row (request / turn), in file order.

    ``hash_indptr``/``hash_ids``: the interned hash ids of row q start at
    ``hash_ids[hash_indptr[q]]`` (as many as its ``input_len`` needs), and
    ``hash_indptr[-1]`` is ``len(hash_ids)``. A loaded trace is CSR (row q's ids end
    where row q + 1's begin); a delta trace's turns share their session's ids
    (``session_history``: each prompt a prefix of its conversation).
    """

    path: str
    trace_block_size: int  # tokens per hash id (Mooncake public traces: 512)
    line_no: np.ndarray  # int64[q], 1-based physical line of the row
    request_name: np.ndarray  # object[q] of str, session_id or "request_<line_no>"
    session: np.ndarray  # int32[q], dense session index by first appearance
    turn_index: np.ndarray  # int32[q], 0, 1, 2, ... within the session in file order
    start_ms: np.ndarray  # float64[q], session start (turn 0), NaN for later turns
    delay_ms: np.ndarray  # float64[q], think time after the previous turn completes; 0 for turn 0
    input_len: np.ndarray  # int64[q], prompt tokens
    output_len: np.ndarray  # int64[q], tokens to generate
    hash_indptr: np.ndarray  # int64[q + 1]
    hash_ids: np.ndarray  # uint32[nnz], interned (first distinct id in the file -> 0)
    order: np.ndarray  # int64[n_sessions], turn-0 rows stably sorted by start_ms
    # int64[q, 3], the row's recorded routing decisions, one column per ``PIN_KEYS``
    # ("worker" of an aggregated pool, "prefill_worker", "decode_worker"); -1 where
    # absent; None when no row has any
    worker: np.ndarray | None = None
    # where each row's output token ids come from, as ``output_plan`` returns them: the
    # loaders set it once; a workload cut from another (``select_rows``) keeps its rows'
    # entries, so they emit the tokens they emit in the whole trace. None: every row
    # draws from the plan stream (computed from the rows).
    out_plan: np.ndarray | None = None
    # the rows' authored output_token_ids, concatenated in row order (uint32); None
    # when no row has any
    authored_tokens: np.ndarray | None = None
    # bool[q]: the row names a ``session_id`` (a session turn; the reference's SGLang
    # KV events treat its inserts apart); None when no row does
    session_row: np.ndarray | None = None
    # the dependency graph of an agentic trace (``trace.agentic_graph.AgenticGraph``):
    # rows are its nodes, released by their dependencies (kernels.agentic.release);
    # None for every other trace
    agentic: object = None

    @property
    def num_requests(self) -> int:
        return int(self.line_no.shape[0])

    @property
    def num_sessions(self) -> int:
        return int(self.order.shape[0])

    def output_plan(self) -> tuple[np.ndarray, np.ndarray]:
        """(int64[q], uint32[nnz]) the output token ids of every row, as the kernels
        read them (``kernels.trace.output_plan.output_token_ids``): row q's first token is
        word ``out_plan[q]`` of the workload's plan stream, or for ``out_plan[q] < 0``
        authored id ``-1 - out_plan[q]`` of the second array. The stream is the
        reference's: rows draw session-major, authored rows draw nothing."""
        authored = np.zeros(0, np.uint32) if self.authored_tokens is None else self.authored_tokens
        if self.out_plan is not None:
            return self.out_plan, authored
        return rows_output_plan(self.session, self.output_len, None), authored


def rows_output_plan(session: np.ndarray, output_len: np.ndarray, authored_start) -> np.ndarray:
    """``Workload.out_plan`` of rows whose authored ids start at ``authored_start[q]``
    (-1: none; None: no row has any)."""

    if authored_start is None:
        return plan_offsets(session, output_len, np.zeros(len(session), bool))
    authored = authored_start >= 0
    out_plan = plan_offsets(session, output_len, authored)
    out_plan[authored] = -1 - authored_start[authored]
    return out_plan


class _RowError(Exception):
    """Raised by the field checks; the loader adds the file name and line number."""


def _show(value) -> str:
    # JSON spelling, so the message shows what the file says (null, "3", 1.5, NaN).
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pins(obj: dict) -> tuple[int, int, int]:
    """The row's recorded placements (``PIN_KEYS``), -1 where absent."""
    pins = []
    for key in PIN_KEYS:
        v = obj.get(key, -1)
        if v != -1 and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise _RowError(f'"{key}" must be an integer >= 0 (a worker index), got {_show(v)}')
        pins.append(v)
    return tuple(pins)


def _field(obj: dict, name: str, alias: str | None):
    """Return (key used, value) for a field that may be spelled ``name`` or ``alias``.

    A JSON null counts as absent (the reference deserializes these fields as options).
    Both spellings at once are rejected, as the reference's deserializer does.
    """
    if alias is not None and alias in obj:
        if name in obj:
            raise _RowError(f'both "{name}" and "{alias}" are set; give only one')
        return alias, obj[alias]
    return name, obj.get(name)


def _count(key: str, value) -> int:
    # bool is a subclass of int in Python but not an integer in JSON.
    if type(value) is not int or value < 0 or value >= _I64_END:
        raise _RowError(f'"{key}" must be a non-negative integer, got {_show(value)}')
    return value


def _finite_ms(key: str, value) -> float:
    if type(value) is int or type(value) is float:
        try:
            ms = float(value)
        except OverflowError:
            ms = math.inf
        if math.isfinite(ms):
            return ms
    raise _RowError(f'"{key}" must be a finite number of milliseconds, got {_show(value)}')


def _hash_ids(value) -> list:
    if value is None:
        raise _RowError('missing required field "hash_ids"')
    if type(value) is not list or not value:
        raise _RowError(f'"hash_ids" must be a non-empty list of integers, got {_show(value)}')
    for i, h in enumerate(value):
        if type(h) is not int or h < 0 or h >= _U64_END:
            raise _RowError(f'"hash_ids"[{i}] must be an integer in [0, 2**64), got {_show(h)}')
    return value


def _check_extras(obj: dict, output_len: int) -> None:
    # Fields the replay does not use but the reference validates; a trace that the
    # reference rejects must be rejected here too.
    for key in ("request_id", "policy_class"):
        v = obj.get(key)
        if v is not None and type(v) is not str:
            raise _RowError(f'"{key}" must be a string, got {_show(v)}')
    v = obj.get("priority")
    if v is not None and (type(v) is not int or not _I32_MIN <= v < _I32_END):
        raise _RowError(f'"priority" must be a 32-bit signed integer, got {_show(v)}')
    v = obj.get("strict_priority")
    if v is not None and (type(v) is not int or not 0 <= v < _U32_END):
        raise _RowError(f'"strict_priority" must be a 32-bit unsigned integer, got {_show(v)}')
    v = obj.get("output_token_ids")
    if v is not None:
        if type(v) is not list:
            raise _RowError(f'"output_token_ids" must be a list of token ids, got {_show(v)}')
        for i, t in enumerate(v):
            if type(t) is not int or not 0 <= t < _U32_END:
                raise _RowError(
                    f'"output_token_ids"[{i}] must be an integer in [0, 2**32), got {_show(t)}'
                )
        if len(v) != output_len:
            raise _RowError(
                f'"output_token_ids" has {len(v)} tokens but the output length is {output_len}'
            )


def intern_hash_ids(flat: list) -> np.ndarray:
    """Map raw u64 hash ids to dense uint32 ids in order of first appearance."""
    if len(flat) == 0:
        return np.zeros(0, dtype=np.uint32)
    import pandas as pd  # its hash factorizer: O(n), codes in order of first appearance

    codes, uniq = pd.factorize(np.asarray(flat, dtype=np.uint64))
    if uniq.shape[0] > _U32_END:
        raise ValueError("trace contains more distinct hash ids than uint32 can represent")
    return codes.astype(np.uint32)


_GZIP_MAGIC = b"\x1f\x8b"


def read_trace_bytes(path_str: str) -> bytes:
    """The bytes of a trace file, gzip-compressed ones (``.jsonl.gz``, recognised by
    their magic bytes whatever the name) decompressed."""
    with open(path_str, "rb") as f:
        data = f.read()
    if data[:2] != _GZIP_MAGIC:
        return data
    import gzip
    import zlib

    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path_str, None, f"not a readable gzip file ({exc or 'truncated'})") from None


def _rows(path_str: str, max_rows: int | None):
    """(1-based line number, raw line, parsed object or None) of every non-blank line.

    Lines split on newline bytes only, like the reference, so line numbers match
    its "request_<line>" names even with stray carriage returns. All rows are parsed
    with ONE ``json.loads`` of a JSON array (about twice as fast as a call per
    line); if that fails anywhere, every row comes back unparsed (None) and the
    caller parses row by row, which names the offending line."""
    data = read_trace_bytes(path_str)
    picked = []
    for line_no, raw_line in enumerate(data.split(b"\n"), 1):
        if max_rows is not None and len(picked) >= max_rows:
            break
        if raw_line.strip():
            picked.append((line_no, raw_line))
    try:
        objs = json.loads(b"[" + b",".join(raw for _, raw in picked) + b"]")
    except (json.JSONDecodeError, UnicodeDecodeError):
        objs = None
    if objs is None or len(objs) != len(picked) or any(type(o) is not dict for o in objs):
        return [(line_no, raw, None) for line_no, raw in picked]
    return [(line_no, raw, obj) for (line_no, raw), obj in zip(picked, objs)]


def load_mooncake(
    path,
    *,
    trace_block_size: int = 512,
    arrival_speedup_ratio: float = 1.0,
    max_rows: int | None = None,
    closed_loop: bool = False,
) -> Workload:
    """Load a Mooncake JSONL trace into a ``Workload``.

    ``trace_block_size`` is the number of tokens each hash id stands for (it must be the
    block size the trace was produced with; 512 for the public Mooncake traces).
    ``arrival_speedup_ratio`` divides session starts and inter-turn delays.
    ``max_rows`` keeps only the first that many rows (non-blank lines).
    ``closed_loop``: timestamps do not matter (no warning for sessions without one).

    Rows the reference accepts but that look like mistakes (a session without a
    timestamp, a row without ``input_length``, a field nobody reads) load as in the
    reference, with one ``TraceWarning`` per kind naming the first such line.

    Raises ``TraceError`` (a ValueError) naming the file and line for malformed rows and
    ``ValueError`` for invalid arguments.
    """
    if type(trace_block_size) is not int or trace_block_size <= 0:
        raise ValueError(f"trace_block_size must be a positive integer, got {trace_block_size!r}")
    try:
        ratio = float(arrival_speedup_ratio)
    except (TypeError, ValueError):
        ratio = math.nan
    if not (math.isfinite(ratio) and ratio > 0.0):
        raise ValueError(
            f"arrival_speedup_ratio must be a finite number > 0, got {arrival_speedup_ratio!r}"
        )
    if max_rows is not None and (type(max_rows) is not int or max_rows <= 0):
        raise ValueError(f"max_rows must be a positive integer or None, got {max_rows!r}")

    path_str = os.fspath(path)
    block = trace_block_size
    simple = _load_simple(path_str, block, ratio, max_rows, closed_loop)
    if simple is not None:
        return simple

    line_nos: list[int] = []
    names: list[str] = []
    sessions: list[int] = []
    turns: list[int] = []
    delays: list[float] = []
    input_lens: list[int] = []
    output_lens: list[int] = []
    hash_counts: list[int] = []
    flat_hashes: list[int] = []
    workers: list[tuple[int, int, int]] = []
    authored_start: list[int] = []
    authored_tokens: list[int] = []
    named_sessions: list[bool] = []  # the row names a session_id

    session_of: dict[str, int] = {}
    session_turns: list[int] = []  # turns seen so far, per session
    session_last_ts: list[float | None] = []  # last timestamp seen, per session
    session_first_ts: list[float | None] = []  # first turn's timestamp, per session
    no_timestamp: list[int] = []  # lines of first turns without a timestamp
    derived: list[int] = []  # lines whose input length comes from their hash ids
    unknown: dict[str, tuple[int, int]] = {}  # unknown key -> (first line, rows)

    for line_no, raw_line, obj in _rows(path_str, max_rows):
        try:
            if obj is None:
                # the bulk parse failed somewhere: parse this row alone for its message
                try:
                    obj = json.loads(raw_line)
                except json.JSONDecodeError as exc:
                    hint = ""
                    if raw_line[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw_line:
                        hint = "; " + _encoding_guess(raw_line)  # json decoded it as UTF-16/32
                    raise _RowError(f"invalid JSON: {exc.msg} (column {exc.colno}){hint}") from None
                except UnicodeDecodeError as exc:
                    raise _RowError(f"invalid JSON: not UTF-8 ({exc.reason}); "
                                    f"{_encoding_guess(raw_line)}") from None
            if type(obj) is not dict:
                raise _RowError(f"a row must be a JSON object, got {_show(obj)}")

            hashes = _hash_ids(obj.get("hash_ids"))
            capacity = len(hashes) * block

            key, v = _field(obj, "input_length", "input_tokens")
            if v is None:
                input_len = capacity
                derived.append(line_no)
            else:
                input_len = _count(key, v)
                if input_len == 0:
                    raise _RowError(f'"{key}" must be positive, got 0')
                if input_len > capacity:
                    raise _RowError(
                        f'"{key}" {input_len} exceeds the capacity of its hash_ids: '
                        f"{len(hashes)} ids x trace_block_size {block} = {capacity} tokens"
                    )

            worker = _pins(obj)
            key, v = _field(obj, "output_length", "output_tokens")
            if v is None:
                raise _RowError('missing required field "output_length" (or "output_tokens")')
            output_len = _count(key, v)

            key, v = _field(obj, "timestamp", "created_time")
            ts = None if v is None else _finite_ms(key, v)

            delay_key, delay_raw = _field(obj, "delay", "delay_ms")
            delay = None
            if delay_raw is not None:
                delay = _finite_ms(delay_key, delay_raw)
                if delay < 0.0:
                    raise _RowError(
                        f'"{delay_key}" must not be negative, got {_show(delay_raw)}'
                    )

            sid = obj.get("session_id")
            named_sessions.append(sid is not None)
            if sid is None:
                name = f"request_{line_no}"
            elif type(sid) is str:
                name = sid
            else:
                raise _RowError(f'"session_id" must be a string, got {_show(sid)}')

            _check_extras(obj, output_len)
            if not ROW_KEYS.issuperset(obj):
                for extra in obj.keys() - ROW_KEYS:
                    first, count = unknown.get(extra, (line_no, 0))
                    unknown[extra] = (first, count + 1)

            s = session_of.get(name)
            if s is None:
                if delay is not None and delay != 0.0:
                    raise _RowError(
                        f'first turn of session "{name}" must not carry a non-zero '
                        f'"{delay_key}", got {_show(delay_raw)}'
                    )
                s = len(session_turns)
                if ts is None and not closed_loop:
                    no_timestamp.append(line_no)
                session_of[name] = s
                session_turns.append(0)
                session_last_ts.append(ts)
                session_first_ts.append(ts)
                delay = 0.0
            elif delay is None:
                if ts is None:
                    delay = 0.0
                else:
                    last = session_last_ts[s]
                    if last is None:
                        # The reference refuses to guess a gap from an absent timestamp.
                        raise _RowError(
                            f'cannot infer the delay of this turn of session "{name}": '
                            "no earlier turn has a timestamp; give \"delay\""
                        )
                    delay = ts - last
                    if not (math.isfinite(delay) and delay >= 0.0):
                        raise _RowError(
                            f'timestamp {_show(ts)} is before the previous timestamp '
                            f'{_show(last)} of session "{name}" (inferred delay '
                            f"{delay} ms); a delay must be non-negative"
                        )
            turn = session_turns[s]
            session_turns[s] = turn + 1
            if ts is not None:
                session_last_ts[s] = ts
        except _RowError as exc:
            raise TraceError(path_str, line_no, str(exc)) from None

        line_nos.append(line_no)
        names.append(name)
        sessions.append(s)
        turns.append(turn)
        delays.append(delay)
        input_lens.append(input_len)
        output_lens.append(output_len)
        hash_counts.append(len(hashes))
        flat_hashes.extend(hashes)
        workers.append(worker)
        ids = obj.get("output_token_ids")
        if ids is None:
            authored_start.append(-1)
        else:
            authored_start.append(len(authored_tokens))
            authored_tokens.extend(ids)

    if not line_nos:
        raise TraceError(path_str, None, "no requests (the file is empty or has only blank lines)")
    _warn_lenient_rows(path_str, no_timestamp, derived, unknown)

    n = len(line_nos)
    session = np.array(sessions, dtype=np.int32)
    turn_index = np.array(turns, dtype=np.int32)
    first = turn_index == 0

    # Session starts: a first turn without a timestamp starts at 0 (before re-basing),
    # the convention of the reference's Python materializer.
    first_ts = np.array(
        [0.0 if t is None else t for t in session_first_ts], dtype=np.float64
    )
    first_ts -= first_ts.min()
    first_ts /= ratio
    start_ms = np.full(n, np.nan, dtype=np.float64)
    start_ms[first] = first_ts[session[first]]

    delay_ms = np.array(delays, dtype=np.float64)
    delay_ms /= ratio

    hash_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.array(hash_counts, dtype=np.int64), out=hash_indptr[1:])

    order = _start_order(first, start_ms)

    request_name = np.empty(n, dtype=object)
    request_name[:] = names

    return Workload(
        path=path_str,
        trace_block_size=block,
        line_no=np.array(line_nos, dtype=np.int64),
        request_name=request_name,
        session=session,
        turn_index=turn_index,
        start_ms=start_ms,
        delay_ms=delay_ms,
        input_len=np.array(input_lens, dtype=np.int64),
        output_len=np.array(output_lens, dtype=np.int64),
        hash_indptr=hash_indptr,
        hash_ids=intern_hash_ids(flat_hashes),
        order=order,
        worker=(np.array(workers, np.int64).reshape(n, len(PIN_KEYS))
                if any(max(w) >= 0 for w in workers) else None),
        out_plan=rows_output_plan(session, np.array(output_lens, dtype=np.int64),
                       None if not authored_tokens else np.array(authored_start, np.int64)),
        authored_tokens=np.array(authored_tokens, np.uint32) if authored_tokens else None,
        session_row=np.array(named_sessions, bool) if any(named_sessions) else None,
    )


def _load_simple(path_str: str, block: int, ratio: float, max_rows: int | None,
                 closed_loop: bool = False) -> Workload | None:
    """The trace in its common shape (flat rows of integer timestamp, lengths and
    hash ids: every row its own single-turn session), read by the compiled scanner;
    None when any row is not that simple or breaks a rule, so that the general
    loader below handles it (and names the file and line of an error)."""

    try:
        data = np.frombuffer(read_trace_bytes(path_str), dtype=np.uint8)
    except (OSError, TraceError):
        return None  # the general path reports it
    compile_notice(["trace"])
    status, line_no, ts, input_len, output_len, indptr, raw_hashes = scan_simple_trace(
        data, -1 if max_rows is None else max_rows)
    mark_compiled("trace")
    n = line_no.shape[0]
    if status != SCAN_OK or n == 0 or np.any(output_len < 0):
        return None
    capacity = np.diff(indptr) * block
    derived = input_len < 0
    input_len = np.where(derived, capacity, input_len)
    if np.any(input_len == 0) or np.any(input_len > capacity):
        return None
    no_timestamp = np.isnan(ts) & (not closed_loop)
    _warn_lenient_rows(path_str, line_no[no_timestamp].tolist(), line_no[derived].tolist(), {})
    start_ms = np.where(np.isnan(ts), 0.0, ts)  # a row without a timestamp starts at 0
    start_ms -= start_ms.min()
    start_ms /= ratio
    request_name = np.empty(n, dtype=object)
    request_name[:] = [f"request_{k}" for k in line_no.tolist()]
    return Workload(
        path=path_str,
        trace_block_size=block,
        line_no=line_no,
        request_name=request_name,
        session=np.arange(n, dtype=np.int32),
        out_plan=rows_output_plan(np.arange(n, dtype=np.int32), output_len, None),
        turn_index=np.zeros(n, dtype=np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, dtype=np.float64),
        input_len=input_len,
        output_len=output_len,
        hash_indptr=indptr.copy(),
        hash_ids=intern_hash_ids(raw_hashes),
        # equal starts keep file order: the reference routes and queues ties in line order
        order=np.argsort(start_ms, kind="stable").astype(np.int64),
    )


def _start_order(session_first: np.ndarray, start_ms: np.ndarray) -> np.ndarray:
    first_rows = np.flatnonzero(session_first).astype(np.int64)
    # equal starts keep row order: the reference routes and queues ties in line order
    return first_rows[np.argsort(start_ms[first_rows], kind="stable")]


def select_rows(w: Workload, rows) -> Workload:
    """The trace restricted to ``rows``, in that order, in the same hash-id space (equal
    prompts still share blocks with the original's): sessions are renumbered densely by
    first appearance. Every session must come whole, its turns in order."""
    rows = np.asarray(rows, np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= w.num_requests):
        raise ValueError(f"rows must lie in [0, {w.num_requests})")
    if w.num_sessions == w.num_requests:
        # every row its own one-turn session: any rows are whole sessions, numbered
        # by position (a worker shard of a single-turn trace, cut on every run)
        if len(np.unique(rows)) != len(rows):
            raise ValueError("select_rows needs whole sessions with their turns in order")
        return _take_rows(w, rows, np.arange(len(rows), dtype=w.session.dtype), w.turn_index[rows])
    sessions, first_pos, session = np.unique(w.session[rows], return_index=True, return_inverse=True)
    dense = np.empty(len(sessions), np.int64)
    dense[np.argsort(first_pos, kind="stable")] = np.arange(len(sessions))
    session = dense[session.reshape(-1)]
    turn = w.turn_index[rows]
    turns_in = np.bincount(session, minlength=len(sessions))
    turns_all = np.bincount(w.session, minlength=int(w.session.max(initial=-1)) + 1)[sessions]
    # turn k of a session must be its k-th row here
    by_session = np.argsort(session, kind="stable")
    group_start = np.cumsum(turns_in) - turns_in
    expected = np.empty(len(rows), np.int64)
    expected[by_session] = np.arange(len(rows)) - group_start[session[by_session]]
    if np.any(turns_in != turns_all) or np.any(turn != expected):
        raise ValueError("select_rows needs whole sessions with their turns in order")
    return _take_rows(w, rows, session.astype(w.session.dtype), turn)


def _take_rows(w: Workload, rows: np.ndarray, session: np.ndarray, turn: np.ndarray) -> Workload:
    """``select_rows`` once the sessions are checked and renumbered."""
    if w.agentic is not None:
        raise ValueError("an agentic trace is replayed whole: its rows depend on each other")
    # a row's ids: its CSR extent, or (rows sharing ids: a delta trace's turns, whose
    # next row may start anywhere) what its prompt reads
    extent = w.hash_indptr[rows + 1] - w.hash_indptr[rows]
    counts = np.maximum(extent, -(-w.input_len[rows].astype(np.int64) // w.trace_block_size))
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    # every hash id of the rows, in row order: each row's run of its source's ids
    take = np.repeat(w.hash_indptr[rows] - indptr[:-1], counts) + np.arange(indptr[-1], dtype=np.int64)
    start_ms = w.start_ms[rows]
    out_plan, authored_tokens = w.output_plan()
    return w._replace(
        out_plan=out_plan[rows], authored_tokens=authored_tokens,
        line_no=w.line_no[rows], request_name=w.request_name[rows],
        session=session, turn_index=turn, start_ms=start_ms,
        delay_ms=w.delay_ms[rows], input_len=w.input_len[rows], output_len=w.output_len[rows],
        hash_indptr=indptr, hash_ids=w.hash_ids[take],
        order=_start_order(turn == 0, start_ms).astype(w.order.dtype),
        worker=None if w.worker is None else w.worker[rows],
        session_row=None if w.session_row is None else w.session_row[rows])


def concat_workloads(a: Workload, b: Workload, buffers: dict | None = None) -> Workload:
    """The rows of ``a`` then those of ``b`` (whose sessions follow a's), hash ids taken
    as they are: both must be in one id space (``select_rows`` of one trace, or ids
    the caller interned together). With ``buffers`` (a dict the caller keeps for one
    growing workload) the token-sized arrays grow in place (``growing_arrays``)."""
    grow = {} if buffers is None else buffers
    if a.agentic is not None or b.agentic is not None:
        raise ValueError("an agentic trace is replayed whole: its rows depend on each other")
    if a.trace_block_size != b.trace_block_size:
        raise ValueError(f"trace block sizes differ: {a.trace_block_size} and {b.trace_block_size}")
    n_sessions = int(a.session.max(initial=-1)) + 1
    turn = np.concatenate([a.turn_index, b.turn_index])
    start_ms = np.concatenate([a.start_ms, b.start_ms])
    plan_a, authored_a = a.output_plan()
    plan_b, authored_b = b.output_plan()
    return a._replace(
        out_plan=np.concatenate([plan_a, np.where(plan_b < 0, plan_b - len(authored_a), plan_b)]),
        authored_tokens=append_into(grow, "authored_tokens", authored_a, [authored_b]),
        line_no=np.concatenate([a.line_no, b.line_no]),
        request_name=np.concatenate([a.request_name, b.request_name]),
        session=np.concatenate([a.session, b.session + n_sessions]).astype(a.session.dtype),
        turn_index=turn, start_ms=start_ms,
        delay_ms=np.concatenate([a.delay_ms, b.delay_ms]),
        input_len=np.concatenate([a.input_len, b.input_len]),
        output_len=np.concatenate([a.output_len, b.output_len]),
        hash_indptr=np.concatenate([a.hash_indptr, b.hash_indptr[1:] + a.hash_indptr[-1]]),
        hash_ids=append_into(grow, "hash_ids", a.hash_ids, [b.hash_ids]),
        order=_start_order(turn == 0, start_ms).astype(a.order.dtype),
        worker=None if a.worker is None and b.worker is None else np.concatenate(
            [np.full((a.num_requests, len(PIN_KEYS)), -1, np.int64) if a.worker is None else a.worker,
             np.full((b.num_requests, len(PIN_KEYS)), -1, np.int64) if b.worker is None else b.worker]),
        session_row=None if a.session_row is None and b.session_row is None else np.concatenate(
            [np.zeros(a.num_requests, bool) if a.session_row is None else a.session_row,
             np.zeros(b.num_requests, bool) if b.session_row is None else b.session_row]))


def prompt_tokens(w: Workload, q: int) -> np.ndarray:
    """The synthesized prompt of row ``q`` (uint32[input_len[q]]).

    Block i is ``min(trace_block_size, remaining)`` copies of the interned id of the
    row's i-th hash id, truncated at ``input_len[q]`` -- the same tokens the reference
    builds, so engine-side block hashes of equal prefixes agree.
    """
    n_tokens = int(w.input_len[q])
    block = w.trace_block_size
    lo = int(w.hash_indptr[q])
    n_blocks = -(-n_tokens // block)
    return np.repeat(w.hash_ids[lo : lo + n_blocks], block)[:n_tokens]


def sequence_tokens(w: Workload, q: int, start: int, n: int) -> np.ndarray:
    """Tokens ``start`` .. ``start + n - 1`` of row ``q``'s sequence (uint32[n]): its
    prompt (``prompt_tokens``), then its output token ids (authored, or its slice of
    the output plan)."""

    out = np.empty(n, np.uint32)
    prompt = prompt_tokens(w, q)
    k = max(0, min(n, len(prompt) - start))
    out[:k] = prompt[start:start + k]
    if k < n:
        out_plan, authored = w.output_plan()
        output_token_ids(out_plan, authored, q, start + k - len(prompt), n - k, out, k)
    return out


def default_trace_path() -> Path:
    """Filesystem path of the bundled default trace.

    Looked up as package data of ``aisim_fast.datasets``; in a source checkout that is
    not installed the package does not exist, so fall back to the repo's ``datasets/``.
    """
    try:
        resource = importlib.resources.files(_DATASETS_PACKAGE).joinpath(DEFAULT_TRACE_NAME)
        if resource.is_file():
            return Path(os.fspath(resource))
    except (ModuleNotFoundError, TypeError):
        # TypeError: the package is importable but not file-backed (e.g. zipped).
        pass
    return Path(__file__).resolve().parent.parent / "datasets" / DEFAULT_TRACE_NAME


def load_default_trace(**kwargs) -> Workload:
    """Load the bundled 3000-row Mooncake conversation trace (keyword args as load_mooncake)."""
    return load_mooncake(default_trace_path(), **kwargs)
