"""The admission side of the replay and the aggregated pass completion, shared by
both topologies' event loop (``kernels.loop.event_loop``).

Arrivals follow the reference's ``replay/agg.rs`` drain, verified in
spec/replay.md §1.4 and engine.md §14.3: open loop, release time <= now; closed
loop, while fewer than ``concurrency`` sessions are active. Placement
(``kernels.routing.placement``) decides at arrival (aggregated) or when the queued
SubmitPrefill runs (disaggregated). A later
turn of a session is released ``delay_ms`` after the previous turn's terminal.
"""

import numpy as np

from aisim_fast.kernels.agentic.release import dispatched_gated, ended_gated
from aisim_fast.kernels.dp.attention_dp import place_rank_gated, reset_wave_if_drained_gated
from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.rank_queues import wait_push_back, wake
from aisim_fast.kernels.loop.release_heap import heap_pop, heap_push, released_before
from aisim_fast.kernels.loop.tokenization import tokenize_gated
from aisim_fast.kernels.routing.kv_router import pass_end_gated, request_ended_gated, route_gated
from aisim_fast.kernels.routing.placement import place
from aisim_fast.kernels.sglang.frontend import submit_gated
from aisim_fast.kernels.schema.layout import (CFG_DP_RANK, CFG_DP_SIZE, CFG_TOK_SERVERS, DF_NEXT_ON_ARRIVAL, NEXT_ON_ARRIVAL,
                                              PLACE_KV_ROUTER, ROUTE_AGGREGATED, RQ_ACTION, RQ_LEASE_OFF,
                                              RQ_NEXT_TURN, RQ_NUM_HASHED, RQ_SESSION, RQ_SRC_ROW, RQ_STATUS,
                                              RQ_TERM_NEXT, RQ_TERMINAL, RQ_TURN, RQ_UUID, RQ_WORKER,
                                              RQF_ARRIVAL_MS, RQF_DELAY_MS, RQF_READY_MS, RQF_START_MS,
                                              RQF_TERMINAL_MS, RS_FRONTEND, RS_TOKENIZING, RS_WAITING, SM_ACTIVE_SESSIONS, SM_AG_SEQ, SM_AGENTIC,
                                              SM_ACTQ_HEAD,
                                              SM_ACTQ_LEN, SM_CONCURRENCY, SM_DEST_FIRST, SM_HEAP_LEN,
                                              SM_NUM_ARRIVED, SM_NUM_NOT_SENT, SM_NUM_STARTS, SM_NUM_TERMINAL,
                                              SM_PLACEMENT, SM_PREFILL_LEN, SM_Q_LEN, SM_Q_OFF, SM_RR_CURSOR,
                                              SM_START_PTR, SM_UUID_NEXT, SM_W_LEN, SM_W_OFF, TERM_CANCELED,
                                              TERM_FAILED, TERM_NOT_SENT, WK_BUSY, WK_FE_STAGES, WK_TERM_HEAD,
                                              WK_TERM_TAIL)


@kernel(cache=True, _nrt=False, inline="always")
def queue_action(rq, sims, s, q, kind):
    """Append handoff q's next action to the simulation's FIFO action queue."""
    rq.i64[q, RQ_ACTION] = kind
    n = sims.i64[s, SM_Q_LEN]
    sims.actq[sims.i64[s, SM_Q_OFF] + (sims.i64[s, SM_ACTQ_HEAD] + sims.i64[s, SM_ACTQ_LEN]) % n] = q
    sims.i64[s, SM_ACTQ_LEN] += 1


@kernel(cache=True, _nrt=False)
def _arrive(cfg, p, rq, wl, wk, sims, s, q, arrival_ms):
    """A request enters the system. Aggregated: placement (kernels.routing.placement), prompt
    block hashes, waiting queue. Disaggregated: the handoff starts (SubmitPrefill
    queued; ReserveDestination in the DestinationFirst order)."""
    rq.f64[q, RQF_ARRIVAL_MS] = arrival_ms
    rq.i64[q, RQ_STATUS] = RS_WAITING
    rq.i64[q, RQ_UUID] = sims.i64[s, SM_UUID_NEXT]
    sims.i64[s, SM_UUID_NEXT] += 1
    sims.i64[s, SM_NUM_ARRIVED] += 1
    if sims.i64[s, SM_AGENTIC] != 0:
        dispatched_gated(cfg.features, rq, sims, s, q, arrival_ms)  # its dispatch edges fire
    if sims.i64[s, SM_PREFILL_LEN] > 0:
        queue_action(rq, sims, s, q,
                     DF_NEXT_ON_ARRIVAL if sims.i64[s, SM_DEST_FIRST] else NEXT_ON_ARRIVAL)
        return
    if sims.i64[s, SM_PLACEMENT] == PLACE_KV_ROUTER:
        w = route_gated(cfg.features, cfg, p, rq, wl, wk, sims, s, q, arrival_ms, sims.i64[s, SM_W_OFF],
                  sims.i64[s, SM_W_LEN], ROUTE_AGGREGATED)
    elif cfg.i64[sims.i64[s, SM_W_OFF], CFG_DP_SIZE] > 1:
        w = place_rank_gated(cfg.features, cfg, wk, sims, s, sims.i64[s, SM_W_OFF], sims.i64[s, SM_W_LEN])
    else:
        w = place(sims, s, sims.i64[s, SM_W_OFF], sims.i64[s, SM_W_LEN], SM_RR_CURSOR)
    rq.i64[q, RQ_WORKER] = w
    row = rq.i64[q, RQ_SRC_ROW]
    p0 = wl.phash_indptr[row]
    n_prompt_blocks = wl.phash_indptr[row + 1] - p0
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(n_prompt_blocks):
        rq.seq_hash[k0 + i] = wl.phash[p0 + i]
    rq.i64[q, RQ_NUM_HASHED] = n_prompt_blocks
    enter_scheduler(cfg, wk, rq, sims, s, w, q, arrival_ms)


@kernel(cache=True, _nrt=False)
def enter_scheduler(cfg, wk, rq, sims, s, w, q, now_ms):
    """Request q, placed on worker w (aggregated, or the prefill row on a prefill
    worker; with attention DP, one of its ranks), reaches w: through the tokenization
    pool of w's logical worker first when it has one (one pool for all its ranks, as
    measured on the reference)
    (kernels.loop.tokenization: it waits in the release heap until its prompt is
    tokenized, then ``admit_arrivals`` queues it), else straight into w's waiting queue."""
    if wk.i64[w, WK_FE_STAGES] > 0:
        # SGLang's frontend stages first (kernels.sglang.frontend): they deliver it
        rq.i64[q, RQ_STATUS] = RS_FRONTEND
        submit_gated(cfg.features, rq, wk, w, q, now_ms)
        return
    pool = w - cfg.i64[w, CFG_DP_RANK]  # a logical worker's ranks share its pool
    if cfg.i64[pool, CFG_TOK_SERVERS] > 0:
        rq.f64[q, RQF_READY_MS] = tokenize_gated(cfg.features, cfg, wk, rq, pool, q, now_ms)
        rq.i64[q, RQ_STATUS] = RS_TOKENIZING
        heap_push(sims, rq, s, q)
        return
    wait_push_back(wk, w, q)
    wake(wk, w)


@kernel(cache=True, _nrt=False, inline="always")
def admit_arrivals(cfg, p, rq, wl, wk, sims, s, now_ms):
    """Release every request due at ``now_ms``; returns how many arrived."""
    closed = sims.i64[s, SM_CONCURRENCY] > 0
    base = sims.i64[s, SM_Q_OFF]
    n = 0
    while True:
        q_start = -1
        t_start = 0.0
        if sims.i64[s, SM_START_PTR] < sims.i64[s, SM_NUM_STARTS]:
            q0 = sims.start_order[base + sims.i64[s, SM_START_PTR]]
            if closed:
                if sims.i64[s, SM_ACTIVE_SESSIONS] < sims.i64[s, SM_CONCURRENCY]:
                    q_start = q0
                    t_start = now_ms
            elif rq.f64[q0, RQF_START_MS] <= now_ms:
                q_start = q0
                t_start = rq.f64[q0, RQF_START_MS]
        q_turn = -1
        if sims.i64[s, SM_HEAP_LEN] > 0:
            qh = sims.heap_q[base]
            if rq.f64[qh, RQF_READY_MS] <= now_ms:
                q_turn = qh
        if q_start < 0 and q_turn < 0:
            return n
        take_start = q_start >= 0 and (q_turn < 0 or released_before(
            t_start, rq.i64[q_start, RQ_SESSION], rq.i64[q_start, RQ_TURN],
            rq.f64[q_turn, RQF_READY_MS], rq.i64[q_turn, RQ_SESSION], rq.i64[q_turn, RQ_TURN]))
        if take_start:
            sims.i64[s, SM_START_PTR] += 1
            if rq.i64[q_start, RQ_TERMINAL] == TERM_NOT_SENT:
                continue  # an agentic root its play's failure skipped before its start
            sims.i64[s, SM_ACTIVE_SESSIONS] += 1
            _arrive(cfg, p, rq, wl, wk, sims, s, q_start, t_start)
        else:
            heap_pop(sims, rq, s)
            if rq.i64[q_turn, RQ_TERMINAL] == TERM_NOT_SENT:
                continue  # an agentic request its play's failure skipped while it waited
            if rq.i64[q_turn, RQ_STATUS] == RS_TOKENIZING:
                # tokenized: it reaches the scheduler of the worker it was placed on
                rq.i64[q_turn, RQ_STATUS] = RS_WAITING
                wait_push_back(wk, rq.i64[q_turn, RQ_WORKER], q_turn)
                wake(wk, rq.i64[q_turn, RQ_WORKER])
            else:
                _arrive(cfg, p, rq, wl, wk, sims, s, q_turn, rq.f64[q_turn, RQF_READY_MS])
        n += 1


@kernel(cache=True, _nrt=False, inline="always")
def logical_terminal(features, rq, sims, s, q):
    """Request q reached its terminal: free its session slot or release its next turn.
    A failed or canceled turn ends its session, as the reference's workload driver
    does (a rejected one does not): its later turns are never sent. An agentic
    request fires its dependents instead (kernels.agentic.release)."""
    sims.i64[s, SM_NUM_TERMINAL] += 1
    if sims.i64[s, SM_AGENTIC] != 0:
        ended_gated(features, rq, sims, s, q)
        return
    nxt = rq.i64[q, RQ_NEXT_TURN]
    if rq.i64[q, RQ_TERMINAL] == TERM_FAILED or rq.i64[q, RQ_TERMINAL] == TERM_CANCELED:
        while nxt >= 0:
            rq.i64[nxt, RQ_TERMINAL] = TERM_NOT_SENT
            sims.i64[s, SM_NUM_TERMINAL] += 1
            sims.i64[s, SM_NUM_NOT_SENT] += 1
            nxt = rq.i64[nxt, RQ_NEXT_TURN]
    if nxt >= 0:
        rq.f64[nxt, RQF_READY_MS] = rq.f64[q, RQF_TERMINAL_MS] + rq.f64[nxt, RQF_DELAY_MS]
        heap_push(sims, rq, s, nxt)
    else:
        sims.i64[s, SM_ACTIVE_SESSIONS] -= 1


@kernel(cache=True, _nrt=False, inline="always")
def complete_pass(cfg, rq, wk, sims, s, w):
    """Pass end of worker w: its terminals free session slots and release next turns."""
    wk.i64[w, WK_BUSY] = 0
    routed = sims.i64[s, SM_PLACEMENT] == PLACE_KV_ROUTER
    if routed:
        pass_end_gated(cfg.features, rq, wk, w)
    if sims.i64[s, SM_AGENTIC] != 0:
        sims.i64[s, SM_AG_SEQ] += 1  # its terminals are one feedback batch (kernels.agentic)
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        if routed:
            request_ended_gated(cfg.features, rq, wk, w, q, True)
        logical_terminal(cfg.features, rq, sims, s, q)
        q = rq.i64[q, RQ_TERM_NEXT]
    wk.i64[w, WK_TERM_HEAD] = -1
    wk.i64[w, WK_TERM_TAIL] = -1


@kernel(cache=True, _nrt=False)
def complete_group(cfg, rq, wk, sims, s, lead, dp):
    """The group's pass ends: every rank completes in rank order; a group left without
    requests starts its wave count again."""
    for w in range(lead, lead + dp):
        complete_pass(cfg, rq, wk, sims, s, w)
    reset_wave_if_drained_gated(cfg.features, wk, lead, dp)


# a group pass's end, behind the attention_dp feature gate (kernels.features)
complete_group_gated = gate("attention_dp", complete_group)


@kernel(cache=True, _nrt=False, inline="always")
def arrivals_due(rq, sims, s, now_ms):
    """Cheap check before the admission step (which binds the whole state)."""
    base = sims.i64[s, SM_Q_OFF]
    if sims.i64[s, SM_START_PTR] < sims.i64[s, SM_NUM_STARTS]:
        if sims.i64[s, SM_CONCURRENCY] > 0:
            if sims.i64[s, SM_ACTIVE_SESSIONS] < sims.i64[s, SM_CONCURRENCY]:
                return True
        elif rq.f64[sims.start_order[base + sims.i64[s, SM_START_PTR]], RQF_START_MS] <= now_ms:
            return True
    return sims.i64[s, SM_HEAP_LEN] > 0 and rq.f64[sims.heap_q[base], RQF_READY_MS] <= now_ms


@kernel(cache=True, _nrt=False, inline="always")
def next_release_ms(rq, sims, s):
    """Release time of the next request (inf when none is scheduled)."""
    t_next = np.inf
    base = sims.i64[s, SM_Q_OFF]
    if sims.i64[s, SM_CONCURRENCY] == 0 and sims.i64[s, SM_START_PTR] < sims.i64[s, SM_NUM_STARTS]:
        t_next = rq.f64[sims.start_order[base + sims.i64[s, SM_START_PTR]], RQF_START_MS]
    if sims.i64[s, SM_HEAP_LEN] > 0:
        t_next = min(t_next, rq.f64[sims.heap_q[base], RQF_READY_MS])
    return t_next
