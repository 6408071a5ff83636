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

from .layout import (
    RS_WAITING, SIM_ARENA_FULL, SIM_DEAD_END, SIM_DONE, SIM_NEED_FLUSH, SIM_RUNNING,
)
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
    base = sims.q_off[s]
    i = sims.heap_len[s]
    sims.heap_len[s] = i + 1
    h = sims.heap_q
    while i > 0:
        parent = (i - 1) // 2
        pq = h[base + parent]
        if _before(sims.ready_ms[q], rq.session[q], rq.turn[q],
                   sims.ready_ms[pq], rq.session[pq], rq.turn[pq]):
            h[base + i] = pq
            i = parent
        else:
            break
    h[base + i] = q


@njit(cache=True)
def _heap_pop(sims, rq, s):
    base = sims.q_off[s]
    h = sims.heap_q
    top = h[base]
    n = sims.heap_len[s] - 1
    sims.heap_len[s] = n
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
            if _before(sims.ready_ms[qd], rq.session[qd], rq.turn[qd],
                       sims.ready_ms[qc], rq.session[qc], rq.turn[qc]):
                c += 1
                qc = qd
        if _before(sims.ready_ms[qc], rq.session[qc], rq.turn[qc],
                   sims.ready_ms[last], rq.session[last], rq.turn[last]):
            h[base + i] = qc
            i = c
        else:
            break
    h[base + i] = last
    return top


@njit(cache=True)
def _arrive(cfg, rq, wl, wk, sims, s, q, arrival_ms):
    """A request enters the system: round-robin placement, prompt block hashes."""
    w = sims.w_off[s] + sims.rr_cursor[s] % sims.w_len[s]
    sims.rr_cursor[s] += 1
    rq.arrival_ms[q] = arrival_ms
    rq.worker[q] = w
    rq.status[q] = RS_WAITING
    rq.uuid_lo[q] = np.uint64(sims.uuid_next[s])
    sims.uuid_next[s] += 1
    sims.num_arrived[s] += 1
    row = rq.src_row[q]
    p0 = wl.phash_indptr[row]
    n_prompt_blocks = wl.phash_indptr[row + 1] - p0
    k0 = rq.lease_off[q]
    for i in range(n_prompt_blocks):
        rq.seq_hash[k0 + i] = wl.phash[p0 + i]
    rq.num_hashed[q] = n_prompt_blocks
    wait_push_back(wk, w, q)
    wk.stalled[w] = False


@njit(cache=True)
def _admit_arrivals(cfg, rq, wl, wk, sims, s, now_ms):
    """Release every request due at ``now_ms``; returns how many arrived."""
    closed = sims.concurrency[s] > 0
    base = sims.q_off[s]
    n = 0
    while True:
        q_start = -1
        t_start = 0.0
        if sims.start_ptr[s] < sims.num_starts[s]:
            q0 = sims.start_order[base + sims.start_ptr[s]]
            if closed:
                if sims.active_sessions[s] < sims.concurrency[s]:
                    q_start = q0
                    t_start = now_ms
            elif sims.start_ms[q0] <= now_ms:
                q_start = q0
                t_start = sims.start_ms[q0]
        q_turn = -1
        if sims.heap_len[s] > 0:
            qh = sims.heap_q[base]
            if sims.ready_ms[qh] <= now_ms:
                q_turn = qh
        if q_start < 0 and q_turn < 0:
            return n
        take_start = q_start >= 0 and (q_turn < 0 or _before(
            t_start, rq.session[q_start], rq.turn[q_start],
            sims.ready_ms[q_turn], rq.session[q_turn], rq.turn[q_turn]))
        if take_start:
            sims.start_ptr[s] += 1
            sims.active_sessions[s] += 1
            _arrive(cfg, rq, wl, wk, sims, s, q_start, t_start)
        else:
            _heap_pop(sims, rq, s)
            _arrive(cfg, rq, wl, wk, sims, s, q_turn, sims.ready_ms[q_turn])
        n += 1


@njit(cache=True)
def _complete_pass(rq, wk, sims, s, w):
    """Pass end of worker w: its terminals free session slots and release next turns."""
    wk.busy[w] = False
    q = wk.term_head[w]
    while q >= 0:
        sims.num_terminal[s] += 1
        nxt = rq.next_turn[q]
        if nxt >= 0:
            sims.ready_ms[nxt] = rq.terminal_ms[q] + rq.delay_ms[nxt]
            _heap_push(sims, rq, s, nxt)
        else:
            sims.active_sessions[s] -= 1
        q = rq.term_next[q]
    wk.term_head[w] = -1


@njit(cache=True)
def _has_work(wk, w):
    return wk.run_len[w] > 0 or wk.wait_len[w] > 0


@njit(cache=True)
def run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens):
    """Advance simulation s until it is done or needs the driver."""
    w0 = sims.w_off[s]
    w1 = w0 + sims.w_len[s]
    log_rows = sims.pass_log.shape[1]
    sims.status[s] = SIM_RUNNING
    now_ms = sims.now_ms[s]
    while True:
        changed = True
        while changed:
            changed = False
            for w in range(w0, w1):
                if wk.busy[w] and wk.pass_end_ms[w] == now_ms:
                    _complete_pass(rq, wk, sims, s, w)
                    changed = True
            if _admit_arrivals(cfg, rq, wl, wk, sims, s, now_ms) > 0:
                changed = True
            for w in range(w0, w1):
                if wk.busy[w] or wk.stalled[w] or not _has_work(wk, w):
                    continue
                if log_rows > 0 and sims.pass_log_len[s] >= log_rows:
                    sims.now_ms[s] = now_ms
                    sims.status[s] = SIM_NEED_FLUSH
                    return
                end_ms, had_effect, arena_full = run_pass(
                    cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)
                if arena_full:
                    sims.status[s] = SIM_ARENA_FULL
                    return
                if had_effect:
                    wk.busy[w] = True
                    wk.pass_end_ms[w] = end_ms
                    changed = True
                else:
                    # nothing can change for this worker until new work reaches it
                    wk.stalled[w] = True
        if sims.num_terminal[s] == sims.q_len[s]:
            sims.now_ms[s] = now_ms
            sims.status[s] = SIM_DONE
            return
        t_next = np.inf
        for w in range(w0, w1):
            if wk.busy[w] and wk.pass_end_ms[w] < t_next:
                t_next = wk.pass_end_ms[w]
        base = sims.q_off[s]
        if sims.concurrency[s] == 0 and sims.start_ptr[s] < sims.num_starts[s]:
            t_next = min(t_next, sims.start_ms[sims.start_order[base + sims.start_ptr[s]]])
        if sims.heap_len[s] > 0:
            t_next = min(t_next, sims.ready_ms[sims.heap_q[base]])
        if t_next == np.inf:
            sims.now_ms[s] = now_ms
            sims.status[s] = SIM_DEAD_END
            return
        now_ms = t_next


@njit(cache=True, parallel=True)
def replay_batch(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size):
    """Advance every simulation in ``sim_ids`` (those still running or paused for a
    flush) until done, dead end, or its pass log is full. Scratch buffers are per
    simulation, so threads share nothing."""
    for i in prange(sim_ids.shape[0]):
        s = sim_ids[i]
        if sims.status[s] != SIM_RUNNING and sims.status[s] != SIM_NEED_FLUSH:
            continue
        acc = np.zeros(8, np.int64)
        hits = np.empty(max_lease_blocks, np.int32)
        fresh = np.empty(max_lease_blocks, np.int32)
        scratch_tokens = np.empty(max_block_size, np.uint32)
        run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
