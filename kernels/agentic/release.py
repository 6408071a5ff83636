"""Releasing the requests of an agentic dependency graph (the ``agentic`` feature,
compiled only for batches with an agentic simulation: ``SM_AGENTIC``).

The reference's workload driver, verified on its runs (trace.agentic_graph has the
rules in full):

* A request is sent when the release heap pops it (``kernels.loop.release_heap``,
  ordered by release time, then node). Sending fires its dispatch edges, and its
  play holds one more request in flight.
* Its terminal fires its completion edges, at the terminal time, when it completed
  and its play has not failed. An edge takes one from its child's dependencies left
  and raises the child's release floor to the trigger time plus its delay; the last
  one releases the child at that floor.
* A rejected, canceled or failed request fails its play: every request of the play
  not yet sent (waiting for dependencies, or released and waiting for its time) is
  skipped: never sent, no record (a skipped request still in the heap is dropped
  when popped).
* A play finishes when every request completed, or when it failed and its sent
  requests ended; with lanes, its lane then starts the next play waiting (plays
  wait in one queue, in play order, whichever lane frees first takes the next) at
  that instant, each request's floor at the start plus how far its ``not_before``
  lies past its play's roots' earliest, the roots released at theirs.
"""

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.release_heap import heap_push
from aisim_fast.kernels.schema.layout import (AG_TRIGGER_COMPLETION, AG_TRIGGER_DISPATCH, AGE_CHILD, AGE_TRIGGER,
                                              AGP_COMPLETED, AGP_FAILED, AGP_FINISHED, AGP_FIRST, AGP_LANE,
                                              AGP_NODES, AGP_PENDING, AGQ_DEPS_LEFT, AGQ_EDGE_LEN, AGQ_EDGE_OFF,
                                              AGQ_ENDED_SEQ, AGQ_PLAY, AGQ_PLAY_NEXT, AGQ_SENT_SEQ, RQ_STATUS, RQ_TERMINAL, RQF_READY_MS,
                                              RQF_TERMINAL_MS, RS_NOT_ARRIVED, SM_AG_NEXT_PLAY, SM_AG_PLAY_END, SM_AG_SEQ, SM_NUM_NOT_SENT,
                                              SM_NUM_TERMINAL,
                                              TERM_COMPLETED, TERM_NONE, TERM_NOT_SENT)


@kernel(cache=True, _nrt=False)
def _fire(rq, sims, s, q, trigger, t_ms):
    """Request q's ``trigger`` edges fire at ``t_ms``."""
    e0 = sims.ag_q[q, AGQ_EDGE_OFF]
    for e in range(e0, e0 + sims.ag_q[q, AGQ_EDGE_LEN]):
        if sims.ag_edge[e, AGE_TRIGGER] != trigger:
            continue
        c = sims.ag_edge[e, AGE_CHILD]
        if sims.ag_q[c, AGQ_DEPS_LEFT] <= 0 or rq.i64[c, RQ_TERMINAL] == TERM_NOT_SENT:
            continue  # no longer waiting for its dependencies
        sims.ag_q[c, AGQ_DEPS_LEFT] -= 1
        ready_ms = t_ms + sims.ag_edge_ms[e]
        if ready_ms > rq.f64[c, RQF_READY_MS]:
            rq.f64[c, RQF_READY_MS] = ready_ms
        if sims.ag_q[c, AGQ_DEPS_LEFT] == 0:
            heap_push(sims, rq, s, c)


@kernel(cache=True, _nrt=False)
def dispatched(rq, sims, s, q, now_ms):
    """Request q is sent at ``now_ms``."""
    sims.i64[s, SM_AG_SEQ] += 1
    sims.ag_q[q, AGQ_SENT_SEQ] = sims.i64[s, SM_AG_SEQ]
    sims.ag_play[sims.ag_q[q, AGQ_PLAY], AGP_PENDING] += 1
    _fire(rq, sims, s, q, AG_TRIGGER_DISPATCH, now_ms)


@kernel(cache=True, _nrt=False)
def _start_play(rq, sims, s, g, start_ms):
    """A lane starts play g at ``start_ms``."""
    root_nb_ms = sims.ag_play_ms[g]
    n = sims.ag_play[g, AGP_FIRST]
    while n >= 0:
        rq.f64[n, RQF_READY_MS] = start_ms + max(0.0, sims.ag_nb_ms[n] - root_nb_ms)
        if sims.ag_q[n, AGQ_DEPS_LEFT] == 0:
            heap_push(sims, rq, s, n)
        n = sims.ag_q[n, AGQ_PLAY_NEXT]


@kernel(cache=True, _nrt=False)
def ended(rq, sims, s, q):
    """Request q reached its terminal (``logical_terminal``), reported in the feedback
    batch SM_AG_SEQ counts."""
    sims.ag_q[q, AGQ_ENDED_SEQ] = sims.i64[s, SM_AG_SEQ]
    g = sims.ag_q[q, AGQ_PLAY]
    t_ms = rq.f64[q, RQF_TERMINAL_MS]
    sims.ag_play[g, AGP_PENDING] -= 1
    if rq.i64[q, RQ_TERMINAL] == TERM_COMPLETED:
        sims.ag_play[g, AGP_COMPLETED] += 1
        if sims.ag_play[g, AGP_FAILED] == 0:
            _fire(rq, sims, s, q, AG_TRIGGER_COMPLETION, t_ms)
    elif sims.ag_play[g, AGP_FAILED] == 0:
        sims.ag_play[g, AGP_FAILED] = 1
        n = sims.ag_play[g, AGP_FIRST]
        while n >= 0:
            if rq.i64[n, RQ_STATUS] == RS_NOT_ARRIVED and rq.i64[n, RQ_TERMINAL] == TERM_NONE:
                rq.i64[n, RQ_TERMINAL] = TERM_NOT_SENT
                sims.i64[s, SM_NUM_TERMINAL] += 1
                sims.i64[s, SM_NUM_NOT_SENT] += 1
            n = sims.ag_q[n, AGQ_PLAY_NEXT]
    if sims.ag_play[g, AGP_FINISHED] == 0 and sims.ag_play[g, AGP_PENDING] == 0 and (
            sims.ag_play[g, AGP_FAILED] != 0 or sims.ag_play[g, AGP_COMPLETED] == sims.ag_play[g, AGP_NODES]):
        sims.ag_play[g, AGP_FINISHED] = 1
        lane = sims.ag_play[g, AGP_LANE]
        if lane >= 0 and sims.i64[s, SM_AG_NEXT_PLAY] < sims.i64[s, SM_AG_PLAY_END]:
            # its lane starts the next play waiting (one queue for all lanes)
            nxt = sims.i64[s, SM_AG_NEXT_PLAY]
            sims.i64[s, SM_AG_NEXT_PLAY] = nxt + 1
            sims.ag_play[nxt, AGP_LANE] = lane
            _start_play(rq, sims, s, nxt, t_ms)


# behind the agentic feature gate (kernels.features)
dispatched_gated = gate("agentic", dispatched)
ended_gated = gate("agentic", ended)
