"""Seeded snapshots of an agentic graph (``traffic.agentic_snapshot: {seed}``): each
lane replays one play cut at a sampled instant, as the reference's request-boundary
snapshots do (verified on its runs).

* Lane ``l`` takes slot ``l`` (its first play), source play ``plays[slot % P]`` in play
  order. Times are the trace's recorded ones (not re-based): a request starts at its
  ``not_before_ms`` and ends ``recorded_api_time_ms`` later when given, or (Dynamo
  records) when its record says it started and ended.
* The cut: ``t* = first + (0.25 + 0.5 u) (last - first)`` over the play's starts, ``u``
  the top 53 bits of the first 8 little-endian bytes of blake3 of the compact JSON
  ``["aisimulate.agentic.snapshot.v1", seed, graph digest, source play id, lane, 0]``.
* A request that started before ``t*`` is historical: never sent (a historical request
  waiting on one that starts after ``t*`` is refused). A live request waits
  ``max(not_before - t*, 0)`` and, for each historical dependency, its trigger (the
  parent's recorded start for dispatch, its end, or its start without one, for
  completion) plus the delay, less ``t*``; that wait, divided by
  ``arrival_speedup_ratio`` with its live dependencies' delays, is its floor from 0.
* Each cut play is an instance: ``agentic-v1:{digest}:{seed}:{lane}:0``, its requests
  ``{play}:request:{id}``, conversations ``{play}:conversation:{session}``, cache
  ``{play}:cache``. The record keeps the source ``request_id``; its session is the
  instance conversation.
* Prompts: each play's hash ids are numbered in first appearance over its requests
  (node order), offset by ``slot x`` the largest such count of any play, so slots
  never share cache; outputs are the source requests' planned tokens.
* ``agentic_snapshots`` in the report is the reference's evidence per lane: the cut, every
  request of the source play (historical or live, its remaining wait and pending
  dependencies) and the primers (each live conversation's latest historical request,
  listed, not run).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import blake3
import numpy as np

from aisim_fast.trace.agentic_graph import RELATION_SPAWN, TRIGGER_DISPATCH, AgenticGraph, graph_digest
from aisim_fast.trace.workload import TraceError, Workload, rows_output_plan

SCHEMA = "aisimulate.agentic.snapshot.v1"


@dataclass(frozen=True)
class Snapshot:
    """What a snapshot replay reports beyond its graph (``report.agentic``)."""
    lanes: int
    source_identity: dict      # the source graph's agentic_graph key (recorded times)
    evidence: list             # the agentic_snapshots key, one entry per lane
    play_lane: np.ndarray      # int64[play]: the lane each cut play runs on
    cache_id: np.ndarray       # object[node]
    source_request_id: np.ndarray  # object[node]: the id in the trace (records and lifecycle name it)


def snapshot_workload(path: str, graph: AgenticGraph, lanes: int | None, ratio: float, *, seed: int) -> Workload:
    """The cut plays of ``graph`` (built on its recorded times) as the ``Workload`` a
    snapshot replay runs."""
    if not lanes:
        raise ValueError("agentic_snapshot requires positive agentic_lanes")
    n = graph.num_nodes
    digest = graph_digest(graph)
    plays = [np.flatnonzero(graph.node_play == g) for g in range(len(graph.play_names))]
    topo = _topological_rank(graph)
    # per play, its hash ids numbered in first appearance; the stride is the largest count
    ranks = [None] * n
    stride = 1
    for members in plays:
        seen: dict = {}
        for i in members.tolist():
            ids = graph.raw_hash_ids[graph.raw_hash_indptr[i]:graph.raw_hash_indptr[i + 1]].tolist()
            ranks[i] = [seen.setdefault(h, len(seen)) for h in ids]
        stride = max(stride, len(seen))
    if graph.recorded_interval_ms is not None:  # as the source format recorded them
        start, end = graph.recorded_interval_ms[:, 0], graph.recorded_interval_ms[:, 1]
    else:
        start = graph.not_before_ms
        end = np.where(np.isnan(graph.recorded_api_time_ms), np.nan, start + graph.recorded_api_time_ms)
    for i in range(n):
        if not math.isfinite(start[i]) or start[i] < 0 or (not math.isnan(end[i]) and end[i] < start[i]):
            raise TraceError(path, None, "recorded API interval overflow or invalid interval")
    authored_start, authored_tokens = graph.authored_outputs()
    full_plan = rows_output_plan(np.arange(n, dtype=np.int32), graph.output_length, authored_start)

    identity = {"block_size": graph.block_size, "graph_digest": digest, "node_count": n,
                "play_count": len(plays), "source": {"digest": graph.source_digest, "format": graph.source_format},
                "source_models": graph.source_models()}
    out = _Rows()
    evidence, play_names, play_lane = [], [], []
    for lane in range(lanes):
        slot = lane
        g = slot % len(plays)
        members = plays[g].tolist()
        source_play = str(graph.play_names[g])
        first, last = float(start[members].min()), float(start[members].max())
        key = json.dumps([SCHEMA, seed, digest, source_play, lane, 0], separators=(",", ":"), ensure_ascii=False)
        bits = int.from_bytes(blake3.blake3(key.encode()).digest()[:8], "little")
        unit = (bits >> 11) / float(1 << 53)
        t_star = first + (0.25 + 0.5 * unit) * (last - first)
        play_id = f"agentic-v1:{digest}:{seed}:{lane}:0"
        cache_id = f"{play_id}:cache"
        roots = [i for i in members if graph.dep_indptr[i + 1] == graph.dep_indptr[i]]
        root_id = f"{play_id}:request:{graph.request_id[roots[0]]}" if len(roots) == 1 else None
        requests, live_sessions, latest, live = [], set(), {}, []
        for i in members:
            deps = range(graph.dep_indptr[i], graph.dep_indptr[i + 1])
            historical = start[i] < t_star
            if historical and any(start[graph.dep_source[e]] >= t_star for e in deps):
                raise TraceError(path, None, "snapshot boundary crosses a historical request's unresolved "
                                             f"dependency: {graph.request_id[i]}")
            session = str(graph.session_id[i])
            if historical:
                best = latest.get(session)
                if best is None or (start[i], topo[i]) > (start[best], topo[best]):
                    latest[session] = i
            else:
                live_sessions.add(session)
            wait = max(float(graph.not_before_ms[i]) - t_star, 0.0)
            pending = []
            if not historical:
                for e in deps:
                    j = int(graph.dep_source[e])
                    if start[j] < t_star:
                        trigger = start[j] if graph.dep_trigger[e] == TRIGGER_DISPATCH or math.isnan(end[j]) \
                            else end[j]
                        wait = max(wait, float(trigger + graph.dep_delay_ms[e]) - t_star)
                    else:
                        pending.append(e)
                # in the reference's dependency order: by source id, trigger, relation, delay
                pending.sort(key=lambda e: (graph.request_id[graph.dep_source[e]].encode(), int(graph.dep_trigger[e]),
                                            int(graph.dep_relation[e]), float(graph.dep_delay_ms[e])))
            ident = {"cache_id": cache_id, "conversation_id": f"{play_id}:conversation:{session}",
                     "lane_id": f"lane:{lane}", "play_id": play_id,
                     "request_id": f"{play_id}:request:{graph.request_id[i]}"}
            if root_id is not None:
                ident["root_id"] = root_id
            spawn = [int(graph.dep_source[e]) for e in deps if graph.dep_relation[e] == RELATION_SPAWN]
            if spawn:
                ident["parent_id"] = f"{play_id}:request:{graph.request_id[min(spawn)]}"
            requests.append({
                "historical": bool(historical), "identity": ident,
                "pending_dependencies": [f"{play_id}:request:{graph.request_id[graph.dep_source[e]]}"
                                         for e in pending],
                "recorded_end_ms": None if math.isnan(end[i]) else float(end[i]),
                "recorded_start_ms": float(start[i]), "remaining_delay_ms": 0.0 if historical else wait,
                "source_request_id": str(graph.request_id[i])})
            if not historical:
                live.append((i, ident, wait, pending))
        # the live requests in node order; an edge may point to a later one
        base = len(out.src)
        new_index = {i: base + k for k, (i, _, _, _) in enumerate(live)}
        for i, ident, wait, pending in live:
            out.add(graph, i, ident, wait / ratio, len(play_names),
                    [(new_index[int(graph.dep_source[e])], e) for e in pending], ratio,
                    [slot * stride + r for r in ranks[i]], full_plan[i], cache_id)
        primers = [{"conversation_id": f"{play_id}:conversation:{s}", "input_length": int(graph.input_length[i]),
                    "request_id": f"{play_id}:request:{graph.request_id[i]}",
                    "source_request_id": str(graph.request_id[i])}
                   for s in sorted(live_sessions, key=str.encode) if (i := latest.get(s)) is not None]
        evidence.append({"cache_id": cache_id, "graph": identity, "lane_id": lane, "play_id": play_id,
                         "play_ordinal": 0, "primers": primers, "recorded_last_start_ms": last,
                         "recorded_start_ms": first, "requests": requests, "schema": SCHEMA, "seed": seed,
                         "source_play_id": source_play, "t_star_ms": t_star})
        play_names.append(play_id)
        play_lane.append(lane)
    snap = Snapshot(lanes=lanes, source_identity=identity, evidence=evidence,
                    play_lane=np.array(play_lane, np.int64), cache_id=np.array(out.cache, dtype=object),
                    source_request_id=graph.request_id[np.array(out.src, np.int64)])
    return out.workload(path, graph, play_names, snap, authored_tokens)


def _topological_rank(graph: AgenticGraph) -> np.ndarray:
    """int64[node]: the node's place in Kahn's order, the smallest ready node first."""
    import heapq
    n = graph.num_nodes
    left = np.diff(graph.dep_indptr).copy()
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for e in range(graph.dep_indptr[i], graph.dep_indptr[i + 1]):
            children[int(graph.dep_source[e])].append(i)
    ready = [i for i in range(n) if left[i] == 0]
    heapq.heapify(ready)
    rank = np.zeros(n, np.int64)
    k = 0
    while ready:
        i = heapq.heappop(ready)
        rank[i] = k
        k += 1
        for c in children[i]:
            left[c] -= 1
            if left[c] == 0:
                heapq.heappush(ready, c)
    return rank


class _Rows:
    """The live requests of every cut play, in (lane, node) order, as graph columns."""

    def __init__(self):
        self.src, self.rid, self.session, self.nb, self.play = [], [], [], [], []
        self.dep_source, self.dep_edge, self.dep_count = [], [], []
        self.hashes, self.plan, self.cache = [], [], []
        self.delay_ratio = 1.0

    def add(self, graph, i, ident, floor_ms, play, deps, ratio, hashes, plan, cache_id) -> None:
        self.src.append(i)
        self.rid.append(ident["request_id"])
        self.session.append(ident["conversation_id"])
        self.nb.append(floor_ms)
        self.play.append(play)
        self.dep_source += [k for k, _ in deps]
        self.dep_edge += [e for _, e in deps]
        self.dep_count.append(len(deps))
        self.hashes.append(hashes)
        self.plan.append(plan)
        self.cache.append(cache_id)
        self.delay_ratio = ratio

    def workload(self, path: str, graph: AgenticGraph, play_names: list, snap: Snapshot, authored_tokens) -> Workload:
        src = np.array(self.src, np.int64)
        m = len(src)

        def objects(values):
            a = np.empty(len(values), dtype=object)
            a[:] = values
            return a
        edges = np.array(self.dep_edge, np.int64)
        indptr = np.zeros(m + 1, np.int64)
        np.cumsum(self.dep_count, out=indptr[1:])
        counts = np.array([len(h) for h in self.hashes], np.int64)
        hash_indptr = np.zeros(m + 1, np.int64)
        np.cumsum(counts, out=hash_indptr[1:])
        token_ids = np.array([t for h in self.hashes for t in h], np.int64)
        if len(token_ids) and token_ids.max() >= 1 << 32:
            raise ValueError("play token identity range exceeds u32 capacity; identities cannot be recycled")
        cut = AgenticGraph(
            input_format=graph.input_format, block_size=graph.block_size, source_format=graph.source_format,
            source_digest=graph.source_digest, lanes=None,
            request_id=objects(self.rid), play_id=objects([play_names[g] for g in self.play]),
            session_id=objects(self.session), model=graph.model[src], input_length=graph.input_length[src],
            output_length=graph.output_length[src], not_before_ms=np.array(self.nb, np.float64),
            recorded_api_time_ms=graph.recorded_api_time_ms[src], source_play_ordinal=np.full(m, -1, np.int64),
            priority=graph.priority[src], strict_priority=graph.strict_priority[src],
            policy_class=graph.policy_class[src], output_token_ids=graph.output_token_ids[src],
            raw_hash_indptr=hash_indptr, raw_hash_ids=token_ids.astype(np.uint64),
            dep_indptr=indptr, dep_source=np.array(self.dep_source, np.int64),
            dep_trigger=graph.dep_trigger[edges] if len(edges) else np.zeros(0, np.int8),
            dep_delay_ms=graph.dep_delay_ms[edges] / self.delay_ratio if len(edges) else np.zeros(0),
            dep_relation=graph.dep_relation[edges] if len(edges) else np.zeros(0, np.int8),
            play_names=objects(play_names), node_play=np.array(self.play, np.int64), snapshot=snap,
            extra_report=graph.extra_report)
        start_ms, order = cut.start_order()
        return Workload(
            path=path,
            trace_block_size=graph.block_size,
            line_no=src + 1,
            request_name=graph.request_id[src].copy(),
            session=np.arange(m, dtype=np.int32),
            turn_index=np.zeros(m, np.int32),
            start_ms=start_ms,
            delay_ms=np.zeros(m, np.float64),
            input_len=graph.input_length[src].copy(),
            output_len=graph.output_length[src].copy(),
            hash_indptr=hash_indptr,
            hash_ids=token_ids.astype(np.uint32),
            order=order,
            out_plan=np.array(self.plan, np.int64),
            authored_tokens=authored_tokens,
            agentic=cut,
        )
