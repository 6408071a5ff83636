"""The disaggregated (prefill -> decode) handoff inside the replay's event loop
(``kernels.loop.event_loop``), in the SourceFirst order (vLLM and TRT-LLM) and the
DestinationFirst order (SGLang, ``SM_DEST_FIRST``: ReserveDestination at arrival,
SubmitPrefill once the reservation holds, StartTransfer once the source is held;
the rest as below). What an SGLang rank does on each command is
``sglang.handoff``'s.

The entry points take ``sg``: None in the vLLM / TRT-LLM event loop, a constant in
the SGLang one (both pools of a simulation run one backend). Numba removes an
``if sg is None`` branch by the argument's type before typing it, so the vLLM set
compiles none of the SGLang code and the SGLang set none of vLLM's leases (a branch
on the worker's policy code compiled both into each, 28 CPU-seconds more).

A logical request is served by two request rows (see ``schema.layout``): its prefill row
runs on a prefill worker with one output token; when that pass ends the source KV
is held (SourceHeld) and the handoff continues with the logical row on a decode
worker: ReserveDestination -> DestinationReserved -> StartTransfer ->
TransferCompleted -> ActivateDestination -> ReleaseSource. The decode worker then
generates every output token of the request.

Order inside one instant (spec/replay.md §1.4, verified bit-exactly on the goldens):

1. pass completions due now, prefill workers before decode workers, by worker id;
   each re-queues the actions deferred on that worker, then applies its outputs,
   then its lifecycle events (SourceHeld -> queue ReserveDestination; a decode
   worker's completion-time reservation retry -> queue StartTransfer);
2. transfers completing now queue ActivateDestination;
3. arrivals queue SubmitPrefill, in arrival order;
4. the FIFO action queue is drained, including the actions it appends;
5. idle prefill workers, then idle decode workers, start passes in id order; a
   zero-duration pass completes inside the drive (step 1's rules);
repeated until nothing changes. Activate (decode worker) and Release (prefill
worker) wait while their worker has a pass in flight; ReserveDestination is
accepted at once and reserved at once only when the decode worker is idle.
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.disagg.transfer_timing import kv_transfer_ms_kernel, transfer_is_modeled_kernel
from aisim_fast.kernels.dp.attention_dp import reset_wave_if_drained_gated
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import release_ref, table_find
from aisim_fast.kernels.kv.lease import publish_block, release_lease
from aisim_fast.kernels.loop.arrivals import enter_scheduler, logical_terminal, queue_action
from aisim_fast.kernels.loop.rank_queues import run_remove_at, wait_at, wait_push_back, wait_remove_at, wake
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.routing.kv_router import pass_end_gated, request_ended_gated, route_gated
from aisim_fast.kernels.routing.placement import place
from aisim_fast.kernels.schema.layout import (ACT_ACTIVATE, ACT_NONE, ACT_RELEASE, ACT_RESERVE,
                                              ACT_START_TRANSFER, ACT_SUBMIT_PREFILL, CFG_BLOCK_SIZE,
                                              CFG_PREFIX_CACHING, CFG_TRANSFER_MODE, CFGF_HANDOFF_LATENCY_MS,
                                              CFGF_KV_BANDWIDTH_GBS, CFGF_KV_BYTES_PER_TOKEN, CMD_APPLIED,
                                              CMD_NOOP, DF_NEXT_ON_DESTINATION_RESERVED,
                                              DF_NEXT_ON_SOURCE_HELD, HE_COMPLETED, HE_DESTINATION_ACCEPTED,
                                              HE_DESTINATION_ACTIVATED, HE_DESTINATION_RESERVED,
                                              HE_SOURCE_HELD, HE_SOURCE_RELEASED, HL_EVENT, HL_REQUEST,
                                              HL_TIME_MS, HL_VALUE_A, HL_VALUE_B,
                                              NEXT_ON_DESTINATION_ACTIVATED, NEXT_ON_DESTINATION_RESERVED,
                                              NEXT_ON_SOURCE_HELD, NEXT_ON_TRANSFER_COMPLETED, NO_BLOCK,
                                              PLACE_KV_ROUTER, ROUTE_DECODE, ROUTE_PREFILL, RQ_ACTION,
                                              RQ_ALLOCATED, RQ_ATTEMPT_GEN, RQ_FAST_LIMIT, RQ_LEASE_OFF,
                                              RQ_LINK, RQ_NUM_COMPUTED, RQ_NUM_HASHED, RQ_ORDINAL, RQ_PEER,
                                              RQ_PROMPT_LEN, RQ_REPORTED, RQ_RESERVED_FRESH, RQ_RESERVED_HITS,
                                              RQ_SRC_ROW, RQ_STATUS, RQ_TERM_NEXT, RQ_TERMINAL, RQ_UUID,
                                              RQ_WORKER, RQ_XFER_SEQ, RQF_ARRIVAL_MS, RQF_DEST_ACTIVATED_MS,
                                              RQF_DEST_RESERVED_MS, RQF_SOURCE_HELD_MS,
                                              RQF_SOURCE_RELEASED_MS, RQF_TERMINAL_MS, RQF_TRANSFER_DONE_MS,
                                              RS_ACTIVATED, RS_DONE, RS_HELD, RS_PENDING_DEST, RS_PREEMPTED,
                                              RS_RESERVED, RS_RUNNING, RS_WAITING, SM_ACTQ_HEAD, SM_ACTQ_LEN, SM_AG_SEQ,
                                              SM_AGENTIC,
                                              SM_DECODE_CURSOR, SM_DEST_FIRST, SM_HLOG_LEN, SM_OPEN_HANDOFFS,
                                              SM_PLACEMENT, SM_PREFILL_LEN, SM_Q_LEN, SM_Q_OFF, SM_RR_CURSOR,
                                              SM_W_LEN, SM_W_OFF, SM_XFER_LEN, SM_XFER_SEQ, TERM_CANCELED,
                                              TERM_COMPLETED, TERM_FAILED, TERM_REJECTED,
                                              TRANSFER_DESTINATION_MISSING, WK_BUSY, WK_CAP_GEN,
                                              WK_DEFER_HEAD, WK_DEFER_TAIL, WK_ORDINAL_NEXT, WK_PEND_HEAD,
                                              WK_PEND_LEN, WK_PEND_TAIL, WK_RESERVED_LEN, WK_RUN_LEN,
                                              WK_RUN_OFF, WK_TERM_HEAD, WK_TERM_TAIL, WK_WAIT_CAP,
                                              WK_WAIT_HEAD, WK_WAIT_LEN, WK_WAIT_OFF)
from aisim_fast.kernels.sglang import core as sglang_core, handoff as sglang_handoff
from aisim_fast.kernels.vllm import capacity as capacity_policy


@njit(cache=True, _nrt=False)
def transfer_delay_ms(tokens, kv_bytes_per_token, bandwidth_gb_s, fallback_ms):
    """KV transfer delay (``disagg.transfer_timing``, no state bytes); the topology's fallback
    where the model is incomplete (``transfer_is_modeled``)."""
    if not transfer_is_modeled_kernel(kv_bytes_per_token, bandwidth_gb_s):
        return fallback_ms
    return kv_transfer_ms_kernel(np.float64(tokens), kv_bytes_per_token, 0.0, bandwidth_gb_s)


# ---------------------------------------------------------------------------------
# the FIFO action queue (a ring per simulation) and per-worker deferred actions
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _pop_action(sims, s):
    q = sims.actq[sims.i64[s, SM_Q_OFF] + sims.i64[s, SM_ACTQ_HEAD]]
    sims.i64[s, SM_ACTQ_HEAD] = (sims.i64[s, SM_ACTQ_HEAD] + 1) % sims.i64[s, SM_Q_LEN]
    sims.i64[s, SM_ACTQ_LEN] -= 1
    return q


@kernel(cache=True, _nrt=False, inline="always")
def _defer(rq, wk, w, q):
    """Keep q's action until worker w's pass in flight completes."""
    rq.i64[q, RQ_LINK] = -1
    tail = wk.i64[w, WK_DEFER_TAIL]
    if tail < 0:
        wk.i64[w, WK_DEFER_HEAD] = q
    else:
        rq.i64[tail, RQ_LINK] = q
    wk.i64[w, WK_DEFER_TAIL] = q


@kernel(cache=True, _nrt=False, inline="always")
def _requeue_deferred(rq, wk, sims, s, w):
    q = wk.i64[w, WK_DEFER_HEAD]
    while q >= 0:
        nxt = rq.i64[q, RQ_LINK]
        rq.i64[q, RQ_LINK] = -1
        queue_action(rq, sims, s, q, rq.i64[q, RQ_ACTION])
        q = nxt
    wk.i64[w, WK_DEFER_HEAD] = -1
    wk.i64[w, WK_DEFER_TAIL] = -1


@kernel(cache=True, _nrt=False, inline="always")
def _journal(sims, s, event, q, now_ms, value_a, value_b):
    """Append a lifecycle event to the opt-in handoff journal (sized by the driver)."""
    row = sims.i64[s, SM_HLOG_LEN]
    if row < sims.hlog.shape[1]:
        sims.i64[s, SM_HLOG_LEN] = row + 1
        sims.hlog[s, row, HL_EVENT] = event
        sims.hlog[s, row, HL_REQUEST] = q - sims.i64[s, SM_Q_OFF]
        sims.hlog[s, row, HL_TIME_MS] = now_ms
        sims.hlog[s, row, HL_VALUE_A] = value_a
        sims.hlog[s, row, HL_VALUE_B] = value_b


# ---------------------------------------------------------------------------------
# transfers in flight: a binary heap by (completion time, start order)
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _xfer_before(rq, a, b):
    ta = rq.f64[a, RQF_TRANSFER_DONE_MS]
    tb = rq.f64[b, RQF_TRANSFER_DONE_MS]
    if ta != tb:
        return ta < tb
    return rq.i64[a, RQ_XFER_SEQ] < rq.i64[b, RQ_XFER_SEQ]


@kernel(cache=True, _nrt=False)
def _xfer_push(rq, sims, s, q):
    base = sims.i64[s, SM_Q_OFF]
    h = sims.xfer_heap
    i = sims.i64[s, SM_XFER_LEN]
    sims.i64[s, SM_XFER_LEN] = i + 1
    while i > 0:
        parent = (i - 1) // 2
        if _xfer_before(rq, q, h[base + parent]):
            h[base + i] = h[base + parent]
            i = parent
        else:
            break
    h[base + i] = q


@kernel(cache=True, _nrt=False)
def _xfer_pop(rq, sims, s):
    base = sims.i64[s, SM_Q_OFF]
    h = sims.xfer_heap
    top = h[base]
    n = sims.i64[s, SM_XFER_LEN] - 1
    sims.i64[s, SM_XFER_LEN] = n
    if n == 0:
        return top
    last = h[base + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _xfer_before(rq, h[base + c + 1], h[base + c]):
            c += 1
        if _xfer_before(rq, h[base + c], last):
            h[base + i] = h[base + c]
            i = c
        else:
            break
    h[base + i] = last
    return top


# ---------------------------------------------------------------------------------
# decode rank: pending destinations, reservation, activation
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def _load_prompt_hashes(rq, wl, q):
    """Prompt block hashes of row q at its own worker's block size."""
    row = rq.i64[q, RQ_SRC_ROW]
    p0 = wl.phash_indptr[row]
    n_blocks = wl.phash_indptr[row + 1] - p0
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(n_blocks):
        rq.seq_hash[k0 + i] = wl.phash[p0 + i]
    rq.i64[q, RQ_NUM_HASHED] = n_blocks


@kernel(cache=True, _nrt=False)
def retry_destination(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens, sg):
    """Try to reserve the head of worker w's pending-destination FIFO (at most one
    per call, at most one attempt per capacity generation). Returns the reserved
    row, -1 when nothing was reserved, -2 when the block arena is exhausted."""
    q = wk.i64[w, WK_PEND_HEAD]
    if q < 0 or rq.i64[q, RQ_ATTEMPT_GEN] == wk.i64[w, WK_CAP_GEN]:
        return -1
    if sg is not None:
        res = sglang_handoff.reserve_destination(cfg, p, rq, wl, w, q, scratch_tokens)
        if res < 0:
            return -2
        if res == 0:
            rq.i64[q, RQ_ATTEMPT_GEN] = wk.i64[w, WK_CAP_GEN]
            return -1
    else:
        n_blocks = ceil_div(rq.i64[q, RQ_PROMPT_LEN], cfg.i64[w, CFG_BLOCK_SIZE])
        k0 = rq.i64[q, RQ_LEASE_OFF]
        res, n_hit = capacity_policy.reserve_destination(cfg, p, rq, wk, w, q, n_blocks, hits, fresh)
        if res < 0:
            return -2
        if res == 0:
            rq.i64[q, RQ_ATTEMPT_GEN] = wk.i64[w, WK_CAP_GEN]
            return -1
        for i in range(n_hit):
            rq.lease[k0 + i] = hits[i]
        for i in range(n_blocks - n_hit):
            rq.lease[k0 + n_hit + i] = fresh[i]
        rq.i64[q, RQ_RESERVED_HITS] = n_hit
        rq.i64[q, RQ_RESERVED_FRESH] = n_blocks - n_hit
    rq.i64[q, RQ_STATUS] = RS_RESERVED
    wk.i64[w, WK_RESERVED_LEN] += 1
    wk.i64[w, WK_PEND_HEAD] = rq.i64[q, RQ_LINK]
    if rq.i64[q, RQ_LINK] < 0:
        wk.i64[w, WK_PEND_TAIL] = -1
    rq.i64[q, RQ_LINK] = -1
    wk.i64[w, WK_PEND_LEN] -= 1
    wake(wk, w)  # admissions it blocked may run now
    return q


@kernel(cache=True, _nrt=False)
def _insert_by_ordinal(rq, wk, w, q):
    """Put q in w's waiting queue before the first request with a later ordinal."""
    n = wk.i64[w, WK_WAIT_LEN]
    i = n
    while i > 0 and rq.i64[wait_at(wk, w, i - 1), RQ_ORDINAL] > rq.i64[q, RQ_ORDINAL]:
        i -= 1
    if not wait_push_back(wk, w, q):
        return
    cap = wk.i64[w, WK_WAIT_CAP]
    off = wk.i64[w, WK_WAIT_OFF]
    head = wk.i64[w, WK_WAIT_HEAD]
    for j in range(n, i, -1):
        wk.wait_q[off + (head + j) % cap] = wk.wait_q[off + (head + j - 1) % cap]
    wk.wait_q[off + (head + i) % cap] = q


@kernel(cache=True, _nrt=False)
def _activate(cfg, p, rq, wk, w, q):
    """Commit q's reservation: its complete fresh prompt blocks become cached copies
    (visible from now on), the partial tail stays private; q waits, materialized,
    at its arrival position. Returns (blocks that became visible, fresh prompt blocks
    whose hash was already visible before)."""
    k0 = rq.i64[q, RQ_LEASE_OFF]
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    visible_before = 0
    published = 0
    if cfg.i64[w, CFG_PREFIX_CACHING] != 0:
        continues = False  # consecutive blocks made visible are one Stored event
        for i in range(rq.i64[q, RQ_RESERVED_HITS], rq.i64[q, RQ_NUM_HASHED]):
            if table_find(p, w, rq.seq_hash[k0 + i]) != NO_BLOCK:
                visible_before += 1
            continues = publish_block(p, rq, w, q, i, rq.lease[k0 + i], continues)
            if continues:
                published += 1
    rq.i64[q, RQ_ALLOCATED] = prompt
    rq.i64[q, RQ_NUM_COMPUTED] = prompt
    rq.i64[q, RQ_FAST_LIMIT] = 0
    rq.i64[q, RQ_STATUS] = RS_ACTIVATED
    wk.i64[w, WK_RESERVED_LEN] -= 1
    _insert_by_ordinal(rq, wk, w, q)
    wake(wk, w)
    return published, visible_before


@kernel(cache=True, _nrt=False)
def accept_destination(rq, wl, wk, wd, q, sg):
    """ReserveDestination accepted on decode worker wd: q (its prompt hashes loaded,
    vLLM / TRT-LLM) joins the back of the pending-destination FIFO with the worker's
    next arrival ordinal. The caller then retries the head when wd is idle."""
    if sg is None:  # SGLang keys its pages itself
        _load_prompt_hashes(rq, wl, q)
    rq.i64[q, RQ_STATUS] = RS_PENDING_DEST
    rq.i64[q, RQ_ORDINAL] = wk.i64[wd, WK_ORDINAL_NEXT]
    wk.i64[wd, WK_ORDINAL_NEXT] += 1
    rq.i64[q, RQ_ATTEMPT_GEN] = -1
    rq.i64[q, RQ_LINK] = -1
    tail = wk.i64[wd, WK_PEND_TAIL]
    if tail < 0:
        wk.i64[wd, WK_PEND_HEAD] = q
    else:
        rq.i64[tail, RQ_LINK] = q
    wk.i64[wd, WK_PEND_TAIL] = q
    wk.i64[wd, WK_PEND_LEN] += 1
    if wk.i64[wd, WK_PEND_LEN] == 1:
        # a pending destination changes the waiting rule (only activated requests
        # are admitted while one is pending): a worker stalled behind a preempted
        # head may now admit them, as the reference's retry of it at every drive does
        wake(wk, wd)


@kernel(cache=True, _nrt=False)
def activate_destination(cfg, p, rq, wk, wd, q, sg):
    """ActivateDestination of reserved q on decode worker wd (vLLM / TRT-LLM:
    ``_activate``; SGLang: ``sglang.handoff``, nothing enters the tree before
    promotion). Returns (blocks that became visible, fresh prompt blocks whose hash
    was visible before)."""
    if sg is not None:
        sglang_handoff.activate_destination(cfg, p, rq, wk, wd, q)
        wake(wk, wd)
        return np.int64(0), np.int64(0)
    return _activate(cfg, p, rq, wk, wd, q)


# ---------------------------------------------------------------------------------
# cancellation (engine side, spec engine.md 10.1-10.2 and 11)
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def _drop_queued(cfg, p, rq, wk, w, q):
    """Take q out of worker w's running list or waiting queue and release its lease
    (tail first, as a finish does). Returns False when q is in neither."""
    off = wk.i64[w, WK_RUN_OFF]
    for j in range(wk.i64[w, WK_RUN_LEN]):
        if wk.run_q[off + j] == q:
            run_remove_at(wk, w, j)
            release_lease(cfg, p, rq, w, q)
            return True
    for j in range(wk.i64[w, WK_WAIT_LEN]):
        if wait_at(wk, w, j) == q:
            wait_remove_at(wk, w, j)
            release_lease(cfg, p, rq, w, q)
            return True
    return False


@kernel(cache=True, _nrt=False)
def release_held_source(cfg, p, rq, wl, wk, wp, qp, path, scratch_tokens, sg):
    """ReleaseSource of source row qp held on prefill worker wp: its KV released as a
    finish releases it (vLLM: the lease into the LRU, tail first; SGLang: pages into
    the tree, lock released); a capacity generation starts and the worker may admit
    its waiting head."""
    if sg is not None:
        sglang_handoff.release_source(cfg, p, rq, wl, wk, wp, qp, path, scratch_tokens)
    else:
        release_lease(cfg, p, rq, wp, qp)
        wk.i64[wp, WK_CAP_GEN] += 1
    rq.i64[qp, RQ_STATUS] = RS_DONE
    wake(wk, wp)


@njit(cache=True, _nrt=False)
def cancel_source(cfg, p, rq, wk, q):
    """CancelSource for handoff q (its logical row): a held source releases its KV
    like a finish; a source still queued or running is dropped. Applied frees
    capacity on the prefill worker (generation bumped); CMD_NOOP when the source is
    gone already. The caller defers it while the prefill worker has a pass in flight."""
    qp = rq.i64[q, RQ_PEER]
    wp = rq.i64[qp, RQ_WORKER]
    status = rq.i64[qp, RQ_STATUS]
    if status == RS_HELD:
        release_lease(cfg, p, rq, wp, qp)
    elif status == RS_WAITING or status == RS_RUNNING or status == RS_PREEMPTED:
        if not _drop_queued(cfg, p, rq, wk, wp, qp):
            return CMD_NOOP
    else:
        return CMD_NOOP
    rq.i64[qp, RQ_STATUS] = RS_DONE
    wk.i64[wp, WK_CAP_GEN] += 1
    wake(wk, wp)
    return CMD_APPLIED


@kernel(cache=True, _nrt=False)
def _sglang_drop_destination(p, rq, wk, wd, q, status):
    """SGLang's side of CancelDestination past the pending FIFO: a reserved or
    activated destination gives its pages back, a queued or running one is dropped
    as CancelRequest drops it. False when it is none of these."""
    if status == RS_RESERVED or status == RS_ACTIVATED:
        return sglang_handoff.cancel_destination(p, rq, wk, wd, q)
    if status == RS_RUNNING or status == RS_PREEMPTED or status == RS_WAITING:
        return sglang_core.drop_queued(p.radix, rq, wk, wd, q) >= 0
    return False


@njit(cache=True, _nrt=False)
def cancel_destination(cfg, p, rq, wk, q, sg):
    """CancelDestination for handoff q: a pending destination leaves the FIFO, a
    reserved one gives its reservation back (vLLM / TRT-LLM: prefix references and
    fresh blocks, in reverse; SGLang: ``sglang.handoff.cancel_destination``), an
    activated (queued or running) one is dropped like a canceled request. Applied
    bumps the capacity generation; the caller then retries the decode worker's
    pending head. CMD_NOOP when the destination is gone already."""
    wd = rq.i64[q, RQ_WORKER]
    status = rq.i64[q, RQ_STATUS]
    if sg is not None:
        if status != RS_PENDING_DEST and not _sglang_drop_destination(p, rq, wk, wd, q, status):
            return CMD_NOOP
    if status == RS_PENDING_DEST:
        prev = -1
        cur = wk.i64[wd, WK_PEND_HEAD]
        while cur != q:
            prev = cur
            cur = rq.i64[cur, RQ_LINK]
        nxt = rq.i64[q, RQ_LINK]
        if prev < 0:
            wk.i64[wd, WK_PEND_HEAD] = nxt
        else:
            rq.i64[prev, RQ_LINK] = nxt
        if wk.i64[wd, WK_PEND_TAIL] == q:
            wk.i64[wd, WK_PEND_TAIL] = prev
        rq.i64[q, RQ_LINK] = -1
        wk.i64[wd, WK_PEND_LEN] -= 1
    elif sg is not None:
        pass  # dropped above
    elif status == RS_RESERVED:
        k0 = rq.i64[q, RQ_LEASE_OFF]
        n_blocks = rq.i64[q, RQ_RESERVED_HITS] + rq.i64[q, RQ_RESERVED_FRESH]
        for i in range(n_blocks - 1, -1, -1):
            release_ref(p, wd, rq.lease[k0 + i])
            rq.lease[k0 + i] = NO_BLOCK
        capacity_policy.on_destination_dropped(cfg, p, rq, wk, wd, q, n_blocks)
    elif status == RS_ACTIVATED or status == RS_RUNNING or status == RS_PREEMPTED:
        if status == RS_ACTIVATED:  # before its lease goes: the tail counts from it
            capacity_policy.on_destination_dropped(cfg, p, rq, wk, wd, q, np.int64(0))
        if not _drop_queued(cfg, p, rq, wk, wd, q):
            return CMD_NOOP
    else:
        return CMD_NOOP
    if status == RS_RESERVED:
        wk.i64[wd, WK_RESERVED_LEN] -= 1
    rq.i64[q, RQ_STATUS] = RS_DONE
    rq.i64[q, RQ_TERMINAL] = TERM_CANCELED
    wk.i64[wd, WK_CAP_GEN] += 1
    wake(wk, wd)
    return CMD_APPLIED


# ---------------------------------------------------------------------------------
# actions
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def _retry_and_report(cfg, p, rq, wl, wk, sims, s, w, now_ms, hits, fresh, scratch_tokens, sg):
    """Retry worker w's pending head; a reservation is a DestinationReserved fact, on
    which the coordinator starts the transfer (SourceFirst) or submits the prefill
    (DestinationFirst). Returns (reserved, arena exhausted)."""
    r = retry_destination(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens, sg)
    if r == -2:
        return False, True
    if r < 0:
        return False, False
    rq.f64[r, RQF_DEST_RESERVED_MS] = now_ms
    _journal(sims, s, HE_DESTINATION_RESERVED, r, now_ms, rq.i64[r, RQ_RESERVED_FRESH], 0)
    queue_action(rq, sims, s, r, DF_NEXT_ON_DESTINATION_RESERVED if sims.i64[s, SM_DEST_FIRST]
                 else NEXT_ON_DESTINATION_RESERVED)
    return True, False


@kernel(cache=True, _nrt=False)
def _place_in_pool(cfg, p, rq, wl, wk, sims, s, q, now_ms, w0, n, cursor, pool, sg):
    """The worker of the pool ``[w0, w0 + n)`` for request row q: the kv_router's
    choice (vLLM / TRT-LLM pools; ``sg is None`` keeps the router out of the SGLang
    kernels' compile) or the simulation's placement policy."""
    if sg is None:
        if sims.i64[s, SM_PLACEMENT] == PLACE_KV_ROUTER:
            return route_gated(cfg.features, cfg, p, rq, wl, wk, sims, s, q, now_ms, w0, n, pool)
    return place(sims, s, w0, n, cursor)


@kernel(cache=True, _nrt=False)
def _fail_request(features, rq, sims, s, q, status, now_ms):
    """A handoff that cannot continue ends its logical request."""
    rq.i64[q, RQ_STATUS] = RS_DONE
    rq.i64[q, RQ_TERMINAL] = status
    rq.f64[q, RQF_TERMINAL_MS] = now_ms
    logical_terminal(features, rq, sims, s, q)


@kernel(cache=True, _nrt=False)
def _run_action(cfg, p, rq, wl, wk, sims, s, q, now_ms, hits, fresh, scratch_tokens, sg):
    """Execute the queued action of handoff q. Returns False when the block arena is
    exhausted."""
    kind = rq.i64[q, RQ_ACTION]
    rq.i64[q, RQ_ACTION] = ACT_NONE
    dest_first = sims.i64[s, SM_DEST_FIRST] != 0
    w0 = sims.i64[s, SM_W_OFF]
    n_prefill = sims.i64[s, SM_PREFILL_LEN]
    qp = rq.i64[q, RQ_PEER]
    if kind == ACT_SUBMIT_PREFILL:
        wp = _place_in_pool(cfg, p, rq, wl, wk, sims, s, qp, now_ms, w0, n_prefill, SM_RR_CURSOR,
                            ROUTE_PREFILL, sg)
        rq.i64[qp, RQ_WORKER] = wp
        rq.i64[qp, RQ_STATUS] = RS_WAITING
        rq.i64[qp, RQ_UUID] = rq.i64[q, RQ_UUID]
        rq.f64[qp, RQF_ARRIVAL_MS] = rq.f64[q, RQF_ARRIVAL_MS]
        if sg is None:  # SGLang keys its pages itself
            _load_prompt_hashes(rq, wl, qp)
        enter_scheduler(cfg, wk, rq, sims, s, wp, qp, now_ms)  # (its pool's tokenization first)
        if not dest_first:
            sims.i64[s, SM_OPEN_HANDOFFS] += 1
    elif kind == ACT_RESERVE:
        n_decode = sims.i64[s, SM_W_LEN] - n_prefill
        wd = _place_in_pool(cfg, p, rq, wl, wk, sims, s, q, now_ms, w0 + n_prefill, n_decode,
                            SM_DECODE_CURSOR, ROUTE_DECODE, sg)
        rq.i64[q, RQ_WORKER] = wd
        if sg is not None:  # DestinationFirst: the handoff opens with its reservation
            sims.i64[s, SM_OPEN_HANDOFFS] += 1
            if sglang_handoff.destination_impossible(cfg, rq, wd, q):
                # refused before any source exists: the handoff ends here
                rq.i64[q, RQ_WORKER] = -1
                sims.i64[s, SM_OPEN_HANDOFFS] -= 1
                _fail_request(cfg.features, rq, sims, s, q, TERM_FAILED, now_ms)
                return True
        elif capacity_policy.destination_impossible(cfg, p, rq, wd, q):
            # the destination can never hold the prompt: the handoff unwinds. The
            # placement stands (the cursor moved) but no decode worker was assigned,
            # and the source goes as a cancel, not a release: the reference records
            # neither
            if sg is None and sims.i64[s, SM_PLACEMENT] == PLACE_KV_ROUTER:
                request_ended_gated(cfg.features, rq, wk, wd, q, False)  # routed, never active there
            rq.i64[q, RQ_WORKER] = -1
            _fail_request(cfg.features, rq, sims, s, q, TERM_FAILED, now_ms)
            queue_action(rq, sims, s, q, ACT_RELEASE)
            return True
        accept_destination(rq, wl, wk, wd, q, sg)
        _journal(sims, s, HE_DESTINATION_ACCEPTED, q, now_ms, 0, 0)
        if wk.i64[wd, WK_BUSY] == 0:
            _, full = _retry_and_report(cfg, p, rq, wl, wk, sims, s, wd, now_ms, hits, fresh,
                                        scratch_tokens, sg)
            return not full
    elif kind == ACT_START_TRANSFER:
        wp = rq.i64[qp, RQ_WORKER]
        if cfg.i64[wp, CFG_TRANSFER_MODE] == TRANSFER_DESTINATION_MISSING:
            tokens = rq.i64[q, RQ_RESERVED_FRESH] * cfg.i64[rq.i64[q, RQ_WORKER], CFG_BLOCK_SIZE]
        else:
            tokens = rq.i64[q, RQ_PROMPT_LEN]
        delay_ms = transfer_delay_ms(tokens, cfg.f64[wp, CFGF_KV_BYTES_PER_TOKEN],
                                     cfg.f64[wp, CFGF_KV_BANDWIDTH_GBS],
                                     cfg.f64[wp, CFGF_HANDOFF_LATENCY_MS])
        if delay_ms > 0.0:
            rq.f64[q, RQF_TRANSFER_DONE_MS] = now_ms + delay_ms
            rq.i64[q, RQ_XFER_SEQ] = sims.i64[s, SM_XFER_SEQ]  # ties pop in start order
            sims.i64[s, SM_XFER_SEQ] += 1
            _xfer_push(rq, sims, s, q)
        else:
            rq.f64[q, RQF_TRANSFER_DONE_MS] = now_ms
            queue_action(rq, sims, s, q, NEXT_ON_TRANSFER_COMPLETED)
    elif kind == ACT_ACTIVATE:
        wd = rq.i64[q, RQ_WORKER]
        if wk.i64[wd, WK_BUSY] != 0:
            rq.i64[q, RQ_ACTION] = kind
            _defer(rq, wk, wd, q)
            return True
        published, visible_before = activate_destination(cfg, p, rq, wk, wd, q, sg)
        rq.f64[q, RQF_DEST_ACTIVATED_MS] = now_ms
        _journal(sims, s, HE_DESTINATION_ACTIVATED, q, now_ms, published, visible_before)
        queue_action(rq, sims, s, q, NEXT_ON_DESTINATION_ACTIVATED)
        _, full = _retry_and_report(cfg, p, rq, wl, wk, sims, s, wd, now_ms, hits, fresh,
                                    scratch_tokens, sg)
        return not full
    elif kind == ACT_RELEASE:
        wp = rq.i64[qp, RQ_WORKER]
        if wk.i64[wp, WK_BUSY] != 0:
            rq.i64[q, RQ_ACTION] = kind
            _defer(rq, wk, wp, q)
            return True
        release_held_source(cfg, p, rq, wl, wk, wp, qp, hits, scratch_tokens, sg)
        if rq.i64[q, RQ_WORKER] >= 0:  # else a failed destination's source, canceled
            rq.f64[q, RQF_SOURCE_RELEASED_MS] = now_ms
        _journal(sims, s, HE_SOURCE_RELEASED, q, now_ms, 0, 0)
        if rq.i64[q, RQ_REPORTED] == 1 and rq.i64[q, RQ_TERMINAL] == TERM_COMPLETED:
            _journal(sims, s, HE_COMPLETED, q, now_ms, 0, 0)
        sims.i64[s, SM_OPEN_HANDOFFS] -= 1
    return True


@kernel(cache=True, _nrt=False)
def complete_disagg_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, hits, fresh, scratch_tokens, sg):
    """Pass end of worker w. Returns (reserved a destination, arena exhausted)."""
    wk.i64[w, WK_BUSY] = 0
    _requeue_deferred(rq, wk, sims, s, w)
    if sims.i64[s, SM_AGENTIC] != 0:
        sims.i64[s, SM_AG_SEQ] += 1  # its terminals are one feedback batch (kernels.agentic)
    prefill = w < sims.i64[s, SM_W_OFF] + sims.i64[s, SM_PREFILL_LEN]
    routed = False
    if sg is None:  # the router's view (kernels.routing.kv_router) learns of this pass end
        routed = sims.i64[s, SM_PLACEMENT] == PLACE_KV_ROUTER
        if routed:
            pass_end_gated(cfg.features, rq, wk, w)
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        nxt = rq.i64[q, RQ_TERM_NEXT]
        if routed:
            request_ended_gated(cfg.features, rq, wk, w, q, False)
        if prefill:
            ql = rq.i64[q, RQ_PEER]
            if rq.i64[q, RQ_STATUS] == RS_HELD:
                rq.f64[ql, RQF_SOURCE_HELD_MS] = now_ms
                _journal(sims, s, HE_SOURCE_HELD, ql, now_ms, 0, 0)
                queue_action(rq, sims, s, ql, DF_NEXT_ON_SOURCE_HELD if sims.i64[s, SM_DEST_FIRST]
                             else NEXT_ON_SOURCE_HELD)
            else:  # rejected by the prefill rank: the handoff fails with it
                sims.i64[s, SM_OPEN_HANDOFFS] -= 1
                _fail_request(cfg.features, rq, sims, s, ql, TERM_REJECTED, now_ms)
        else:
            logical_terminal(cfg.features, rq, sims, s, q)
            rq.i64[q, RQ_REPORTED] = 1
            if not np.isnan(rq.f64[q, RQF_SOURCE_RELEASED_MS]) and rq.i64[q, RQ_TERMINAL] == TERM_COMPLETED:
                _journal(sims, s, HE_COMPLETED, q, now_ms, 0, 0)
        q = nxt
    wk.i64[w, WK_TERM_HEAD] = -1
    wk.i64[w, WK_TERM_TAIL] = -1
    if prefill:
        return False, False
    return _retry_and_report(cfg, p, rq, wl, wk, sims, s, w, now_ms, hits, fresh, scratch_tokens, sg)


@kernel(cache=True, _nrt=False)
def complete_disagg_ranks(cfg, p, rq, wl, wk, sims, s, w, dp, now_ms, hits, fresh, scratch_tokens, sg):
    """Pass end of worker w, or of every rank of the attention-DP group it leads
    (``dp`` ranks, idle ones included; a drained group restarts its wave count).
    Returns (a decode rank reserved a destination, arena exhausted)."""
    reserved_any = False
    for r in range(w, w + dp):
        reserved, full = complete_disagg_pass(cfg, p, rq, wl, wk, sims, s, r, now_ms, hits, fresh,
                                              scratch_tokens, sg)
        if full:
            return reserved_any, True
        reserved_any = reserved_any or reserved
    if dp > 1:
        reset_wave_if_drained_gated(cfg.features, wk, w, dp)
    return reserved_any, False


@kernel(cache=True, _nrt=False)
def drain_transfers(rq, sims, s, now_ms):
    """Transfers completing at ``now_ms`` queue their ActivateDestination. Returns
    whether any did."""
    any_done = False
    while sims.i64[s, SM_XFER_LEN] > 0 and \
            rq.f64[sims.xfer_heap[sims.i64[s, SM_Q_OFF]], RQF_TRANSFER_DONE_MS] <= now_ms:
        queue_action(rq, sims, s, _xfer_pop(rq, sims, s), NEXT_ON_TRANSFER_COMPLETED)
        any_done = True
    return any_done


@kernel(cache=True, _nrt=False)
def drain_actions(cfg, p, rq, wl, wk, sims, s, now_ms, hits, fresh, scratch_tokens, sg):
    """Run the FIFO action queue empty, actions it appends included. Returns
    (whether any ran, arena exhausted)."""
    ran = False
    if sims.i64[s, SM_AGENTIC] != 0 and sims.i64[s, SM_ACTQ_LEN] > 0:
        # the handoffs this drain fails report as one feedback batch (kernels.agentic)
        sims.i64[s, SM_AG_SEQ] += 1
    while sims.i64[s, SM_ACTQ_LEN] > 0:
        ran = True
        if not _run_action(cfg, p, rq, wl, wk, sims, s, _pop_action(sims, s), now_ms, hits, fresh,
                           scratch_tokens, sg):
            return ran, True
    return ran, False


@kernel(cache=True, _nrt=False, inline="always")
def next_transfer_ms(rq, sims, s):
    """Completion time of the next transfer in flight (inf when none)."""
    if sims.i64[s, SM_XFER_LEN] == 0:
        return np.inf
    return rq.f64[sims.xfer_heap[sims.i64[s, SM_Q_OFF]], RQF_TRANSFER_DONE_MS]
