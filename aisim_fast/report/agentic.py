"""What an agentic replay reports beyond the per-request metrics, as the reference
reports it: each request's place in its graph (per-request columns) and the run's
trajectory keys (``summary.json``): the graph and its digest, each play's outcome,
trajectory end-to-end latencies, and the lifecycle of every request and play with
its digest.

A play's trajectory runs from the earliest dispatch of its roots to the last
terminal of its requests; only plays whose every request completed count.
Lifecycle events (dispatch, causal_terminal, skipped, quiescent, play_quiescent) are
ordered as the reference's workload driver records them: sends and feedback batches
in the order the run made them (a worker's pass end reports its terminals as one
batch, and the pass ends of several workers at one instant, one after another, are one
batch to the reference: ``reference_batches``); a batch records its
terminals in node order, each followed by the skips its failure causes, then their
quiescences, each followed by its play's when it settles the play. A request is quiescent once it released every
resource: at its terminal, or (disaggregated) when its prefill's KV is released, if
later (a one-token request ends on the prefill side before its source goes). A play
settles when it has finished and every request it sent is quiescent.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from aisim_fast.report.metrics import STATUS_COMPLETED, exact_distribution
from aisim_fast.trace.agentic_graph import AgenticGraph, graph_digest, json_float, json_str

LIFECYCLE_SCHEMA = "aisimulate.agentic.lifecycle.v1"
_LIFECYCLE_DOMAIN = b"aisimulate-agentic-lifecycle-v1\0"
_TERMINAL_STATUS = {"completed": "completed", "rejected": "rejected", "canceled": "canceled",
                    "cancelled": "canceled", "failed": "failed"}


def request_columns(graph: AgenticGraph, arrival_ms: np.ndarray, play_lane: np.ndarray | None,
                    sent_seq: np.ndarray | None, ended_seq: np.ndarray | None) -> dict:
    """Per-request columns of an agentic run, one per node in node order
    (``arrival_ms``: when each was sent; ``play_lane``: the lane each play ran on, -1
    none; ``sent_seq`` / ``ended_seq``: the place of its send and of the feedback
    batch that reported its terminal in the run's one sequence of both; as the run
    decided them, None: unknown): its play and session, the reference's ``agentic``
    identity (conversation, root when its play has one, spawning parent, lane), when it
    was dispatched (its arrival: the driver sends it when due), and the two places
    (``dispatch_ordinal``, ``feedback_batch``): a child its parent's send releases goes
    after the parent whatever their node order, and two workers' passes ending at one
    instant report in two batches of the run (``reference_batches`` merges them)."""
    n = graph.num_nodes
    snap = graph.snapshot
    if snap is not None:  # each cut play runs on its own lane from the start
        play_lane = snap.play_lane
    if play_lane is None:
        play_lane = np.full(len(graph.play_names), -1, np.int64)
    lane = np.asarray(play_lane)[graph.node_play]
    return {
        "play_id": graph.play_id,
        "session_id": graph.session_id,
        "agentic_request_id": graph.request_id,
        "agentic_conversation_id": graph.session_id,
        "agentic_root_id": graph.root_id() if snap is None else _snapshot_identity(snap, graph, "root_id"),
        "agentic_parent_id": graph.parent_id() if snap is None else _snapshot_identity(snap, graph, "parent_id"),
        "agentic_cache_id": np.full(n, None, dtype=object) if snap is None else snap.cache_id,
        "agentic_lane_id": np.array([None if k < 0 else f"lane:{k}" for k in lane.tolist()], dtype=object),
        "dispatched_at_ms": arrival_ms,
        "dispatch_ordinal": np.full(n, -1, np.int64) if sent_seq is None else sent_seq,
        "feedback_batch": np.full(n, -1, np.int64) if ended_seq is None else ended_seq,
    }


def _snapshot_identity(snap, graph: AgenticGraph, key: str) -> np.ndarray:
    """object[node]: a cut play's request identity ``key`` as its evidence gives it."""
    by_id = {r["identity"]["request_id"]: r["identity"].get(key) for e in snap.evidence for r in e["requests"]}
    out = np.empty(graph.num_nodes, dtype=object)
    out[:] = [by_id[rid] for rid in graph.request_id]
    return out


def _source_ids(graph: AgenticGraph) -> np.ndarray:
    """object[node]: each request's id in the trace (a snapshot's instances keep it)."""
    return graph.request_id if graph.snapshot is None else graph.snapshot.source_request_id


def _nodes(graph: AgenticGraph, requests: pd.DataFrame) -> np.ndarray:
    index = pd.Index(graph.request_id)
    return index.get_indexer(requests["agentic_request_id"].to_numpy(object))


def setup_report_keys(graph: AgenticGraph, requests: pd.DataFrame, setup) -> dict:
    """``report_keys`` of a replay of ``setup`` (a ``config.ReplaySetup``): its target
    model, and a legacy trace's provenance named by the path the payload gives."""
    digest = None
    if graph.source_format == "legacy_agentic_mooncake" and setup.trace_named:
        digest = f"{setup.trace_named}:{graph.num_nodes}"
    return report_keys(graph, requests, setup.execution_model, digest)


def report_keys(graph: AgenticGraph, requests: pd.DataFrame, execution_model: str | None,
                source_digest: str | None = None) -> dict:
    """The reference's agentic report keys of a run (``requests``: the sent requests'
    records; ``source_digest``: the trace's provenance as the payload names it, for
    legacy rows whose digest is their path)."""
    import blake3

    n_plays = len(graph.play_names)
    node = _nodes(graph, requests)
    status = requests["terminal_status"].to_numpy(object)
    arrival = requests["arrival_ms"].to_numpy(np.float64)
    terminal = requests["completion_ms"].to_numpy(np.float64)
    ended = pd.notna(requests["terminal_status"]).to_numpy() & np.isfinite(terminal)
    play = graph.node_play[node]
    is_root = graph.is_root[node]
    # per play: failures (first by (time, node)), last terminal, root dispatch
    failed_at = {}
    for k in np.flatnonzero(ended & (status != STATUS_COMPLETED)):
        g, key = int(play[k]), (float(terminal[k]), int(node[k]))
        if g not in failed_at or key < failed_at[g][0]:
            failed_at[g] = (key, k)
    n_nodes = np.bincount(graph.node_play, minlength=n_plays)
    done = np.bincount(play[ended & (status == STATUS_COMPLETED)], minlength=n_plays)
    sent = np.bincount(play, minlength=n_plays)
    sent_ended = np.bincount(play[ended], minlength=n_plays)
    last_terminal = np.full(n_plays, -np.inf)
    np.maximum.at(last_terminal, play[ended], terminal[ended])
    quiet = quiescent_ms(requests)
    last_quiet = np.full(n_plays, -np.inf)
    np.maximum.at(last_quiet, play[ended], quiet[ended])
    root_dispatch = np.full(n_plays, np.inf)
    np.minimum.at(root_dispatch, play[is_root], arrival[is_root])
    if graph.snapshot is not None:  # a cut play's trajectory runs from the cut, 0
        root_dispatch[:] = 0.0
    outcomes, e2e = [], []
    settled_ms = np.full(n_plays, np.nan)
    for g in range(n_plays):
        failed = g in failed_at
        finished = sent_ended[g] == sent[g] and (failed or done[g] == n_nodes[g])
        out = {"play_id": str(graph.play_names[g])}
        if finished:
            settled_ms[g] = last_quiet[g]
        if not finished:
            out["status"] = "incomplete"
        elif failed:
            out["status"] = "failed"
        else:
            out["status"] = "completed"
        if failed:
            (t_fail, _), k = failed_at[g]
            out["causal_terminal_ms"] = t_fail
            out["failure_request_id"] = str(_source_ids(graph)[node[k]])
            out["failure_status"] = _TERMINAL_STATUS.get(status[k], status[k])
        else:
            out["causal_terminal_ms"] = float(last_terminal[g]) if np.isfinite(last_terminal[g]) else None
        out["settled_at_ms"] = None if not finished else float(settled_ms[g])
        outcomes.append(dict(sorted(out.items())))
        if not failed and done[g] == n_nodes[g] and np.isfinite(root_dispatch[g]):
            e2e.append(float(last_terminal[g] - root_dispatch[g]))
    dist = exact_distribution(np.array(e2e, np.float64))
    events = lifecycle_events(graph, requests, node, failed_at, settled_ms)
    digest = blake3.blake3(_LIFECYCLE_DOMAIN + "".join(events).encode()).hexdigest()
    snap = graph.snapshot
    if snap is None:
        identity = {"block_size": graph.block_size, "graph_digest": graph_digest(graph), "node_count": graph.num_nodes,
                    "play_count": n_plays,
                    "source": {"digest": source_digest or graph.source_digest, "format": graph.source_format},
                    "source_models": graph.source_models()}
    else:  # the source graph's, as recorded
        identity = json.loads(json.dumps(snap.source_identity))
        if source_digest:
            identity["source"]["digest"] = source_digest
    models = identity["source_models"]
    out = {
        "agentic_graph": identity,
        "agentic_input_format": graph.input_format,
        "agentic_lanes": graph.lanes if snap is None else snap.lanes,
        "agentic_qualification": "functional_only",
        "agentic_model_projection": {"policy": "project_to_configured_target", "source_models": models,
                                     "target_model": execution_model},
        "agentic_play_outcomes": outcomes,
        "total_trajectories": n_plays,
        "completed_trajectories": len(e2e),
        "incomplete_trajectories": n_plays - len(e2e),
        "agentic_lifecycle_event_count": len(events),
        "agentic_lifecycle_digest": digest,
    }
    if snap is not None:
        out["agentic_snapshots"] = snap.evidence
    out.update(graph.extra_report)
    for name in ("mean", "median", "min", "max", "std"):
        out[f"{name}_trajectory_e2e_latency_ms"] = dist[name]
    out["p50_trajectory_e2e_latency_ms"] = dist["median"]
    for p in ("p75", "p90", "p95", "p99"):
        out[f"{p}_trajectory_e2e_latency_ms"] = dist[p]
    return out


def quiescent_ms(requests: pd.DataFrame) -> np.ndarray:
    """float64[request]: when each request released its last resource (module docstring)."""
    terminal = requests["completion_ms"].to_numpy(np.float64)
    if "source_released_ms" not in requests:
        return terminal
    released = requests["source_released_ms"].to_numpy(np.float64)
    return np.where(np.isfinite(released), np.fmax(terminal, released), terminal)


def lifecycle_events(graph: AgenticGraph, requests: pd.DataFrame, node: np.ndarray, failed_at: dict,
                     settled_ms: np.ndarray) -> list[str]:
    """The lifecycle records (JSON lines, ordinals numbered) in the reference's order
    (module docstring)."""
    status = requests["terminal_status"].to_numpy(object)
    arrival = requests["arrival_ms"].to_numpy(np.float64)
    terminal = requests["completion_ms"].to_numpy(np.float64)
    sent_seq = requests["dispatch_ordinal"].to_numpy(np.int64)
    ended_seq = reference_batches(requests)
    names = _source_ids(graph)
    play = graph.node_play[node]
    sent = set(node.tolist())
    # (time, place in the run's sequence, terminal 0 / quiescence 1, node, sub) -> record
    records = []
    first_failure = {g: k for g, (_, k) in failed_at.items()}
    skipped_by_play: dict[int, list[int]] = {}
    for g in first_failure:
        skipped_by_play[g] = [i for i in np.flatnonzero(graph.node_play == g).tolist() if i not in sent]
    quiet = quiescent_ms(requests)
    first_batch: dict[float, int] = {}
    for t_ms, b in zip(terminal.tolist(), ended_seq.tolist()):
        if t_ms == t_ms:
            first_batch[t_ms] = min(first_batch.get(t_ms, b), b)
    # a quiescence after the terminal (its source released later) joins the first batch
    # of its instant
    q_batch = [int(ended_seq[k]) if quiet[k] == terminal[k] else first_batch.get(quiet[k], -1)
               for k in range(len(node))]
    settled_by = {}  # play -> the request whose quiescence settles it (the last recorded)
    for k in range(len(node)):
        g = int(play[k])
        if not np.isnan(settled_ms[g]) and quiet[k] == settled_ms[g]:
            settled_by[g] = max(settled_by.get(g, (-2, -1)), (q_batch[k], int(node[k])))
    for k in range(len(node)):
        i, g = int(node[k]), int(play[k])
        pid, rid = graph.play_names[g], names[i]
        records.append(((arrival[k], int(sent_seq[k]), 0, 0, 0), _event(arrival[k], pid, rid, "dispatch", None)))
        if not np.isfinite(terminal[k]) or status[k] is None:
            continue
        batch = int(ended_seq[k])
        st = _TERMINAL_STATUS.get(status[k], status[k])
        records.append(((terminal[k], batch, 0, i, 0), _event(terminal[k], pid, rid, "causal_terminal", st)))
        if first_failure.get(g) == k:
            for j, skipped in enumerate(skipped_by_play[g]):
                records.append(((terminal[k], batch, 0, i, 1 + j),
                                _event(terminal[k], pid, names[skipped], "skipped", None)))
        records.append(((quiet[k], q_batch[k], 1, i, 0), _event(quiet[k], pid, rid, "quiescent", None)))
        if settled_by.get(g, (0, -1))[1] == i:
            records.append(((quiet[k], q_batch[k], 1, i, 1), _event(quiet[k], pid, None, "play_quiescent", None)))
    records.sort(key=lambda r: r[0])
    return [line.replace('"ordinal":0,', f'"ordinal":{n},', 1) for n, (_, line) in enumerate(records)]


def reference_batches(requests: pd.DataFrame) -> np.ndarray:
    """int64[request]: the feedback batch the reference reports each request's terminal
    in. The run numbers every pass end's terminals as a batch of its own; the reference
    applies the pass ends of all workers at one instant together, so batches at one
    instant that follow each other in the run's sequence (no send between them) are one,
    numbered as the first. A batch of rejections only (requests refused when a pass was
    scheduled, after the pass ends) stays apart from them, as in the reference
    (measured: two one-token requests ending on two workers at 5 ms; a rejection at the
    instant a pass ended), unless its worker stays busy (below); such batches of one
    instant are one."""
    sent = requests["dispatch_ordinal"].to_numpy(np.int64)
    ended = requests["feedback_batch"].to_numpy(np.int64)
    at_ms = requests["completion_ms"].to_numpy(np.float64)
    rejected = (requests["terminal_status"] == "rejected").to_numpy()
    worker = requests["worker"].to_numpy(np.int64, na_value=-1)
    admitted_ms = requests["first_admit_ms"].to_numpy(np.float64, na_value=np.nan)
    # per place in the sequence: a send, or a batch with its instant and whether it
    # holds rejections only
    kind: dict[int, tuple] = {int(q): ("send", None) for q in sent}
    only_rejections: dict[int, bool] = {}
    batch_worker: dict[int, int] = {}
    for b, t, r, w in zip(ended.tolist(), at_ms.tolist(), rejected.tolist(), worker.tolist()):
        if b >= 0:
            only_rejections[b] = only_rejections.get(b, True) and r
            kind[b] = ("batch", t)
            batch_worker.setdefault(b, w)
    # A worker still running a request after its pass end schedules its next pass in the
    # round of the pass ends: what that schedule rejects joins their batch (measured:
    # differential seed 503 case 54). Workers left idle schedule on a later wake-up, all
    # of one instant together: their rejections are one batch of their own (seed 505
    # case 49: two idle workers woken by two sends reject both roots in one batch).
    busy = _busy_after(worker, admitted_ms, at_ms)
    for q in [q for q, apart in only_rejections.items() if apart]:
        if busy(batch_worker[q], kind[q][1]):
            only_rejections[q] = False
    first: dict[int, int] = {}
    prev, head = None, -1
    for q in sorted(kind):
        what, t = kind[q]
        if what == "batch":
            what = "rejections" if only_rejections[q] else "passes"
        if what != "send" and prev == (what, t):
            first[q] = head
        else:
            head = q
            first[q] = q
        prev = (what, t)
    return np.array([first.get(b, b) for b in ended.tolist()], np.int64)


def _busy_after(worker: np.ndarray, admitted_ms: np.ndarray, end_ms: np.ndarray):
    """``busy(w, t)``: whether worker ``w`` runs a request admitted before ``t`` that ends
    after it (per worker: admissions sorted with the latest end so far, one binary search
    a question)."""
    known = ~np.isnan(admitted_ms)
    runs = {}
    for w in np.unique(worker[known]).tolist():
        mine = known & (worker == w)
        order = np.argsort(admitted_ms[mine], kind="stable")
        runs[w] = (admitted_ms[mine][order], np.fmax.accumulate(end_ms[mine][order]))

    def busy(w: int, t_ms: float) -> bool:
        if w not in runs:
            return False
        admitted, latest_end = runs[w]
        k = int(np.searchsorted(admitted, t_ms, side="left"))  # admitted strictly before t
        return k > 0 and bool(latest_end[k - 1] > t_ms)
    return busy


def _event(at_ms: float, play_id: str, request_id: str | None, event: str, status: str | None) -> str:
    s = ['{"schema":"', LIFECYCLE_SCHEMA, '","ordinal":0,"at_ms":', json_float(float(at_ms)),
         ',"play_id":', json_str(play_id)]
    if request_id is not None:
        s += [',"request_id":', json_str(request_id)]
    s += [',"event":"', event, '"']
    if status is not None:
        s += [',"status":"', status, '"']
    s.append("}\n")
    return "".join(s)
