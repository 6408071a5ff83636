"""The aggregated replay event loop, run to completion (or to the next point that
needs the driver) inside one kernel call for a whole batch of simulations.

Per simulation it follows the reference's ``replay/agg.rs`` drain, verified in
spec/replay.md §1.4 and engine.md §14.3: at one instant, pass completions (worker
order), then arrivals (open loop: release time <= now; closed loop: while fewer
than ``concurrency`` sessions are active), then idle workers with work start a
pass in worker order; a pass that ends at ``now`` completes inside the same
instant; repeat until nothing changes, then jump to the next pass end or
release time. Placement is round robin over arrivals. A later turn of a session
is released ``delay_ms`` after the previous turn's terminal.

Simulations are independent, so the batch runs under ``prange``.
"""

import numpy as np
from numba import njit, prange

from .layout import *  # noqa: F401,F403 - field and status constants
from .vllm_pass import run_pass, wait_push_back


@njit(cache=True, inline="always")
def _before(t_a, s_a, u_a, t_b, s_b, u_b):
    """Release order: time, then session index, then turn index."""
    if t_a != t_b:
        return t_a < t_b
    if s_a != s_b:
        return s_a < s_b
    return u_a < u_b


@njit(cache=True)
def _heap_push(sims, rq, s, q):
    base = sims.i64[SM_Q_OFF, s]
    i = sims.i64[SM_HEAP_LEN, s]
    sims.i64[SM_HEAP_LEN, s] = i + 1
    h = sims.heap_q
    while i > 0:
        parent = (i - 1) // 2
        pq = h[base + parent]
        if _before(rq.f64[RQF_READY_MS, q], rq.i64[RQ_SESSION, q], rq.i64[RQ_TURN, q],
                   rq.f64[RQF_READY_MS, pq], rq.i64[RQ_SESSION, pq], rq.i64[RQ_TURN, pq]):
            h[base + i] = pq
            i = parent
        else:
            break
    h[base + i] = q


@njit(cache=True)
def _heap_pop(sims, rq, s):
    base = sims.i64[SM_Q_OFF, s]
    h = sims.heap_q
    top = h[base]
    n = sims.i64[SM_HEAP_LEN, s] - 1
    sims.i64[SM_HEAP_LEN, s] = n
    if n == 0:
        return top
    last = h[base + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        qc = h[base + c]
        if c + 1 < n:
            qd = h[base + c + 1]
            if _before(rq.f64[RQF_READY_MS, qd], rq.i64[RQ_SESSION, qd], rq.i64[RQ_TURN, qd],
                       rq.f64[RQF_READY_MS, qc], rq.i64[RQ_SESSION, qc], rq.i64[RQ_TURN, qc]):
                c += 1
                qc = qd
        if _before(rq.f64[RQF_READY_MS, qc], rq.i64[RQ_SESSION, qc], rq.i64[RQ_TURN, qc],
                   rq.f64[RQF_READY_MS, last], rq.i64[RQ_SESSION, last], rq.i64[RQ_TURN, last]):
            h[base + i] = qc
            i = c
        else:
            break
    h[base + i] = last
    return top


@njit(cache=True)
def _arrive(cfg, rq, wl, wk, sims, s, q, arrival_ms):
    """A request enters the system: round-robin placement, prompt block hashes."""
    w = sims.i64[SM_W_OFF, s] + sims.i64[SM_RR_CURSOR, s] % sims.i64[SM_W_LEN, s]
    sims.i64[SM_RR_CURSOR, s] += 1
    rq.f64[RQF_ARRIVAL_MS, q] = arrival_ms
    rq.i64[RQ_WORKER, q] = w
    rq.i64[RQ_STATUS, q] = RS_WAITING
    rq.i64[RQ_UUID, q] = sims.i64[SM_UUID_NEXT, s]
    sims.i64[SM_UUID_NEXT, s] += 1
    sims.i64[SM_NUM_ARRIVED, s] += 1
    row = rq.i64[RQ_SRC_ROW, q]
    p0 = wl.phash_indptr[row]
    n_prompt_blocks = wl.phash_indptr[row + 1] - p0
    k0 = rq.i64[RQ_LEASE_OFF, q]
    for i in range(n_prompt_blocks):
        rq.seq_hash[k0 + i] = wl.phash[p0 + i]
    rq.i64[RQ_NUM_HASHED, q] = n_prompt_blocks
    wait_push_back(wk, w, q)
    wk.i64[WK_STALLED, w] = 0


@njit(cache=True, inline="always")
def _admit_arrivals(cfg, rq, wl, wk, sims, s, now_ms):
    """Release every request due at ``now_ms``; returns how many arrived."""
    closed = sims.i64[SM_CONCURRENCY, s] > 0
    base = sims.i64[SM_Q_OFF, s]
    n = 0
    while True:
        q_start = -1
        t_start = 0.0
        if sims.i64[SM_START_PTR, s] < sims.i64[SM_NUM_STARTS, s]:
            q0 = sims.start_order[base + sims.i64[SM_START_PTR, s]]
            if closed:
                if sims.i64[SM_ACTIVE_SESSIONS, s] < sims.i64[SM_CONCURRENCY, s]:
                    q_start = q0
                    t_start = now_ms
            elif rq.f64[RQF_START_MS, q0] <= now_ms:
                q_start = q0
                t_start = rq.f64[RQF_START_MS, q0]
        q_turn = -1
        if sims.i64[SM_HEAP_LEN, s] > 0:
            qh = sims.heap_q[base]
            if rq.f64[RQF_READY_MS, qh] <= now_ms:
                q_turn = qh
        if q_start < 0 and q_turn < 0:
            return n
        take_start = q_start >= 0 and (q_turn < 0 or _before(
            t_start, rq.i64[RQ_SESSION, q_start], rq.i64[RQ_TURN, q_start],
            rq.f64[RQF_READY_MS, q_turn], rq.i64[RQ_SESSION, q_turn], rq.i64[RQ_TURN, q_turn]))
        if take_start:
            sims.i64[SM_START_PTR, s] += 1
            sims.i64[SM_ACTIVE_SESSIONS, s] += 1
            _arrive(cfg, rq, wl, wk, sims, s, q_start, t_start)
        else:
            _heap_pop(sims, rq, s)
            _arrive(cfg, rq, wl, wk, sims, s, q_turn, rq.f64[RQF_READY_MS, q_turn])
        n += 1


@njit(cache=True, inline="always")
def _complete_pass(rq, wk, sims, s, w):
    """Pass end of worker w: its terminals free session slots and release next turns."""
    wk.i64[WK_BUSY, w] = 0
    q = wk.i64[WK_TERM_HEAD, w]
    while q >= 0:
        sims.i64[SM_NUM_TERMINAL, s] += 1
        nxt = rq.i64[RQ_NEXT_TURN, q]
        if nxt >= 0:
            rq.f64[RQF_READY_MS, nxt] = rq.f64[RQF_TERMINAL_MS, q] + rq.f64[RQF_DELAY_MS, nxt]
            _heap_push(sims, rq, s, nxt)
        else:
            sims.i64[SM_ACTIVE_SESSIONS, s] -= 1
        q = rq.i64[RQ_TERM_NEXT, q]
    wk.i64[WK_TERM_HEAD, w] = -1


@njit(cache=True, inline="always")
def _has_work(wk, w):
    return wk.i64[WK_RUN_LEN, w] > 0 or wk.i64[WK_WAIT_LEN, w] > 0


@njit(cache=True)
def run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens):
    """Advance simulation s until it is done or needs the driver."""
    w0 = sims.i64[SM_W_OFF, s]
    w1 = w0 + sims.i64[SM_W_LEN, s]
    log_rows = sims.pass_log.shape[1]
    sims.i64[SM_STATUS, s] = SIM_RUNNING
    now_ms = sims.now_ms[s]
    while True:
        changed = True
        while changed:
            changed = False
            for w in range(w0, w1):
                if wk.i64[WK_BUSY, w] and wk.pass_end_ms[w] == now_ms:
                    _complete_pass(rq, wk, sims, s, w)
                    changed = True
            if _admit_arrivals(cfg, rq, wl, wk, sims, s, now_ms) > 0:
                changed = True
            for w in range(w0, w1):
                if wk.i64[WK_BUSY, w] != 0 or wk.i64[WK_STALLED, w] != 0 or not _has_work(wk, w):
                    continue
                if log_rows > 0 and sims.i64[SM_PASS_LOG_LEN, s] >= log_rows:
                    sims.now_ms[s] = now_ms
                    sims.i64[SM_STATUS, s] = SIM_NEED_FLUSH
                    return
                end_ms, had_effect, arena_full = run_pass(
                    cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)
                if arena_full:
                    sims.i64[SM_STATUS, s] = SIM_ARENA_FULL
                    return
                if had_effect:
                    wk.i64[WK_BUSY, w] = 1
                    wk.pass_end_ms[w] = end_ms
                    changed = True
                else:
                    # nothing can change for this worker until new work reaches it
                    wk.i64[WK_STALLED, w] = 1
        if sims.i64[SM_NUM_TERMINAL, s] == sims.i64[SM_Q_LEN, s]:
            sims.now_ms[s] = now_ms
            sims.i64[SM_STATUS, s] = SIM_DONE
            return
        t_next = np.inf
        for w in range(w0, w1):
            if wk.i64[WK_BUSY, w] and wk.pass_end_ms[w] < t_next:
                t_next = wk.pass_end_ms[w]
        base = sims.i64[SM_Q_OFF, s]
        if sims.i64[SM_CONCURRENCY, s] == 0 and sims.i64[SM_START_PTR, s] < sims.i64[SM_NUM_STARTS, s]:
            t_next = min(t_next, rq.f64[RQF_START_MS, sims.start_order[base + sims.i64[SM_START_PTR, s]]])
        if sims.i64[SM_HEAP_LEN, s] > 0:
            t_next = min(t_next, rq.f64[RQF_READY_MS, sims.heap_q[base]])
        if t_next == np.inf:
            sims.now_ms[s] = now_ms
            sims.i64[SM_STATUS, s] = SIM_DEAD_END
            return
        now_ms = t_next


@njit(cache=True, parallel=True)
def replay_batch(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size):
    """Advance every simulation in ``sim_ids`` (those still running or paused for a
    flush) until done, dead end, or its pass log is full. Scratch buffers are per
    simulation, so threads share nothing."""
    for i in prange(sim_ids.shape[0]):
        s = sim_ids[i]
        if sims.i64[SM_STATUS, s] != SIM_RUNNING and sims.i64[SM_STATUS, s] != SIM_NEED_FLUSH:
            continue
        acc = np.zeros(8, np.int64)
        hits = np.empty(max_lease_blocks, np.int32)
        fresh = np.empty(max_lease_blocks, np.int32)
        scratch_tokens = np.empty(max_block_size, np.uint32)
        run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
