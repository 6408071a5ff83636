"""The kernel state of agentic simulations (``sims.ag_*``, kernels.agentic.release): each
simulation's dependency graph laid out at its request rows."""

from __future__ import annotations

import numpy as np

from aisim_fast.kernels.schema import layout as L
from aisim_fast.trace.agentic_graph import TRIGGER_DISPATCH


def agentic_state(sims, q_off: np.ndarray, n_logical: int, sm_i: np.ndarray, rq_f: np.ndarray) -> dict:
    """The ``Sims`` fields of the batch's agentic graphs, with ``SM_AGENTIC`` set and
    each waiting request's release floor written into ``rq_f`` (NaN for a play that
    waits for its lane: its start sets them); none when no simulation is agentic."""
    agentic = [s for s, sim in enumerate(sims) if sim.workload.agentic is not None]
    if not agentic:
        return {}
    n_edges = sum(len(sims[s].workload.agentic.dep_source) for s in agentic)
    n_plays = sum(len(sims[s].workload.agentic.play_names) for s in agentic)
    ag_q = L.AGENTIC_REQUEST.new(n_logical)
    ag_nb_ms = np.zeros(n_logical)
    ag_edge = L.AGENTIC_EDGE.new(n_edges)
    ag_edge_ms = np.zeros(n_edges)
    ag_play = L.AGENTIC_PLAY.new(n_plays)
    ag_play_ms = np.zeros(n_plays)
    e_base = g_base = 0
    for s in agentic:
        g = sims[s].workload.agentic
        a, n, p = int(q_off[s]), g.num_nodes, len(g.play_names)
        rows = slice(a, a + n)
        sm_i[s, L.SM_AGENTIC] = 1
        n_deps = np.diff(g.dep_indptr)
        child = np.repeat(np.arange(n, dtype=np.int64), n_deps)
        # out-edges grouped by source (each source's in authored order of its children)
        by_source = np.argsort(g.dep_source, kind="stable")
        edges = slice(e_base, e_base + len(by_source))
        ag_edge[edges, L.AGE_CHILD] = a + child[by_source]
        ag_edge[edges, L.AGE_TRIGGER] = np.where(g.dep_trigger[by_source] == TRIGGER_DISPATCH,
                                                 L.AG_TRIGGER_DISPATCH, L.AG_TRIGGER_COMPLETION)
        ag_edge_ms[edges] = g.dep_delay_ms[by_source]
        out_len = np.bincount(g.dep_source, minlength=n)
        ag_q[rows, L.AGQ_EDGE_OFF] = e_base + np.concatenate([[0], np.cumsum(out_len)[:-1]])
        ag_q[rows, L.AGQ_EDGE_LEN] = out_len
        ag_q[rows, L.AGQ_DEPS_LEFT] = n_deps
        ag_q[rows, L.AGQ_PLAY] = g_base + g.node_play
        # each play's requests linked in node order
        order = np.lexsort((np.arange(n), g.node_play))
        same = g.node_play[order[1:]] == g.node_play[order[:-1]]
        nxt = np.full(n, -1, np.int64)
        nxt[order[:-1][same]] = a + order[1:][same]
        ag_q[rows, L.AGQ_PLAY_NEXT] = nxt
        ag_nb_ms[rows] = g.not_before_ms
        plays = slice(g_base, g_base + p)
        first = np.full(p, n, np.int64)
        np.minimum.at(first, g.node_play, np.arange(n))  # the smallest node of each play
        ag_play[plays, L.AGP_FIRST] = a + first
        ag_play[plays, L.AGP_NODES] = np.bincount(g.node_play, minlength=p)
        sm_i[s, L.SM_AG_PLAY_OFF] = g_base
        sm_i[s, L.SM_AG_PLAY_END] = g_base + p
        sm_i[s, L.SM_AG_NEXT_PLAY] = g_base + p
        if g.lanes:
            # lane k starts play k; the others wait for a lane to free
            started = min(g.lanes, p)
            ag_play[g_base:g_base + started, L.AGP_LANE] = np.arange(started)
            sm_i[s, L.SM_AG_NEXT_PLAY] = g_base + started
        ag_play_ms[plays] = g.root_not_before_ms()
        ready_ms, _ = g.initial_ready_ms()
        rq_f[rows, L.RQF_READY_MS] = ready_ms
        e_base += len(by_source)
        g_base += p
    return dict(ag_q=ag_q, ag_nb_ms=ag_nb_ms, ag_edge=ag_edge, ag_edge_ms=ag_edge_ms, ag_play=ag_play,
                ag_play_ms=ag_play_ms)
