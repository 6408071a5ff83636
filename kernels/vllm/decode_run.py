"""Runs of decode passes, computed without walking the running list per pass.

Most passes of a replay are *decode passes*: every running request is past its
prompt, computes one token, emits it and is not finished by it, and the waiting
queue cannot admit anything. Such a pass changes no queue or list; most requests
only move their counters by one, and the pass's duration depends on the batch
size and the batch's KV tokens, which grow by the batch size each pass.
``vllm.decode_run`` runs K of them back to back: a request's fields are brought up to
date once at the end of the run, and only the requests that leave the schedule
fast path in a pass (completing a block, which is hashed and published, or
growing the lease by a fresh block) go through the full schedule step, in running
order, in that pass. The result is exactly the float operations, pass log rows,
token-gap folds, pool operations and request fields that ``vllm.core.run_pass``
produces one pass at a time (the property tests hold it to that pass by pass).

A run ends before the first pass that finishes a request or whose fresh blocks
the pool cannot give without preempting, and before any other event of the
simulation: a pass may only start at the previous pass's end ``e`` when nothing
else happens at ``e`` - no release due by then, and no other worker's pass
ending by then. So the event loop runs them for a lone worker (a round-robin worker
unit, a one-worker simulation), and for workers that share nothing between releases
(``SM_INDEPENDENT``: a routed open-loop single-turn run without logs, whose workers
fold their token gaps into rows of their own), whose runs end only at a release.
Beside other workers a run would hold a pass or two, and its two walks of the
running list then cost more than the plain passes.
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on, event_set_clock, kv_events_visible_at, num_free
from aisim_fast.kernels.loop.arrivals import arrivals_due, next_release_ms
from aisim_fast.kernels.loop.busy_heap import next_pass_end_ms
from aisim_fast.kernels.loop.pass_log import append_pass_row
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.schema.layout import (ACC_BUDGET, CFG_BLOCK_SIZE, CFG_MAX_MODEL_LEN,
                                              CFG_MAX_NUM_BATCHED_TOKENS, CFG_MAX_NUM_SEQS,
                                              CFG_NUM_GPU_BLOCKS, CFG_ROLE, EVH_LEN, PW_LRU_LEN, PW_PASS_NUM,
                                              ROLE_AGGREGATED, RQ_ALLOCATED, RQ_FAST_LIMIT, RQ_GENERATED,
                                              RQ_MAX_OUTPUT, RQ_NO_TOKEN_STATS, RQ_NUM_COMPUTED,
                                              RQ_PROMPT_LEN, RQF_LAST_TOKEN_MS, RQF_SECOND_TOKEN_MS,
                                              SM_INDEPENDENT, SM_W_LEN, SM_W_OFF, WK_BUSY, WK_PASS_STAMP,
                                              WK_RUN_LEN, WK_RUN_OFF, WK_STALLED, WK_STAT_ROW, WK_WAIT_LEN)
from aisim_fast.kernels.stats.sketch import fold_gap_run
from aisim_fast.kernels.timing.pass_timing import decode_ns, ns_to_ms
from aisim_fast.kernels.vllm.core import ALLOC_ARENA_FULL, schedule_request_ahead
from aisim_fast.kernels.vllm.decode_step import CLASS_DECODE, stamp_scheduled


@kernel(cache=True, _nrt=False, inline="always")
def quiet_until_ms(rq, wk, sims, s, w, now_ms):
    """Earliest time at which something other than worker w's own passes happens in
    its simulation: the next release, or another worker's pass end (unless the
    workers are independent, ``SM_INDEPENDENT``). ``-inf`` when
    something else happens at this instant: a closed-loop slot freed by a terminal
    of the drive (its arrival comes in the drain's next round), or another worker
    about to be driven."""
    if arrivals_due(rq, sims, s, now_ms):
        return -np.inf
    if sims.i64[s, SM_INDEPENDENT]:
        # the other workers' passes change nothing here, and their token gaps go to
        # rows of their own: only a release can
        return next_release_ms(rq, sims, s)
    w0 = sims.i64[s, SM_W_OFF]
    w1 = w0 + sims.i64[s, SM_W_LEN]
    # a worker that can start a pass now is one the drive has marked ready
    for v in range(w0, w1):
        if wk.ready[v] and v != w and wk.i64[v, WK_BUSY] == 0 and wk.i64[v, WK_STALLED] == 0 \
                and wk.i64[v, WK_RUN_LEN] + wk.i64[v, WK_WAIT_LEN] > 0:
            return -np.inf
    # w is being driven, so it is not busy: the heap's top is another worker's pass end
    return min(next_release_ms(rq, sims, s), next_pass_end_ms(wk, sims, s))


@kernel(cache=True, _nrt=False)
def decode_run(cfg, p, rq, wl, wk, sims, s, w, now_ms, quiet_until, max_passes, acc, hits, fresh,
               scratch_tokens):
    """Run worker w's decode passes from ``now_ms``: the first starts now, each next
    one at the previous end while that end is before ``quiet_until``, at most
    ``max_passes``. Returns ``(end_ms of the last pass, passes run, arena_full)``;
    0 passes (nothing changed) when the next pass is not a decode pass. The last
    pass is left in flight, the earlier ones completed (they have no terminals)."""
    n = wk.i64[w, WK_RUN_LEN]
    if n == 0 or max_passes <= 0 or cfg.i64[w, CFG_ROLE] != ROLE_AGGREGATED \
            or n > cfg.i64[w, CFG_MAX_NUM_BATCHED_TOKENS]:
        return now_ms, 0, False
    if wk.i64[w, WK_WAIT_LEN] > 0 and n < cfg.i64[w, CFG_MAX_NUM_SEQS]:
        return now_ms, 0, False  # the waiting queue may admit
    rq_i = rq.i64
    rq_f = rq.f64
    off = wk.i64[w, WK_RUN_OFF]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    capacity = cfg.i64[w, CFG_NUM_GPU_BLOCKS]
    # During the run every request's fields stay as they were at its start (the
    # base): pass k computes token NUM_COMPUTED + k and emits token GENERATED + k.
    # k_last: passes before the first one that finishes a request; next_event: the
    # first pass in which some request leaves the fast path (completes a block or
    # grows its lease), i.e. computes past its RQ_FAST_LIMIT.
    k_last = max_passes
    next_event = max_passes + 1
    kv_tokens = np.int64(0)
    n_gaps = n  # tokens per pass whose gaps enter the token statistics
    for j in range(n):
        q = wk.run_q[off + j]
        n_gaps -= rq_i[q, RQ_NO_TOKEN_STATS]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        generated = rq_i[q, RQ_GENERATED]
        computed = rq_i[q, RQ_NUM_COMPUTED]
        # decoding: everything but the last emitted token computed, and that token
        # emitted at the end of the previous pass (so every gap of a pass is equal)
        if generated < 1 or computed != prompt + generated - 1 or rq_f[q, RQF_LAST_TOKEN_MS] != now_ms:
            return now_ms, 0, False
        remaining = rq_i[q, RQ_MAX_OUTPUT] - generated
        if limit >= 0:
            remaining = min(remaining, limit - prompt - generated)
        k_last = min(k_last, remaining - 1)
        if k_last <= 0:
            return now_ms, 0, False
        next_event = min(next_event, rq_i[q, RQ_FAST_LIMIT] - computed + 1)
        kv_tokens += prompt + generated

    total_kv_tokens = capacity * bs
    log_on = sims.pass_log.shape[1] > 0
    start_ms = now_ms
    end_ms = now_ms
    first_end_ms = now_ms
    k = np.int64(0)  # typed: a literal start compiles its callees twice
    while k < k_last and (k == 0 or end_ms < quiet_until):
        pass_k = k + 1
        start_ms = end_ms
        dc_ns = decode_ns(cfg, w, n, kv_tokens, total_kv_tokens)
        if dc_ns <= 0:
            break  # a zero-length pass completes inside the drive: leave it to run_pass
        first_event = np.int64(-1)  # the step's first KV row, when it schedules requests
        if pass_k == next_event:
            # requests leaving the fast path in this pass take the full schedule
            # step, in running order. A lease that must grow takes one fresh block
            # each; if the pool cannot give them all without preempting, the pass
            # is not a decode-only pass: stop before it.
            obtainable = num_free(p, w, capacity) + p.w64[w, PW_LRU_LEN]
            if obtainable < n:  # else every request could grow: no need to count
                growing = 0
                for j in range(n):
                    q = wk.run_q[off + j]
                    computed = rq_i[q, RQ_NUM_COMPUTED] + pass_k
                    if computed > rq_i[q, RQ_FAST_LIMIT] \
                            and computed > ceil_div(rq_i[q, RQ_ALLOCATED], bs) * bs:
                        growing += 1
                if growing > obtainable:
                    break
            stamp = (wk.i64[w, WK_PASS_STAMP] + pass_k) * 65536 + (w % 65536) + 1
            # the blocks this step publishes or evicts are the pass's (kv_router: seen
            # from its end)
            p.w64[w, PW_PASS_NUM] = wk.i64[w, WK_PASS_STAMP] + pass_k
            next_event = k_last + 1
            if event_log_on(p):
                first_event = p.event_log[s, 0, EVH_LEN]
            for j in range(n):
                q = wk.run_q[off + j]
                base_computed = rq_i[q, RQ_NUM_COMPUTED]
                if base_computed + pass_k > rq_i[q, RQ_FAST_LIMIT]:
                    if event_log_on(p):
                        event_set_clock(p, s, start_ms)  # KV events of this step: at its pass start
                    acc[ACC_BUDGET] = n  # the step's pass counters (scratch here: this loop keeps its own)
                    if schedule_request_ahead(cfg, p, rq, wl, wk, w, q, k, start_ms, stamp, acc, hits,
                                              fresh, scratch_tokens) == ALLOC_ARENA_FULL:
                        return now_ms, 0, True
                next_event = min(next_event, rq_i[q, RQ_FAST_LIMIT] - base_computed + 1)
        # the pass's prefill part is empty: start + 0 ms, then the decode batch
        end_ms = (start_ms + 0.0) + ns_to_ms(dc_ns)
        if first_event >= 0:
            kv_events_visible_at(p, s, first_event, end_ms)  # this step's KV events: at its end
        fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], end_ms - start_ms, n_gaps)
        if log_on:
            # a decode pass: n decode requests, n tokens, nothing else
            zero = np.int64(0)  # typed, not a literal: one compiled copy of the row writer
            append_pass_row(p, wk, sims, s, w, start_ms, end_ms, zero, zero, zero, zero, n, kv_tokens, zero,
                            zero, n, n, kv_tokens)
        if k == 0:
            first_end_ms = end_ms
        kv_tokens += n
        k += 1
    if event_log_on(p):
        event_set_clock(p, s, now_ms)  # the loop's instant again (the steps above moved it)
    if k == 0:
        return now_ms, 0, False

    stamp = (wk.i64[w, WK_PASS_STAMP] + k) * 65536 + (w % 65536) + 1
    wk.i64[w, WK_PASS_STAMP] += k
    p.w64[w, PW_PASS_NUM] = wk.i64[w, WK_PASS_STAMP]  # the run's last pass, maybe in flight
    for j in range(n):
        q = wk.run_q[off + j]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        generated = rq_i[q, RQ_GENERATED]
        if generated == 1:
            rq_f[q, RQF_SECOND_TOKEN_MS] = first_end_ms
        computed = rq_i[q, RQ_NUM_COMPUTED] + k
        rq_i[q, RQ_NUM_COMPUTED] = computed
        if computed > rq_i[q, RQ_ALLOCATED]:
            rq_i[q, RQ_ALLOCATED] = computed
        rq_i[q, RQ_GENERATED] = generated + k
        rq_f[q, RQF_LAST_TOKEN_MS] = end_ms
        # what the last pass's schedule step recorded: one decode token
        stamp_scheduled(rq_i, q, stamp, 1, 0, prompt, prompt + generated + k - 1, False, CLASS_DECODE)
    return end_ms, k, False

