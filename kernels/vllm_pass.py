"""One forward pass of a vLLM or TRT-LLM rank (``scheduler/vllm/core.rs`` and
``policy.rs`` of the reference; behaviour as verified in spec/engine.md §5, §6, §14).

A pass, in order: running requests first (token budget, chunked prefill, KV
allocation with preemption by recompute), then the strict-FIFO waiting queue
(rejections, the admission decision, ``max_num_seqs``), then prefill timing from
the batch counters, then every ready request emits one token; the decode batch
excludes first tokens produced by the pass that computed their prompt.

State is mutated eagerly at pass start; the replay loop makes terminals visible
at the pass end it returns (tokens are stamped with that end here).
"""

import numpy as np
from numba import njit

from .block_pool import num_active, release_ref, reserve, table_find, cache_copy
from .layout import (
    CFGF_DECODE_SPEEDUP_RATIO, CFGF_FIXED_DECODE_MS, CFGF_FIXED_PREFILL_MS, CFGF_SPEEDUP_RATIO,
    CFG_BLOCK_SIZE, CFG_CHUNKED_PREFILL, CFG_MAX_MODEL_LEN, CFG_MAX_NUM_BATCHED_TOKENS,
    CFG_MAX_NUM_SEQS, CFG_NUM_GPU_BLOCKS, CFG_POLICY, CFG_PREEMPTION_FIFO, CFG_PREFIX_CACHING,
    CFG_ROLE, CFG_TIMING, NO_BLOCK, PB_CACHED, PB_PIN, PB_REF, PL_ACTIVE_BLOCKS, PL_END_MS,
    PL_INACTIVE_BLOCKS, PL_NUM_ADMITTED, PL_NUM_DECODE_REQUESTS, PL_NUM_OUTPUT_TOKENS,
    PL_NUM_PREEMPTED, PL_NUM_PREFILL_REQUESTS, PL_NUM_RUNNING, PL_NUM_WAITING, PL_START_MS,
    PL_SUM_DECODE_KV_TOKENS, PL_SUM_PREFILL_KV_TOKENS, PL_SUM_PREFILL_TOKENS, PL_WORKER,
    POLICY_TRTLLM, PW_LRU_LEN, ROLE_DECODE, ROLE_PREFILL, RQF_FIRST_ADMIT_MS,
    RQF_FIRST_TOKEN_MS, RQF_LAST_TOKEN_MS, RQF_SECOND_TOKEN_MS, RQF_TERMINAL_MS, RQ_ADMISSIONS,
    RQ_ALLOCATED, RQ_COMMITTED_PREFILL, RQ_FIRST_CACHED, RQ_GENERATED, RQ_LEASE_OFF,
    RQ_MAX_CACHED, RQ_MAX_OUTPUT, RQ_NUM_COMPUTED, RQ_NUM_HASHED, RQ_PREEMPTIONS, RQ_PROMPT_LEN,
    RQ_SCHED_PREFIX, RQ_SCHED_LEN, RQ_SCHED_PROMPT, RQ_SCHED_STAMP, RQ_SCHED_TERMINAL, RQ_SCHED_TOKENS,
    RQ_SRC_ROW, RQ_STATUS, RQ_TERMINAL, RQ_TERM_NEXT, RQ_UUID, RS_DONE, RS_PREEMPTED,
    RS_RUNNING, RS_WAITING, SM_PASS_LOG_LEN, SM_W_OFF, TERM_COMPLETED, TERM_REJECTED,
    WK_PASS_STAMP, WK_PREEMPTIONS_TOTAL, WK_RUN_LEN, WK_RUN_OFF, WK_TERM_HEAD, WK_TERM_TAIL, WK_WAIT_CAP,
    WK_PEND_LEN, WK_TRT_TAIL, WK_CAP_GEN, RS_ACTIVATED, RS_HELD, RQ_REPUBLISHED, RQ_FAST_LIMIT,
    RQ_SCHED_CLASS,
    WK_WAIT_HEAD, WK_WAIT_LEN, WK_WAIT_OFF, WK_OVERFLOW, WK_RUN_CAP,
)
from .sketch import fold_gap_run
from .timing import decode_ns, ns_to_ms, prefill_ns
from .xxh3 import XXH3_SEED, hash_chain, synthetic_output_token, xxh3_64_u32

# schedule_request outcomes
SCHEDULED = 0
BLOCKED = 1
CURRENT_PREEMPTED = 2
ALLOC_ARENA_FULL = 3


@njit(cache=True, _nrt=False)
def _ceil_div(a, b):
    return (a + b - 1) // b


@njit(cache=True, _nrt=False, inline="always")
def seq_len(rq, q):
    return rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_GENERATED]


@njit(cache=True, _nrt=False, inline="always")
def _remaining(max_output, generated, prompt, limit):
    """Tokens still to generate, from scalars: hot loops call this one because a
    helper that receives arrays reference-counts them on every call."""
    rem = max_output - generated
    if limit >= 0:
        rem = min(rem, limit - prompt - generated)
    return rem


@njit(cache=True, _nrt=False, inline="always")
def remaining_generation(cfg, rq, w, q):
    """Tokens still to generate: output budget, and ``max_model_len`` when set."""
    rem = rq.i64[q, RQ_MAX_OUTPUT] - rq.i64[q, RQ_GENERATED]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    if limit >= 0:
        rem = min(rem, limit - seq_len(rq, q))
    return rem


# ---------------------------------------------------------------------------------
# queues: running list (index order matters for the preemption cursor) and the
# waiting ring (preempted requests go to its front)
# ---------------------------------------------------------------------------------
@njit(cache=True, _nrt=False, inline="always")
def wait_at(wk, w, i):
    return wk.wait_q[wk.i64[w, WK_WAIT_OFF] + (wk.i64[w, WK_WAIT_HEAD] + i) % wk.i64[w, WK_WAIT_CAP]]


@njit(cache=True, _nrt=False, inline="always")
def wait_push_back(wk, w, q):
    """Append q to the waiting ring; a full ring writes nothing and flags the
    worker (the event loop then ends the simulation with SIM_CAPACITY)."""
    cap = wk.i64[w, WK_WAIT_CAP]
    if wk.i64[w, WK_WAIT_LEN] >= cap:
        wk.i64[w, WK_OVERFLOW] = 1
        return False
    wk.wait_q[wk.i64[w, WK_WAIT_OFF] + (wk.i64[w, WK_WAIT_HEAD] + wk.i64[w, WK_WAIT_LEN]) % cap] = q
    wk.i64[w, WK_WAIT_LEN] += 1
    return True


@njit(cache=True, _nrt=False, inline="always")
def wait_push_front(wk, w, q):
    cap = wk.i64[w, WK_WAIT_CAP]
    if wk.i64[w, WK_WAIT_LEN] >= cap:
        wk.i64[w, WK_OVERFLOW] = 1
        return
    h = (wk.i64[w, WK_WAIT_HEAD] - 1 + cap) % cap
    wk.i64[w, WK_WAIT_HEAD] = h
    wk.wait_q[wk.i64[w, WK_WAIT_OFF] + h] = q
    wk.i64[w, WK_WAIT_LEN] += 1


@njit(cache=True, _nrt=False)
def wait_remove_at(wk, w, i):
    """Remove entry ``i`` keeping the order of the others."""
    cap = wk.i64[w, WK_WAIT_CAP]
    off = wk.i64[w, WK_WAIT_OFF]
    head = wk.i64[w, WK_WAIT_HEAD]
    if i == 0:
        wk.i64[w, WK_WAIT_HEAD] = (head + 1) % cap
    else:
        for j in range(i, wk.i64[w, WK_WAIT_LEN] - 1):
            wk.wait_q[off + (head + j) % cap] = wk.wait_q[off + (head + j + 1) % cap]
    wk.i64[w, WK_WAIT_LEN] -= 1


@njit(cache=True, _nrt=False, inline="always")
def run_push_back(wk, w, q):
    """Append q to the running list (full: nothing written, the worker flagged)."""
    n = wk.i64[w, WK_RUN_LEN]
    if n >= wk.i64[w, WK_RUN_CAP]:
        wk.i64[w, WK_OVERFLOW] = 1
        return
    wk.run_q[wk.i64[w, WK_RUN_OFF] + n] = q
    wk.i64[w, WK_RUN_LEN] = n + 1


@njit(cache=True, _nrt=False, inline="always")
def run_remove_at(wk, w, i):
    off = wk.i64[w, WK_RUN_OFF]
    n = wk.i64[w, WK_RUN_LEN]
    for j in range(i, n - 1):
        wk.run_q[off + j] = wk.run_q[off + j + 1]
    wk.i64[w, WK_RUN_LEN] = n - 1


# ---------------------------------------------------------------------------------
# tokens and block identities
# ---------------------------------------------------------------------------------
@njit(cache=True, _nrt=False)
def _hash_block(rq, wl, q, i, bs, scratch_tokens):
    """Sequence hash of block i of request q (block i-1 must already be hashed).

    Tokens: prompt positions hold the interned trace hash id of their trace block
    (filled run by run, a trace block is many engine tokens); generated positions
    hold the reference's synthetic output token of (request uuid, ordinal)."""
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    pos = i * bs
    end = pos + bs
    j = 0
    if pos < prompt:
        row = rq.i64[q, RQ_SRC_ROW]
        tbs = wl.trace_block_size[row]
        h0 = wl.hash_indptr[row]
        while pos < min(end, prompt):
            run_end = min(min(end, prompt), (pos // tbs + 1) * tbs)
            token = wl.hash_ids[h0 + pos // tbs]
            while pos < run_end:
                scratch_tokens[j] = token
                j += 1
                pos += 1
    uuid = np.uint64(rq.i64[q, RQ_UUID])
    while pos < end:
        scratch_tokens[j] = synthetic_output_token(np.uint64(0), uuid, np.uint64(pos - prompt))
        j += 1
        pos += 1
    local = xxh3_64_u32(scratch_tokens, 0, bs, XXH3_SEED)
    if i == 0:
        return local
    return hash_chain(rq.seq_hash[rq.i64[q, RQ_LEASE_OFF] + i - 1], local)


@njit(cache=True, _nrt=False)
def prefix_cost(cfg, p, rq, w, q):
    """(cached_tokens, active_cached_tokens) of a prefix lookup: leading complete
    blocks with a resident copy; active = those whose primary copy is referenced
    or pinned. Lookup does not touch the LRU."""
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return 0, 0
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    length = seq_len(rq, q)
    k0 = rq.i64[q, RQ_LEASE_OFF]
    overlap = 0
    active = 0
    for i in range(rq.i64[q, RQ_NUM_HASHED]):
        b = table_find(p, w, rq.seq_hash[k0 + i])
        if b == NO_BLOCK:
            break
        overlap += 1
        if p.b32[b, PB_REF] > 0 or p.b32[b, PB_PIN] > 0:
            active += 1
    return min(overlap * bs, length), min(active * bs, length)


@njit(cache=True, _nrt=False)
def capped_prefix_cost(cfg, p, rq, w, q):
    """Prefix cost after the vLLM recompute rule: while logits are still needed the
    cached prefix is capped at ``floor((len-1)/bs)*bs`` (a fully cached aligned
    prompt recomputes its last block). TRT-LLM applies no cap."""
    cached, active = prefix_cost(cfg, p, rq, w, q)
    if cfg.i64[w, CFG_POLICY] != POLICY_TRTLLM and remaining_generation(cfg, rq, w, q) > 0:
        bs = cfg.i64[w, CFG_BLOCK_SIZE]
        cap = ((seq_len(rq, q) - 1) // bs) * bs
        cached = min(cached, cap)
        active = min(active, cap)
    return cached, active


# ---------------------------------------------------------------------------------
# lease operations
# ---------------------------------------------------------------------------------
@njit(cache=True, _nrt=False)
def allocate(cfg, p, rq, w, q, target_tokens, reusable_prefix_blocks, hits, fresh):
    """Grow q's lease to cover ``target_tokens``; the first blocks up to
    ``reusable_prefix_blocks`` are prefix hits, the rest fresh private copies.
    Returns 1 ok, 0 capacity exhausted (unchanged), -1 arena exhausted."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    prev = _ceil_div(rq.i64[q, RQ_ALLOCATED], bs)
    tgt = min(_ceil_div(target_tokens, bs), _ceil_div(seq_len(rq, q), bs))
    if tgt <= prev:
        rq.i64[q, RQ_ALLOCATED] = max(rq.i64[q, RQ_ALLOCATED], target_tokens)
        return 1
    count = tgt - prev
    n_hit = min(max(0, reusable_prefix_blocks - prev), count)
    for i in range(n_hit):
        hits[i] = table_find(p, w, rq.seq_hash[k0 + prev + i])
    res = reserve(p, w, cfg.i64[w, CFG_NUM_GPU_BLOCKS], hits, n_hit, count - n_hit, fresh)
    if res != 1:
        return res
    for i in range(n_hit):
        rq.lease[k0 + prev + i] = hits[i]
    for i in range(count - n_hit):
        rq.lease[k0 + prev + n_hit + i] = fresh[i]
    rq.i64[q, RQ_ALLOCATED] = target_tokens
    return 1


@njit(cache=True, _nrt=False)
def release_lease(cfg, p, rq, w, q):
    """Release every block, tail first, so a request's leaf enters the LRU (and is
    evicted) before its parents."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(_ceil_div(rq.i64[q, RQ_ALLOCATED], bs) - 1, -1, -1):
        release_ref(p, w, rq.lease[k0 + i])
        rq.lease[k0 + i] = NO_BLOCK
    rq.i64[q, RQ_ALLOCATED] = 0
    rq.i64[q, RQ_FAST_LIMIT] = 0


@njit(cache=True, _nrt=False)
def finalize(cfg, p, rq, wl, w, q, before, after, scratch_tokens):
    """Blocks completed by computing tokens [before, after) get their identity and
    become visible, before later requests of the same pass look them up."""
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(before // bs, after // bs):
        if i >= rq.i64[q, RQ_NUM_HASHED]:
            rq.seq_hash[k0 + i] = _hash_block(rq, wl, q, i, bs, scratch_tokens)
            rq.i64[q, RQ_NUM_HASHED] = i + 1
        b = rq.lease[k0 + i]
        if p.b32[b, PB_CACHED] == 0:
            if cache_copy(p, w, b, rq.seq_hash[k0 + i]) and cfg.i64[w, CFG_ROLE] == ROLE_DECODE \
                    and i < rq.i64[q, RQ_PROMPT_LEN] // bs:
                rq.i64[q, RQ_REPUBLISHED] += 1


# ---------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------
# what a scheduled request contributes to its pass's timing (RQ_SCHED_CLASS)
CLASS_NONE = 0      # not ready to emit (prompt chunk pending), or a free first token
CLASS_DECODE = 1    # in the decode batch
CLASS_COMPLETE = 2  # ready with nothing left to generate: a terminal without a token
ACC_SIZE = 11


@njit(cache=True, _nrt=False, inline="always")
def _classify(acc, computed, length, remaining, free_first_token):
    """Class of a request just scheduled up to ``computed`` tokens of ``length``;
    adds it to the pass's decode-batch counters."""
    if computed < length:
        return CLASS_NONE
    if remaining <= 0:
        acc[10] += 1
        return CLASS_COMPLETE
    if free_first_token:
        return CLASS_NONE
    acc[8] += 1
    acc[9] += length
    return CLASS_DECODE


@njit(cache=True, _nrt=False)
def _preempt(cfg, p, rq, wk, w):
    """Preempt the last (lifo) or first (fifo) running request; returns it or -1."""
    n = wk.i64[w, WK_RUN_LEN]
    if n == 0:
        return -1
    idx = 0 if cfg.i64[w, CFG_PREEMPTION_FIFO] != 0 else n - 1
    v = wk.run_q[wk.i64[w, WK_RUN_OFF] + idx]
    run_remove_at(wk, w, idx)
    rq.i64[v, RQ_STATUS] = RS_PREEMPTED
    rq.i64[v, RQ_NUM_COMPUTED] = 0
    rq.i64[v, RQ_PREEMPTIONS] += 1
    wk.i64[w, WK_PREEMPTIONS_TOTAL] += 1
    wk.i64[w, WK_CAP_GEN] += 1
    wait_push_front(wk, w, v)
    release_lease(cfg, p, rq, w, v)
    return v


@njit(cache=True, _nrt=False)
def trt_blocks_to_finish(cfg, p, rq, w, q, active_cached):
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    out = rq.i64[q, RQ_MAX_OUTPUT]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    if limit >= 0:
        out = min(out, limit - rq.i64[q, RQ_PROMPT_LEN])
    to_completion = _ceil_div(rq.i64[q, RQ_PROMPT_LEN] + out, bs)
    if rq.i64[q, RQ_ALLOCATED] > 0:
        have = _ceil_div(rq.i64[q, RQ_ALLOCATED], bs)
    else:
        have = active_cached // bs
    return max(0, to_completion - have)


@njit(cache=True, _nrt=False, inline="always")
def push_terminal(rq, wk, w, q):
    """Append q to the worker's terminal list (output order, visible at the pass end)."""
    rq.i64[q, RQ_TERM_NEXT] = -1
    tail = wk.i64[w, WK_TERM_TAIL]
    if tail < 0:
        wk.i64[w, WK_TERM_HEAD] = q
    else:
        rq.i64[tail, RQ_TERM_NEXT] = q
    wk.i64[w, WK_TERM_TAIL] = q


@njit(cache=True, _nrt=False)
def trt_running_tail(cfg, p, rq, wk, w):
    """TRT-LLM: blocks the running requests still need to finish, plus (decode rank)
    those of reserved and activated-waiting destinations."""
    tail = wk.i64[w, WK_TRT_TAIL]
    for j in range(wk.i64[w, WK_RUN_LEN]):
        tail += trt_blocks_to_finish(cfg, p, rq, w, wk.run_q[wk.i64[w, WK_RUN_OFF] + j], 0)
    return tail


@njit(cache=True, _nrt=False)
def _finish(cfg, p, rq, wk, w, q):
    """A request completes in this pass: lease back to the pool (tail first), onto
    the worker's terminal list. A disaggregated prefill (source) request instead
    keeps its lease - its KV is held for the decode side until ReleaseSource - and
    its terminal-list entry is the SourceHeld event of the pass."""
    wk.i64[w, WK_CAP_GEN] += 1  # its running slot is free (and its KV, unless held)
    if cfg.i64[w, CFG_ROLE] == ROLE_PREFILL:
        rq.i64[q, RQ_STATUS] = RS_HELD
    else:
        release_lease(cfg, p, rq, w, q)
        rq.i64[q, RQ_STATUS] = RS_DONE
        rq.i64[q, RQ_TERMINAL] = TERM_COMPLETED
    push_terminal(rq, wk, w, q)


@njit(cache=True, _nrt=False, inline="always")
def run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """Run one pass of worker ``w`` starting at ``now_ms``.

    Reads and writes the worker's queues, pool and the requests it owns; pushes
    terminals (with ``terminal_ms`` = pass end) onto the worker's terminal list.
    ``acc`` is an int64[ACC_SIZE] scratch for the pass counters. Returns
    ``(end_ms, had_effect, arena_full)``."""
    wk.i64[w, WK_PASS_STAMP] += 1
    # unique across the workers of a simulation: a disaggregated request is
    # scheduled on two workers and must not match a stale stamp of the other
    stamp = wk.i64[w, WK_PASS_STAMP] * 65536 + (w % 65536) + 1
    preemptions_before = wk.i64[w, WK_PREEMPTIONS_TOTAL]
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    capacity = cfg.i64[w, CFG_NUM_GPU_BLOCKS]
    is_trt = cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM
    not_decode = cfg.i64[w, CFG_ROLE] != ROLE_DECODE
    # acc: 0 budget, 1 batch_count, 2 total_isl, 3 total_prefix, 4 preempted_any,
    #      5 admitted, 6 scheduled_tokens, 7 rejected, 8 decode batch size,
    #      9 decode batch KV tokens, 10 ready requests with nothing left to generate
    # (8-10 are kept as requests are scheduled, see _classify)
    for i in range(ACC_SIZE):
        acc[i] = 0
    acc[0] = cfg.i64[w, CFG_MAX_NUM_BATCHED_TOKENS]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]

    # running first; the cursor is an index (a fifo victim before it shifts the list)
    rq_i = rq.i64
    i = 0
    while i < wk.i64[w, WK_RUN_LEN] and acc[0] > 0:
        q = wk.run_q[wk.i64[w, WK_RUN_OFF] + i]
        # Fast path, the bulk of all scheduling: a running request past its prompt
        # whose next tokens fit in its last block and complete no block. It is
        # exactly what _schedule does in that case, without a call (a call passes
        # the whole state and reference-counts every array of it).
        before = rq_i[q, RQ_NUM_COMPUTED]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        if before >= prompt:
            generated = rq_i[q, RQ_GENERATED]
            used = min(prompt + generated - before, acc[0])
            after = before + used
            # RQ_FAST_LIMIT stands for "after // bs == before // bs and
            # ceil(after / bs) <= ceil(allocated / bs)" without four integer divisions
            if used > 0 and after <= rq_i[q, RQ_FAST_LIMIT]:
                if after > rq_i[q, RQ_ALLOCATED]:
                    rq_i[q, RQ_ALLOCATED] = after
                rq_i[q, RQ_NUM_COMPUTED] = after
                rq_i[q, RQ_SCHED_STAMP] = stamp
                rq_i[q, RQ_SCHED_TOKENS] = used
                rq_i[q, RQ_SCHED_PROMPT] = 0
                rq_i[q, RQ_SCHED_PREFIX] = prompt
                rq_i[q, RQ_SCHED_LEN] = prompt + generated
                rem = _remaining(rq_i[q, RQ_MAX_OUTPUT], generated, prompt, limit)
                rq_i[q, RQ_SCHED_TERMINAL] = 1 if rem <= 0 else 0
                rq_i[q, RQ_SCHED_CLASS] = _classify(acc, after, prompt + generated, rem, False)
                acc[0] -= used
                acc[6] += used
                i += 1
                continue
        out = _schedule(cfg, p, rq, wl, wk, w, q, np.bool_(False), np.int64(0), now_ms, stamp, acc, hits,
                        fresh, scratch_tokens, not_decode, np.int64(0))
        if out == SCHEDULED:
            i += 1
        elif out == CURRENT_PREEMPTED:
            continue
        elif out == ALLOC_ARENA_FULL:
            return now_ms, True, True
        else:
            break

    # waiting queue: strict FIFO. On a decode rank an activated destination (prompt
    # KV already resident) is admitted without a capacity check, and while any
    # destination is still pending only activated requests are admitted, in queue
    # order, skipping the others.
    dest_pending = wk.i64[w, WK_PEND_LEN] > 0
    i_wait = np.int64(0)  # typed: a literal start would compile _schedule twice
    while acc[4] == 0 and wk.i64[w, WK_RUN_LEN] < cfg.i64[w, CFG_MAX_NUM_SEQS] \
            and i_wait < wk.i64[w, WK_WAIT_LEN]:
        q = wait_at(wk, w, i_wait)
        activated = rq.i64[q, RQ_STATUS] == RS_ACTIVATED
        if dest_pending and not activated:
            i_wait += 1
            continue
        if activated and not (limit >= 0 and rq.i64[q, RQ_PROMPT_LEN] >= limit):
            # prompt KV resident: no capacity check, nothing to allocate or compute
            if is_trt:
                wk.i64[w, WK_TRT_TAIL] -= trt_blocks_to_finish(cfg, p, rq, w, q, 0)
            out = _schedule(cfg, p, rq, wl, wk, w, q, np.bool_(True), np.int64(0), now_ms, stamp, acc, hits,
                            fresh, scratch_tokens, not_decode, i_wait)
            if out == ALLOC_ARENA_FULL:
                return now_ms, True, True
            if acc[0] == 0:
                break
            continue
        length = seq_len(rq, q)
        reject = limit >= 0 and rq.i64[q, RQ_PROMPT_LEN] >= limit
        if not reject and rq.i64[q, RQ_STATUS] == RS_WAITING:
            if is_trt:
                reject = _ceil_div(rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_MAX_OUTPUT], bs) > capacity
            else:
                reject = _ceil_div(length, bs) > capacity
        if reject:
            wait_remove_at(wk, w, i_wait)
            wk.i64[w, WK_CAP_GEN] += 1
            rq.i64[q, RQ_STATUS] = RS_DONE
            rq.i64[q, RQ_TERMINAL] = TERM_REJECTED
            push_terminal(rq, wk, w, q)
            acc[7] += 1
            continue
        cached, active_cached = capped_prefix_cost(cfg, p, rq, w, q)
        available = capacity - num_active(p, w)
        if is_trt:
            available -= trt_running_tail(cfg, p, rq, wk, w)
            needed = trt_blocks_to_finish(cfg, p, rq, w, q, active_cached)
        else:
            needed = _ceil_div(length, bs) - active_cached // bs
        if needed > available:
            break
        budget_before = acc[0]
        out = _schedule(cfg, p, rq, wl, wk, w, q, np.bool_(True), cached, now_ms, stamp, acc, hits, fresh,
                        scratch_tokens, not_decode, np.int64(0))
        if out == ALLOC_ARENA_FULL:
            return now_ms, True, True
        if out != SCHEDULED:
            break
        if budget_before == acc[0] and acc[0] == 0:
            break

    # timing: prefill first, then the decode batch
    pf_ns = prefill_ns(cfg.i64[w, CFG_TIMING], cfg.f64[w, CFGF_FIXED_PREFILL_MS], cfg.f64[w, CFGF_SPEEDUP_RATIO],
                       acc[1], acc[2], acc[3])
    decode_start_ms = now_ms + ns_to_ms(pf_ns)
    # only requests scheduled in this pass can be ready to emit: every other running
    # request emitted in its last pass and needs a computed token first
    n_decode = acc[8]
    kv_sum = acc[9]
    n_complete = acc[10]
    # the per-request loops below index the field matrices directly (hoisted once)
    rq_i = rq.i64
    rq_f = rq.f64
    cfg_i = cfg.i64
    run_q = wk.run_q
    off = wk.i64[w, WK_RUN_OFF]
    n_run = wk.i64[w, WK_RUN_LEN]
    if cfg_i[w, CFG_ROLE] == ROLE_PREFILL:
        dc_ns = np.int64(0)
    else:
        dc_ns = decode_ns(cfg_i[w, CFG_TIMING], cfg.f64[w, CFGF_FIXED_DECODE_MS], cfg.f64[w, CFGF_SPEEDUP_RATIO],
                          cfg.f64[w, CFGF_DECODE_SPEEDUP_RATIO], n_decode, kv_sum, capacity * bs)
    end_ms = decode_start_ms + ns_to_ms(dc_ns)

    # emit, in the reference's output order: first the requests whose generation was
    # already complete (terminal without a token; their leases go back to the LRU
    # first), then one token per ready request in running order
    n_tokens = np.int64(0)
    token_stat = sims.token_stat
    token_hist = sims.token_hist
    run_gap_ms = 0.0  # current run of equal token gaps, folded when it ends
    run_count = 0
    n_no_token = 0
    for j in range(n_run if n_complete > 0 else 0):
        q = run_q[off + j]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        generated = rq_i[q, RQ_GENERATED]
        if rq_i[q, RQ_NUM_COMPUTED] >= prompt + generated \
                and _remaining(rq_i[q, RQ_MAX_OUTPUT], generated, prompt, limit) <= 0:
            _finish(cfg, p, rq, wk, w, q)
            n_no_token += 1
    keep = 0
    for j in range(n_run):
        q = run_q[off + j]
        if n_no_token > 0 and rq_i[q, RQ_STATUS] == RS_DONE:
            continue
        done = False
        generated = rq_i[q, RQ_GENERATED]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        if rq_i[q, RQ_NUM_COMPUTED] >= prompt + generated:
            g = generated + 1
            rq_i[q, RQ_GENERATED] = g
            n_tokens += 1
            if g == 1:
                rq_f[q, RQF_FIRST_TOKEN_MS] = end_ms
            else:
                if g == 2:
                    rq_f[q, RQF_SECOND_TOKEN_MS] = end_ms
                gap_ms = end_ms - rq_f[q, RQF_LAST_TOKEN_MS]
                if gap_ms != run_gap_ms:
                    fold_gap_run(token_stat, token_hist, s, run_gap_ms, run_count)
                    run_gap_ms = gap_ms
                    run_count = 0
                run_count += 1
            rq_f[q, RQF_LAST_TOKEN_MS] = end_ms
            done = _remaining(rq_i[q, RQ_MAX_OUTPUT], g, prompt, limit) <= 0
        if done:
            _finish(cfg, p, rq, wk, w, q)
        else:
            run_q[off + keep] = q
            keep += 1
    wk.i64[w, WK_RUN_LEN] = keep
    fold_gap_run(token_stat, token_hist, s, run_gap_ms, run_count)

    # every terminal of this pass becomes visible at its end
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        rq.f64[q, RQF_TERMINAL_MS] = end_ms
        q = rq.i64[q, RQ_TERM_NEXT]

    had_effect = acc[5] > 0 or acc[6] > 0 or acc[7] > 0 or acc[4] > 0 or n_tokens > 0 \
        or wk.i64[w, WK_TERM_HEAD] >= 0
    if sims.i64[s, SM_PASS_LOG_LEN] < sims.pass_log.shape[1]:  # logging on and room left
        _log_pass(cfg, p, rq, wk, sims, s, w, now_ms, end_ms, stamp, acc, n_tokens,
                  wk.i64[w, WK_PREEMPTIONS_TOTAL] - preemptions_before)
    return end_ms, had_effect, False


@njit(cache=True, _nrt=False)
def _schedule(cfg, p, rq, wl, wk, w, q, from_waiting, cost_cached, now_ms, stamp, acc, hits,
              fresh, scratch_tokens, not_decode, wait_index):
    """The reference's ``schedule_request``: allocate (preempting on exhaustion),
    finalize computed blocks, record the work and admit a waiting request (found
    at ``wait_index`` of the waiting queue).

    Callers pass typed values (``np.bool_(..)``, ``np.int64(..)``), never bare
    constants: Numba compiles a separate copy of a function for every literal
    argument it sees, and this one is the largest of the pass."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    rq.i64[q, RQ_FAST_LIMIT] = 0  # set again below once scheduled
    if rq.i64[q, RQ_NUM_COMPUTED] == 0:
        if from_waiting:
            cached = cost_cached
        else:
            cached, _ = capped_prefix_cost(cfg, p, rq, w, q)
    else:
        cached = 0
    before = rq.i64[q, RQ_NUM_COMPUTED] + cached
    length = seq_len(rq, q)
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    prompt_before = min(before, prompt)
    prompt_remaining = prompt - prompt_before
    remaining_known = max(0, length - before)
    if prompt_remaining > 0 and cfg.i64[w, CFG_CHUNKED_PREFILL] == 0 and prompt_remaining > acc[0]:
        return BLOCKED
    desired = min(remaining_known, acc[0])
    if desired == 0 and remaining_known > 0:
        return BLOCKED
    target = before + desired
    after = target
    victims_queued = 0
    while True:
        if target > rq.i64[q, RQ_ALLOCATED]:
            if _ceil_div(target, bs) <= _ceil_div(rq.i64[q, RQ_ALLOCATED], bs):
                # same block count (the common decode step): only the watermark moves
                rq.i64[q, RQ_ALLOCATED] = target
                res = 1
            else:
                res = allocate(cfg, p, rq, w, q, target, cached // bs, hits, fresh)
            if res < 0:
                return ALLOC_ARENA_FULL
            if res == 1:
                rq.i64[q, RQ_NUM_COMPUTED] = after
                break
        else:
            rq.i64[q, RQ_NUM_COMPUTED] = after
            break
        if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
            after = before  # guaranteed-no-evict never preempts
            break
        v = _preempt(cfg, p, rq, wk, w)
        if v < 0:
            after = before
            break
        victims_queued += 1
        acc[4] = 1
        if rq.i64[v, RQ_SCHED_STAMP] == stamp:
            # the victim's work in this pass is undone
            rq.i64[v, RQ_SCHED_STAMP] = 0
            acc[0] += rq.i64[v, RQ_SCHED_TOKENS]
            acc[6] -= rq.i64[v, RQ_SCHED_TOKENS]
            if rq.i64[v, RQ_SCHED_CLASS] == CLASS_DECODE:
                acc[8] -= 1
                acc[9] -= rq.i64[v, RQ_SCHED_LEN]
            elif rq.i64[v, RQ_SCHED_CLASS] == CLASS_COMPLETE:
                acc[10] -= 1
            if rq.i64[v, RQ_SCHED_PROMPT] > 0:
                rq.i64[v, RQ_COMMITTED_PREFILL] -= rq.i64[v, RQ_SCHED_TOKENS]
                if not_decode:
                    acc[1] -= 1
                    acc[2] -= rq.i64[v, RQ_SCHED_PREFIX] + rq.i64[v, RQ_SCHED_PROMPT]
                    acc[3] -= rq.i64[v, RQ_SCHED_PREFIX]
        if v == q:
            return CURRENT_PREEMPTED
    used = after - before
    if used == 0 and after < length:
        return BLOCKED

    if after // bs > before // bs:
        finalize(cfg, p, rq, wl, w, q, before, after, scratch_tokens)
    prompt_tokens = min(after, prompt) - prompt_before
    rq.i64[q, RQ_SCHED_STAMP] = stamp
    rq.i64[q, RQ_SCHED_TOKENS] = used
    rq.i64[q, RQ_SCHED_PROMPT] = prompt_tokens
    rq.i64[q, RQ_SCHED_PREFIX] = prompt_before
    rq.i64[q, RQ_SCHED_LEN] = length
    rem = remaining_generation(cfg, rq, w, q)
    rq.i64[q, RQ_SCHED_TERMINAL] = 1 if rem <= 0 else 0
    # the first token of the pass that computed the prompt is not decode work
    rq.i64[q, RQ_SCHED_CLASS] = _classify(acc, after, length, rem,
                                          prompt_tokens > 0 and rq.i64[q, RQ_GENERATED] == 0)
    # the pass fast path may continue up to the end of this block, within the lease
    rq.i64[q, RQ_FAST_LIMIT] = min((after // bs + 1) * bs - 1,
                                   _ceil_div(rq.i64[q, RQ_ALLOCATED], bs) * bs)
    if prompt_tokens > 0:
        # committed prefill work: every token of a pass chunk that computes prompt
        # tokens, on any worker (a decode-side recompute after preemption included)
        rq.i64[q, RQ_COMMITTED_PREFILL] += used
        if not_decode:
            acc[1] += 1
            acc[2] += prompt_before + prompt_tokens
            acc[3] += prompt_before
    acc[0] -= used
    acc[6] += used
    if from_waiting:
        # victims preempted by this call were queued ahead of q
        wait_remove_at(wk, w, wait_index + victims_queued)
        run_push_back(wk, w, q)
        rq.i64[q, RQ_STATUS] = RS_RUNNING
        if rq.i64[q, RQ_FIRST_CACHED] < 0:
            rq.i64[q, RQ_FIRST_CACHED] = cached
            rq.f64[q, RQF_FIRST_ADMIT_MS] = now_ms
        rq.i64[q, RQ_MAX_CACHED] = max(rq.i64[q, RQ_MAX_CACHED], cached)
        rq.i64[q, RQ_ADMISSIONS] += 1
        acc[5] += 1
    return SCHEDULED


@njit(cache=True, _nrt=False)
def _log_pass(cfg, p, rq, wk, sims, s, w, start_ms, end_ms, stamp, acc, n_tokens, n_preempted):
    """Append this pass's ForwardPassMetrics row to simulation s's pass log."""
    if sims.i64[s, SM_PASS_LOG_LEN] >= sims.pass_log.shape[1]:
        return
    # typed counters: a literal 0 start makes Numba compile the callee for it too
    n_pf = np.int64(0)
    pf_tokens = np.int64(0)
    pf_kv = np.int64(0)
    n_dc = np.int64(0)
    dc_kv = np.int64(0)
    # scheduled requests of this pass: the running list plus those that ended in it
    off = wk.i64[w, WK_RUN_OFF]
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if rq.i64[q, RQ_SCHED_STAMP] == stamp:
            if rq.i64[q, RQ_SCHED_PROMPT] > 0:
                n_pf += 1
                pf_tokens += rq.i64[q, RQ_SCHED_TOKENS]
                pf_kv += rq.i64[q, RQ_SCHED_PREFIX]
            elif rq.i64[q, RQ_SCHED_TERMINAL] == 0:
                n_dc += 1
                dc_kv += rq.i64[q, RQ_SCHED_LEN]
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        if rq.i64[q, RQ_SCHED_STAMP] == stamp and (rq.i64[q, RQ_TERMINAL] == TERM_COMPLETED
                                                   or rq.i64[q, RQ_STATUS] == RS_HELD):
            if rq.i64[q, RQ_SCHED_PROMPT] > 0:
                n_pf += 1
                pf_tokens += rq.i64[q, RQ_SCHED_TOKENS]
                pf_kv += rq.i64[q, RQ_SCHED_PREFIX]
            elif rq.i64[q, RQ_SCHED_TERMINAL] == 0:
                n_dc += 1
                dc_kv += rq.i64[q, RQ_SCHED_LEN]
        q = rq.i64[q, RQ_TERM_NEXT]
    append_pass_row(p, wk, sims, s, w, start_ms, end_ms, n_pf, pf_tokens, pf_kv, n_dc, dc_kv,
                    acc[5], n_preempted, n_tokens)


@njit(cache=True, _nrt=False)
def append_pass_row(p, wk, sims, s, w, start_ms, end_ms, n_pf, pf_tokens, pf_kv, n_dc, dc_kv,
                    n_admitted, n_preempted, n_tokens):
    """Append one ForwardPassMetrics row (the caller checked there is room); queue
    lengths and block counts are read as the pass leaves them."""
    row = sims.i64[s, SM_PASS_LOG_LEN]
    sims.i64[s, SM_PASS_LOG_LEN] = row + 1
    log = sims.pass_log[s, row]
    log[PL_WORKER] = w - sims.i64[s, SM_W_OFF]
    log[PL_START_MS] = start_ms
    log[PL_END_MS] = end_ms
    log[PL_NUM_PREFILL_REQUESTS] = n_pf
    log[PL_SUM_PREFILL_TOKENS] = pf_tokens
    log[PL_SUM_PREFILL_KV_TOKENS] = pf_kv
    log[PL_NUM_DECODE_REQUESTS] = n_dc
    log[PL_SUM_DECODE_KV_TOKENS] = dc_kv
    log[PL_NUM_ADMITTED] = n_admitted
    log[PL_NUM_PREEMPTED] = n_preempted
    log[PL_NUM_OUTPUT_TOKENS] = n_tokens
    log[PL_NUM_RUNNING] = wk.i64[w, WK_RUN_LEN]
    log[PL_NUM_WAITING] = wk.i64[w, WK_WAIT_LEN]
    log[PL_ACTIVE_BLOCKS] = num_active(p, w)
    log[PL_INACTIVE_BLOCKS] = p.w64[w, PW_LRU_LEN]
