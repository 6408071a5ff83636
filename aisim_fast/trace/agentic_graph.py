"""Agentic Mooncake traces (``trace_format: agentic_mooncake``): trajectories of
dependent requests, read as the reference reads them and lowered to a ``Workload``
whose ``agentic`` field holds the dependency graph the kernels release requests by
(``kernels.agentic.release``).

Two spellings of one graph:

* **v2**: a header line ``{"schema": "dynamo.agentic_mooncake", "version": 2,
  "block_size", "hash_id_scope": "local", "source": {format, digest}}``, then one
  request per line: ``request_id``, ``play_id``, ``session_id``, ``model``,
  ``input_length``, ``output_length``, ``hash_ids`` (exactly
  ``ceil(input_length / block_size)``), ``not_before_ms`` and ``dependencies``
  (``request_id``, ``trigger`` dispatch | completion, ``delay_ms``, ``relation``
  sequence | spawn | join | replay_barrier; only spawn may use dispatch). The
  header's block size is the trace's; a payload's ``trace_block_size`` is ignored.
* **legacy** rows (no header): ``wait_for`` (completion edges, ``join`` when there
  are several, else ``sequence``) with ``delay``/``delay_ms`` + ``tool_wait_ms`` as
  every edge's delay; a row waiting on none starts at its ``timestamp``, a row
  waiting on some at 0. Plays are the graph's weakly connected components, named
  ``legacy-play:<root with the smallest (start, request_id)>``; the block size is the
  payload's (512 by default).

What the graph means (the reference's workload driver, verified on its runs):

* Requests are numbered by ``request_id`` in byte order: that order is their uuid
  (node + 1), the order their hash ids are interned and their output tokens
  planned in, and the tie-break between requests due at one instant.
* Start times are re-based on the smallest ``not_before_ms`` of all requests and
  divided, with every delay, by ``arrival_speedup_ratio``.
* A request is released at ``max(not_before_ms, trigger time + delay)`` over its
  dependencies: a dispatch trigger fires when the parent is sent, a completion
  trigger when it completes (a rejected or failed one fails its play: the play's
  requests not yet sent are skipped and never appear in the results).
* Without lanes every play starts on the absolute time axis. With ``N`` lanes,
  plays (ordered by ``source_play_ordinal`` when every play has one, else by
  ``play_id`` bytes) wait in one queue: lane ``k`` starts play ``k`` at 0, and a
  lane whose play has finished (every request completed, or failed with its sent
  requests ended) starts the next play waiting at that instant, its times kept
  relative to its roots' earliest ``not_before_ms``. Which lane runs a play is
  known only as the run goes.

Errors are the reference's, with ``file:line`` in front.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import blake3
import numpy as np

from aisim_fast.trace.workload import TraceError, Workload, rows_output_plan, intern_hash_ids, read_trace_bytes

SCHEMA = "dynamo.agentic_mooncake"
TRIGGERS = ("dispatch", "completion")
RELATIONS = ("sequence", "spawn", "join", "replay_barrier")
TRIGGER_DISPATCH, TRIGGER_COMPLETION = 0, 1
RELATION_SEQUENCE, RELATION_SPAWN, RELATION_JOIN, RELATION_REPLAY_BARRIER = range(4)
_RUST_RELATION = {"sequence": "Sequence", "spawn": "Spawn", "join": "Join", "replay_barrier": "ReplayBarrier"}
_U64_END = 1 << 64
_U32_END = 1 << 32


@dataclass(frozen=True)
class AgenticGraph:
    """The dependency graph of an agentic trace, one entry per request in node order
    (``request_id`` bytes), which is also the order of the ``Workload``'s rows."""

    input_format: str            # the reference's agentic_input_format: "agentic_mooncake" | "dynamo"
    block_size: int              # tokens per hash id (the header's)
    source_format: str
    source_digest: str
    lanes: int | None            # agentic_lanes, None: every play at once
    request_id: np.ndarray       # object[n]
    play_id: np.ndarray          # object[n]
    session_id: np.ndarray       # object[n]
    model: np.ndarray            # object[n]
    input_length: np.ndarray     # int64[n]
    output_length: np.ndarray    # int64[n]
    not_before_ms: np.ndarray    # float64[n] re-based and sped up
    recorded_api_time_ms: np.ndarray  # float64[n], NaN: not given
    source_play_ordinal: np.ndarray   # int64[n], -1: not given
    priority: np.ndarray         # int64[n]
    strict_priority: np.ndarray  # int64[n]
    policy_class: np.ndarray     # object[n], None: not given
    output_token_ids: np.ndarray  # object[n]: the authored ids (a list) or None
    raw_hash_indptr: np.ndarray  # int64[n + 1]
    raw_hash_ids: np.ndarray     # uint64[nnz] as written (the graph digest hashes them)
    dep_indptr: np.ndarray       # int64[n + 1] each request's dependencies, as authored
    dep_source: np.ndarray       # int64[e] the node it depends on
    dep_trigger: np.ndarray      # int8[e] TRIGGER_*
    dep_delay_ms: np.ndarray     # float64[e] sped up
    dep_relation: np.ndarray     # int8[e] RELATION_*
    play_names: np.ndarray       # object[p] in play order
    node_play: np.ndarray        # int64[n] the node's play (index in play order)
    # a snapshot replay's cut plays (trace.agentic_snapshot.Snapshot); None: the graph itself
    snapshot: object = None
    # float64[n, 2] when each request started and ended as recorded, where the source
    # format records it (Dynamo records); None: ``not_before_ms`` + ``recorded_api_time_ms``
    recorded_interval_ms: np.ndarray | None = None
    # report keys of the source format (a Weka corpus's resolved timestamp basis)
    extra_report: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.request_id)

    @property
    def is_root(self) -> np.ndarray:
        return np.diff(self.dep_indptr) == 0

    def root_not_before_ms(self) -> np.ndarray:
        """float64[p]: the earliest ``not_before_ms`` of each play's roots."""
        out = np.full(len(self.play_names), np.inf)
        roots = self.is_root
        np.minimum.at(out, self.node_play[roots], self.not_before_ms[roots])
        return out

    def initial_ready_ms(self) -> tuple[np.ndarray, np.ndarray]:
        """(float64[n] each node's release floor as the run starts, NaN for a node of a
        play that waits for its lane; bool[n] the nodes released at the start: the
        roots of every play without lanes, of each lane's first play with them)."""
        if not self.lanes:
            return self.not_before_ms.copy(), self.is_root.copy()
        first = np.arange(len(self.play_names)) < self.lanes
        active = first[self.node_play]
        rel = np.maximum(0.0, self.not_before_ms - self.root_not_before_ms()[self.node_play])
        return np.where(active, 0.0 + rel, np.nan), active & self.is_root

    def start_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(float64[n] each node's start as the run begins, NaN for a node released
        later; int64[k] the nodes started then, by start time, node order on ties): a
        ``Workload``'s ``start_ms`` and ``order``."""
        ready_ms, started = self.initial_ready_ms()
        start_ms = np.where(started, ready_ms, np.nan)
        firsts = np.flatnonzero(started)
        return start_ms, firsts[np.argsort(start_ms[firsts], kind="stable")].astype(np.int64)

    def authored_outputs(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(int64[n] where each node's authored output ids start in the second array, -1
        for none; uint32[total] those ids), (None, None) when no node has any."""
        authored = self.output_token_ids
        if not any(a is not None for a in authored):
            return None, None
        lengths = np.array([0 if a is None else len(a) for a in authored], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return (np.where([a is not None for a in authored], starts, -1).astype(np.int64),
                np.array([t for a in authored if a is not None for t in a], np.uint32))

    def root_id(self) -> np.ndarray:
        """object[n]: the request_id of the node's play's root when the play has
        exactly one, else None (the reference's ``agentic.root_id``)."""
        roots = np.flatnonzero(self.is_root)
        count = np.bincount(self.node_play[roots], minlength=len(self.play_names))
        by_play = np.empty(len(self.play_names), dtype=object)
        by_play[self.node_play[roots]] = self.request_id[roots]
        by_play[count != 1] = None
        return by_play[self.node_play]

    def parent_id(self) -> np.ndarray:
        """object[n]: among a node's spawn dependencies, the source with the smallest
        node index (the reference's ``agentic.parent_id``); None without any."""
        out = np.empty(self.num_nodes, dtype=object)
        spawn = self.dep_relation == RELATION_SPAWN
        child = np.repeat(np.arange(self.num_nodes), np.diff(self.dep_indptr))
        best = np.full(self.num_nodes, self.num_nodes, np.int64)
        np.minimum.at(best, child[spawn], self.dep_source[spawn])
        has = best < self.num_nodes
        out[has] = self.request_id[best[has]]
        return out

    def source_models(self) -> list[str]:
        return sorted(set(self.model.tolist()), key=lambda m: m.encode())


class GraphRow:
    """One request as the graph builder sees it (``line``: the reference's trace line,
    which for rows lowered from another format is the row's index + 2; ``origin``:
    (file, line) of such a row, for errors; unset for rows read as written)."""
    __slots__ = ("line", "request_id", "play_id", "session_id", "model", "not_before_ms", "input_length",
                 "output_length", "hash_ids", "output_token_ids", "recorded_api_time_ms", "source_play_ordinal",
                 "priority", "strict_priority", "policy_class", "dependencies", "origin", "recorded_interval")


def load_agentic_mooncake(path, *, trace_block_size: int | None = None, arrival_speedup_ratio: float = 1.0,
                          lanes: int | None = None, max_rows: int | None = None,
                          cut=None) -> Workload:
    """Load an agentic Mooncake trace (v2 or legacy rows, told apart by the first
    line) as a ``Workload`` with its ``agentic`` graph (``trace_block_size``: the
    payload's, used by legacy rows only, 512 when None; ``lanes``: agentic_lanes).
    ``max_rows``, ``cut``: as ``graph_workload``'s."""
    path = str(path)
    ratio = check_speedup(arrival_speedup_ratio)
    try:
        lines = read_trace_bytes(path).split(b"\n")
    except OSError as exc:
        raise TraceError(path, None, f"cannot read ({exc.strerror or exc})") from None
    first = next((i for i, raw in enumerate(lines) if raw.strip()), None)
    if first is None:
        raise TraceError(path, None, "agentic trace file is empty")
    try:
        head = json.loads(lines[first])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(path, first + 1, f"failed to parse first agentic trace row: {exc}") from None
    if type(head) is dict and head.get("schema") == SCHEMA:
        header, rows = _read_v2(path, lines, first, head)
    else:
        block = 512 if trace_block_size is None else int(trace_block_size)
        header, rows = _read_legacy(path, lines, block)
    return graph_workload(path, header, rows, input_format="agentic_mooncake", ratio=ratio, lanes=lanes,
                          max_rows=max_rows, cut=cut)


def check_speedup(arrival_speedup_ratio) -> float:
    ratio = float(arrival_speedup_ratio)
    if not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"ratio must be a finite positive number, got {arrival_speedup_ratio:g}")
    return ratio


def graph_workload(path: str, header: tuple, rows: list, *, input_format: str, ratio: float, lanes: int | None,
                   max_rows: int | None, cut=None) -> Workload:
    """The ``Workload`` of a graph given as rows (``GraphRow``, each with its
    dependencies; ``header``: (block size, source format, source digest)), checked as
    the reference checks a v2 trace. ``max_rows``: whole plays only (a graph cut at a
    row would lose dependencies), the first in play order up to that many requests, at
    least one. ``cut``: ``(path, graph, lanes, ratio) -> Workload``, the replay of the
    graph's seeded cuts instead, built on its recorded times (``agentic_snapshot``)."""
    if lanes is not None and lanes <= 0:
        raise ValueError("agentic_lanes must be greater than 0")
    if cut is not None:
        graph, _ = _build(path, header, rows, 1.0, lanes, input_format, rebase=False)
        return cut(path, graph, lanes, ratio)
    graph, prompt_ids = _build(path, header, rows, ratio, lanes, input_format)
    if max_rows is not None and max_rows < graph.num_nodes:
        sizes = np.bincount(graph.node_play, minlength=len(graph.play_names))
        keep = max(1, int(np.searchsorted(np.cumsum(sizes), max_rows, side="right")))
        rows = [r for r, g in zip(rows, graph.node_play.tolist()) if g < keep]
        graph, prompt_ids = _build(path, header, rows, ratio, lanes, input_format)
    return _lower(path, graph, rows, prompt_ids)


# ---------------------------------------------------------------------------------------------
# reading


def _read_v2(path: str, lines: list, first: int, head: dict):
    version = head.get("version")
    if type(version) is not int or version < 0:
        raise TraceError(path, first + 1, "as the agentic Mooncake v2 header: `version` must be an unsigned integer")
    if version != 2:
        raise TraceError(path, first + 1, f"unsupported agentic Mooncake version {version}; expected 2")
    block = head.get("block_size")
    if type(block) is not int or block < 0:
        raise TraceError(path, first + 1, "as the agentic Mooncake v2 header: `block_size` must be an unsigned "
                                          "integer")
    if block == 0:
        raise TraceError(path, first + 1, "agentic Mooncake block_size must be greater than 0")
    if "hash_id_scope" not in head:
        raise TraceError(path, first + 1, "as the agentic Mooncake v2 header: missing field `hash_id_scope`")
    if head["hash_id_scope"] != "local":
        raise TraceError(path, first + 1, f"as the agentic Mooncake v2 header: unknown variant "
                                          f"`{head['hash_id_scope']}`, expected `local`")
    source = head.get("source")
    if type(source) is not dict or type(source.get("format")) is not str or type(source.get("digest")) is not str:
        raise TraceError(path, first + 1, "as the agentic Mooncake v2 header: `source` must be {format, digest}")
    if not source["format"].strip() or not source["digest"].strip():
        raise TraceError(path, first + 1, "agentic Mooncake source provenance requires nonempty format and digest")
    rows = []
    for i in range(first + 1, len(lines)):
        raw = lines[i]
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(path, i + 1, f"as an agentic Mooncake v2 request: {exc}") from None
        rows.append(_v2_row(path, i + 1, obj))
    return (int(block), source["format"], source["digest"]), rows


def _need(path, line, obj, key, kind):
    if key not in obj or obj[key] is None:
        raise TraceError(path, line, f"as an agentic Mooncake v2 request: missing field `{key}`")
    return _typed(path, line, key, obj[key], kind)


def _typed(path, line, key, value, kind):
    if kind == "str":
        ok = type(value) is str
    elif kind == "uint":
        ok = type(value) is int and 0 <= value < _U64_END
    elif kind == "int32":
        ok = type(value) is int and -(1 << 31) <= value < 1 << 31
    elif kind == "uint32":
        ok = type(value) is int and 0 <= value < _U32_END
    else:  # float
        ok = type(value) in (int, float)
    if not ok:
        raise TraceError(path, line, f"`{key}` must be {'a string' if kind == 'str' else 'a number' if kind == 'float' else 'an integer'}, got {json.dumps(value)[:60]}")
    return float(value) if kind == "float" else value


def _alias(obj, name, alias):
    if alias in obj and name in obj:
        return "both"
    return obj.get(name, obj.get(alias))


def _v2_row(path: str, line: int, obj) -> GraphRow:
    if type(obj) is not dict:
        raise TraceError(path, line, "as an agentic Mooncake v2 request: expected an object")
    r = GraphRow()
    r.line = line
    r.request_id = _need(path, line, obj, "request_id", "str")
    r.play_id = _need(path, line, obj, "play_id", "str")
    r.session_id = _need(path, line, obj, "session_id", "str")
    r.model = _need(path, line, obj, "model", "str")
    r.not_before_ms = _need(path, line, obj, "not_before_ms", "float")
    _common_fields(path, line, obj, r)
    deps = obj.get("dependencies") or []
    if type(deps) is not list:
        raise TraceError(path, line, "`dependencies` must be a list")
    r.dependencies = []
    for d in deps:
        if type(d) is not dict:
            raise TraceError(path, line, "a dependency must be an object")
        rid = _need(path, line, d, "request_id", "str")
        trigger = _need(path, line, d, "trigger", "str")
        if trigger not in TRIGGERS:
            raise TraceError(path, line, f"unknown variant `{trigger}`, expected `dispatch` or `completion`")
        delay = _need(path, line, d, "delay_ms", "float")
        relation = _need(path, line, d, "relation", "str")
        if relation not in RELATIONS:
            raise TraceError(path, line, f"unknown variant `{relation}`, expected one of `sequence`, `spawn`, "
                                         "`join`, `replay_barrier`")
        r.dependencies.append((rid, TRIGGERS.index(trigger), delay, RELATIONS.index(relation)))
    return r


def _common_fields(path: str, line: int, obj: dict, r: GraphRow) -> None:
    """The fields v2 and legacy rows share (lengths, hash ids, authored output,
    priorities)."""
    for name, alias, attr in (("input_length", "input_tokens", "input_length"),
                              ("output_length", "output_tokens", "output_length")):
        value = _alias(obj, name, alias)
        if value == "both":
            raise TraceError(path, line, f"duplicate field `{name}` (given as `{name}` and `{alias}`)")
        setattr(r, attr, None if value is None else _typed(path, line, name, value, "uint"))
    r.hash_ids = _int_list(path, line, obj, "hash_ids", "uint")
    r.output_token_ids = _int_list(path, line, obj, "output_token_ids", "uint32")
    api = obj.get("recorded_api_time_ms")
    r.recorded_api_time_ms = None if api is None else _typed(path, line, "recorded_api_time_ms", api, "float")
    ordinal = obj.get("source_play_ordinal")
    r.source_play_ordinal = None if ordinal is None else _typed(path, line, "source_play_ordinal", ordinal, "uint")
    r.priority = 0 if obj.get("priority") is None else _typed(path, line, "priority", obj["priority"], "int32")
    r.strict_priority = 0 if obj.get("strict_priority") is None else _typed(
        path, line, "strict_priority", obj["strict_priority"], "uint32")
    pc = obj.get("policy_class")
    r.policy_class = None if pc is None else _typed(path, line, "policy_class", pc, "str")


def _int_list(path: str, line: int, obj: dict, key: str, kind: str) -> list | None:
    """``obj[key]``: None when absent, else a list of integers of ``kind``."""
    values = obj.get(key)
    if values is None:
        return None
    if type(values) is not list:
        raise TraceError(path, line, f"`{key}` must be a list of integers")
    for v in values:
        _typed(path, line, f"{key}[]", v, kind)
    return values


def _read_legacy(path: str, lines: list, block: int):
    if block <= 0:
        raise TraceError(path, None, "agentic Mooncake block_size must be greater than 0")
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            what = "first legacy agentic Mooncake row" if not rows else "legacy agentic trace line"
            raise TraceError(path, i + 1, f"failed to parse {what}: {exc}") from None
        if type(obj) is not dict:
            raise TraceError(path, i + 1, "a legacy agentic row must be an object")
        r = GraphRow()
        # the reference numbers legacy rows for the v2 checks as row index + 2
        r.line = len(rows) + 2
        r.request_id = obj.get("request_id")
        if r.request_id is None:
            raise TraceError(path, i + 1, "failed to parse legacy agentic Mooncake row: missing field `request_id`")
        _typed(path, i + 1, "request_id", r.request_id, "str")
        if not r.request_id:
            raise TraceError(path, i + 1, "request_id must be nonempty")
        sid = obj.get("session_id")
        r.session_id = "agentic-session" if sid is None else _typed(path, i + 1, "session_id", sid, "str")
        r.model = "unknown"
        _common_fields(path, i + 1, obj, r)
        if r.output_length is None:
            raise TraceError(path, i + 1, "failed to parse legacy agentic Mooncake row: missing field "
                                          "`output_length`")
        if r.hash_ids is None:
            raise TraceError(path, i + 1, "failed to parse legacy agentic Mooncake row: missing field `hash_ids`")
        if not r.hash_ids:
            raise TraceError(path, i + 1, "hash_ids must be nonempty")
        tool_wait = obj.get("tool_wait_ms")
        tool_wait = 0.0 if tool_wait is None else _typed(path, i + 1, "tool_wait_ms", tool_wait, "float")
        if not math.isfinite(tool_wait) or tool_wait < 0:
            raise TraceError(path, i + 1, "tool_wait_ms must be finite and nonnegative")
        if obj.get("delay") is not None and obj.get("delay_ms") is not None:
            raise TraceError(path, i + 1, "delay and delay_ms cannot both be set")
        delay = obj.get("delay") if obj.get("delay") is not None else obj.get("delay_ms")
        delay = (0.0 if delay is None else _typed(path, i + 1, "delay", delay, "float")) + tool_wait
        if not math.isfinite(delay) or delay < 0:
            raise TraceError(path, i + 1, "dependency delay must be finite and nonnegative")
        wait_for = obj.get("wait_for") or []
        if type(wait_for) is not list or any(type(w) is not str for w in wait_for):
            raise TraceError(path, i + 1, "`wait_for` must be a list of request ids")
        relation = RELATION_JOIN if len(wait_for) > 1 else RELATION_SEQUENCE
        r.dependencies = [(w, TRIGGER_COMPLETION, delay, relation) for w in wait_for]
        ts = obj.get("timestamp", obj.get("created_time"))
        ts = 0.0 if ts is None else _typed(path, i + 1, "timestamp", ts, "float")
        # a row that waits starts when its parents let it: its own timestamp is not read,
        # except as the recorded start a snapshot cuts at (the reference's evidence)
        r.not_before_ms = 0.0 if wait_for else ts
        api = r.recorded_api_time_ms
        r.recorded_interval = (ts, math.nan if api is None else ts + api)
        r.play_id = None
        rows.append(r)
    if not rows:
        raise TraceError(path, None, "agentic trace file is empty")
    component_play_ids(rows, "legacy-play")
    return (block, "legacy_agentic_mooncake", f"{path}:{len(rows)}"), rows


def component_play_ids(rows: list, prefix: str) -> None:
    """Name each weakly connected component of the rows' dependencies after its root
    with the smallest (not_before_ms, request_id): ``prefix:<that id>``."""
    index = {r.request_id: i for i, r in enumerate(rows)}
    parent = list(range(len(rows)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for i, r in enumerate(rows):
        for dep in r.dependencies:
            j = index.get(dep[0])
            if j is not None:
                a, b = find(i), find(j)
                if a != b:
                    parent[a] = b
    label: dict[int, tuple] = {}
    for i, r in enumerate(rows):
        if r.dependencies:
            continue
        c = find(i)
        key = (r.not_before_ms, r.request_id.encode())
        if c not in label or key < label[c]:
            label[c] = key
    for i, r in enumerate(rows):
        c = find(i)
        # a component without a root is a cycle, which the builder refuses
        r.play_id = f"{prefix}:{label[c][1].decode()}" if c in label else f"{prefix}:{r.request_id}"


# ---------------------------------------------------------------------------------------------
# building


def _line_error(path: str, r: GraphRow, what: str) -> TraceError:
    """The reference's words for row ``r`` ("trace line N ..."), placed at the file and
    line the row came from when it came from another format's file."""
    where = getattr(r, "origin", None) or (path, r.line)
    return TraceError(*where, f"trace line {r.line} {what}")


def _build(path: str, header: tuple, rows: list, ratio: float, lanes: int | None, input_format: str,
           rebase: bool = True):
    """The graph of ``rows`` (sorted here into node order), checked; its times re-based
    on the earliest ``not_before_ms`` and divided by ``ratio`` unless ``rebase`` is
    False (the recorded times a snapshot cuts)."""
    block, source_format, source_digest = header
    if not rows:
        raise TraceError(path, None, f"agentic trace file {path} did not contain any requests")
    seen: set = set()
    for r in rows:
        for key in ("request_id", "play_id", "session_id"):
            if not getattr(r, key).strip():
                raise _line_error(path, r, f"has empty {key}")
        if r.request_id in seen:
            raise _line_error(path, r, f"duplicates request_id {r.request_id}")
        seen.add(r.request_id)
        if r.hash_ids is None:
            raise _line_error(path, r, "is missing hash_ids")
        if not r.hash_ids:
            raise _line_error(path, r, "has empty hash_ids")
        if r.input_length is None:
            raise _line_error(path, r, "is missing input_length")
        if r.input_length == 0:
            raise _line_error(path, r, "has zero input_length")
        need = -(-r.input_length // block)
        if len(r.hash_ids) != need:
            raise _line_error(path, r, f"has input_length {r.input_length} at block_size {block} and requires "
                                       f"exactly {need} hash_ids, got {len(r.hash_ids)}")
        if not r.model.strip():
            raise _line_error(path, r, "has an empty model")
        if r.output_length is None:
            raise _line_error(path, r, "is missing output_length")
        if r.output_token_ids is not None and len(r.output_token_ids) != r.output_length:
            raise _line_error(path, r, f"output_length {r.output_length} does not match output_token_ids length "
                                       f"{len(r.output_token_ids)}")
        if not math.isfinite(r.not_before_ms) or r.not_before_ms < 0:
            raise _line_error(path, r, f"has invalid not_before_ms {_rust_float(r.not_before_ms)}")
        api = r.recorded_api_time_ms
        if api is not None and (not math.isfinite(api) or api < 0):
            raise _line_error(path, r, f"has invalid recorded_api_time_ms Some({_rust_debug_float(api)})")
        for rid, trigger, delay, relation in r.dependencies:
            if not rid.strip():
                raise _line_error(path, r, "has a dependency with an empty request_id")
            if not math.isfinite(delay) or delay < 0:
                raise _line_error(path, r, f"has invalid dependency delay {_rust_float(delay)}")
            if relation != RELATION_SPAWN and trigger == TRIGGER_DISPATCH:
                raise _line_error(path, r, f"has invalid {_RUST_RELATION[RELATIONS[relation]]} dependency with "
                                           "Dispatch trigger")
    rows.sort(key=lambda r: r.request_id.encode())
    node = {r.request_id: i for i, r in enumerate(rows)}
    n = len(rows)
    dep_source, dep_trigger, dep_delay, dep_relation = [], [], [], []
    dep_indptr = np.zeros(n + 1, np.int64)
    for i, r in enumerate(rows):
        for rid, trigger, delay, relation in r.dependencies:
            j = node.get(rid)
            if j is None:
                raise TraceError(path, None, f"request {r.request_id} references unknown request_id {rid}")
            if j == i:
                raise TraceError(path, None, f"request {r.request_id} cannot depend on itself")
            if rows[j].play_id != r.play_id:
                raise TraceError(path, None, f"request {r.request_id} in play {r.play_id} depends on request {rid} "
                                             f"in play {rows[j].play_id}")
            dep_source.append(j)
            dep_trigger.append(trigger)
            dep_delay.append(delay)
            dep_relation.append(relation)
        dep_indptr[i + 1] = len(dep_source)
    dep_source = np.array(dep_source, np.int64)
    _check_acyclic(path, rows, dep_indptr, dep_source)
    # plays: rows of one play share its ordinal; ordinals all-or-nothing, 0..P-1
    plays: dict[str, list] = {}
    for i, r in enumerate(rows):
        plays.setdefault(r.play_id, []).append(i)
    ordinals = {}
    for pid, members in plays.items():
        values = {rows[i].source_play_ordinal for i in members}
        if len(values) > 1:
            raise TraceError(path, None, f"play {pid} has inconsistent source_play_ordinal values")
        ordinals[pid] = values.pop()
    given = [o for o in ordinals.values() if o is not None]
    if given and len(given) != len(ordinals):
        raise TraceError(path, None, "source_play_ordinal must be set for every play when it is used")
    if given:
        for expected, found in enumerate(sorted(given)):
            if found != expected:
                raise TraceError(path, None, "source_play_ordinal values must be unique and contiguous from 0; "
                                             f"expected {expected}, found {found}")
        play_names = sorted(plays, key=lambda pid: ordinals[pid])
    else:
        play_names = sorted(plays, key=lambda pid: pid.encode())
    play_index = {pid: k for k, pid in enumerate(play_names)}
    nb = np.array([r.not_before_ms for r in rows], np.float64)
    if rebase:
        nb = (nb - nb.min()) / ratio
    counts = np.array([len(r.hash_ids) for r in rows], np.int64)
    raw_indptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=raw_indptr[1:])
    raw_ids = np.array([h for r in rows for h in r.hash_ids], np.uint64)
    out_ids = np.empty(n, dtype=object)
    out_ids[:] = [r.output_token_ids for r in rows]

    def objects(values):
        a = np.empty(n, dtype=object)
        a[:] = values
        return a
    graph = AgenticGraph(
        input_format=input_format, block_size=int(block), source_format=source_format,
        source_digest=source_digest, lanes=lanes,
        request_id=objects([r.request_id for r in rows]), play_id=objects([r.play_id for r in rows]),
        session_id=objects([r.session_id for r in rows]), model=objects([r.model for r in rows]),
        input_length=np.array([r.input_length for r in rows], np.int64),
        output_length=np.array([r.output_length for r in rows], np.int64),
        not_before_ms=nb,
        recorded_api_time_ms=np.array([np.nan if r.recorded_api_time_ms is None else r.recorded_api_time_ms
                                       for r in rows], np.float64),
        source_play_ordinal=np.array([-1 if r.source_play_ordinal is None else r.source_play_ordinal for r in rows],
                                     np.int64),
        priority=np.array([r.priority for r in rows], np.int64),
        strict_priority=np.array([r.strict_priority for r in rows], np.int64),
        policy_class=objects([r.policy_class for r in rows]), output_token_ids=out_ids,
        raw_hash_indptr=raw_indptr, raw_hash_ids=raw_ids,
        dep_indptr=dep_indptr, dep_source=dep_source, dep_trigger=np.array(dep_trigger, np.int8),
        dep_delay_ms=np.array(dep_delay, np.float64) / ratio, dep_relation=np.array(dep_relation, np.int8),
        play_names=np.array(play_names, dtype=object),
        node_play=np.array([play_index[r.play_id] for r in rows], np.int64),
        recorded_interval_ms=None if getattr(rows[0], "recorded_interval", None) is None else
        np.array([r.recorded_interval for r in rows], np.float64))
    return graph, raw_ids


def _check_acyclic(path: str, rows: list, dep_indptr: np.ndarray, dep_source: np.ndarray) -> None:
    """Kahn's algorithm; a cycle names up to 8 of its blocked requests in node order."""
    n = len(rows)
    remaining = np.diff(dep_indptr).copy()
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for e in range(dep_indptr[i], dep_indptr[i + 1]):
            children[int(dep_source[e])].append(i)
    ready = [i for i in range(n) if remaining[i] == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for c in children[i]:
            remaining[c] -= 1
            if remaining[c] == 0:
                ready.append(c)
    if done < n:
        blocked = [rows[i].request_id for i in range(n) if remaining[i] > 0]
        raise TraceError(path, None, f"cycle detected among {len(blocked)} agentic requests; blocked request IDs: "
                                     + ", ".join(blocked[:8]))


def _rust_float(x: float) -> str:
    """A float as Rust's Display writes it (-1, 2.5, NaN, inf)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if x == int(x) and abs(x) < 1e16 else repr(x)


def _rust_debug_float(x: float) -> str:
    """A float as Rust's Debug writes it (-1.0, 2.5)."""
    if math.isfinite(x) and x == int(x) and abs(x) < 1e16:
        return f"{int(x)}.0"
    return _rust_float(x)


# ---------------------------------------------------------------------------------------------
# lowering


def _lower(path: str, graph: AgenticGraph, rows: list, raw_ids: np.ndarray) -> Workload:
    """The graph as a ``Workload``: one row per node in node order, each its own
    session (so requests due at one instant go in node order), the started roots in
    the start order; hash ids interned over the nodes in that order."""
    n = graph.num_nodes
    session = np.arange(n, dtype=np.int32)
    output_len = graph.output_length.copy()
    authored_start, authored_tokens = graph.authored_outputs()
    start_ms, order = graph.start_order()
    return Workload(
        path=path,
        trace_block_size=graph.block_size,
        line_no=np.array([r.line for r in rows], np.int64),
        request_name=graph.request_id.copy(),
        session=session,
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=graph.input_length.copy(),
        output_len=output_len,
        hash_indptr=graph.raw_hash_indptr.copy(),
        hash_ids=intern_hash_ids(raw_ids),
        order=order,
        out_plan=rows_output_plan(session, output_len, authored_start),
        authored_tokens=authored_tokens,
        agentic=graph,
    )


# ---------------------------------------------------------------------------------------------
# identity


def json_float(x: float) -> str:
    """``x`` as serde_json writes an f64 (ryu's shortest digits: ``100.0``,
    ``0.00001``, ``1e-7``, ``1e16``)."""
    if not math.isfinite(x):
        return "null"
    sign = "-" if x < 0 else ""
    mantissa, _, exp = repr(abs(x)).partition("e")  # Python's repr: the shortest digits too
    whole, _, frac = mantissa.partition(".")
    if not exp:
        frac = frac.rstrip("0")
    digits = (whole + frac).lstrip("0") or "0"
    k = (int(exp) if exp else 0) - len(frac)  # value = digits x 10^k
    stripped = digits.rstrip("0")
    k += len(digits) - len(stripped)
    digits = stripped or "0"
    if digits == "0":
        return sign + "0.0"
    n = len(digits)
    kk = n + k
    if 0 <= k and kk <= 16:
        out = digits + "0" * k + ".0"
    elif 0 < kk <= 16:
        out = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        out = "0." + "0" * (-kk) + digits
    elif n == 1:
        out = f"{digits}e{kk - 1}"
    else:
        out = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + out


def json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def graph_digest(graph: AgenticGraph) -> str:
    """The reference's canonical graph digest: blake3 (hex) of the compact JSON of
    ``{block_size, nodes}``, nodes in node order, times as the run uses them (re-based,
    sped up; ``recorded_api_time_ms`` as written), dependencies sorted by (request,
    trigger, relation, delay)."""
    parts = []
    rid = graph.request_id
    for i in range(graph.num_nodes):
        s = ['{"request_id":', json_str(rid[i]), ',"play_id":', json_str(graph.play_id[i])]
        if graph.source_play_ordinal[i] >= 0:
            s += [',"source_play_ordinal":', str(int(graph.source_play_ordinal[i]))]
        out_ids = graph.output_token_ids[i]
        hashes = graph.raw_hash_ids[graph.raw_hash_indptr[i]:graph.raw_hash_indptr[i + 1]]
        s += [',"session_id":', json_str(graph.session_id[i]), ',"model":', json_str(graph.model[i]),
              ',"input_length":', str(int(graph.input_length[i])), ',"max_output_tokens":',
              str(int(graph.output_length[i])),
              ',"output_token_ids":', "null" if out_ids is None else "[" + ",".join(map(str, out_ids)) + "]",
              ',"replay_key":', "null" if out_ids is None else json_str(rid[i]),
              ',"hash_ids":[', ",".join(map(str, hashes.tolist())), "]",
              ',"not_before_ms":', json_float(float(graph.not_before_ms[i]))]
        if not math.isnan(graph.recorded_api_time_ms[i]):
            s += [',"recorded_api_time_ms":', json_float(float(graph.recorded_api_time_ms[i]))]
        pc = graph.policy_class[i]
        s += [',"priority":', str(int(graph.priority[i])), ',"strict_priority":', str(int(graph.strict_priority[i])),
              ',"policy_class":', "null" if pc is None else json_str(pc), ',"dependencies":[']
        deps = [(rid[graph.dep_source[e]], int(graph.dep_trigger[e]), int(graph.dep_relation[e]),
                 float(graph.dep_delay_ms[e])) for e in range(graph.dep_indptr[i], graph.dep_indptr[i + 1])]
        deps.sort(key=lambda d: (d[0].encode(), d[1], d[2], d[3]))
        s.append(",".join('{"request_id":' + json_str(d[0]) + ',"trigger":"' + TRIGGERS[d[1]] + '","delay_ms":'
                          + json_float(d[3]) + ',"relation":"' + RELATIONS[d[2]] + '"}' for d in deps))
        s.append("]}")
        parts.append("".join(s))
    doc = '{"block_size":' + str(graph.block_size) + ',"nodes":[' + ",".join(parts) + "]}"
    return blake3.blake3(doc.encode()).hexdigest()
