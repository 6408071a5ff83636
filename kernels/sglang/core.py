"""The SGLang scheduler rank: one forward pass (spec/sglang.md §4-§8, verified rule
by rule against the released reference; aggregated, ``dp_size`` 1).

A pass admits waiting requests into a prefill batch under the new-token-ratio
budgets (§5); if it admitted any it is a prefill-only pass whose newly prefilled
requests emit their first token (§6.2) while the running ones wait; otherwise it is
a decode pass over every running request, retracting requests under memory pressure
(§6.3). The KV cache is the worker's radix tree (``sglang.radix``): a request's
lease is its pages (``rq.lease`` at RQ_LEASE_OFF, one per page of its allocated
footprint), the prefix it has in the tree (RQ_SG_CACHED tokens) and the tree node
that ends it (RQ_SG_LAST, locked).

Page keys are the contents of the request's pages (``rq.seq_hash``, computed when
first needed, see ``_ensure_keys``), as the reference keys its tree.

Same signature as ``vllm.core.run_pass``; ``loop.backends`` dispatches on the policy code.
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on, note_event, outputs_logged
from aisim_fast.kernels.kv.lease import local_block_hash
from aisim_fast.kernels.loop.pass_log import append_pass_row
from aisim_fast.kernels.loop.rank_queues import (push_terminal, run_push_back, run_remove_at, wait_at,
                                                 wait_push_back, wait_push_front, wait_remove_at)
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.loop.token_output import emit_token, time_token
from aisim_fast.kernels.schema.layout import (ACC_ADMITTED, ACC_BATCH, ACC_ISL, ACC_PREFIX, CFG_MAX_MODEL_LEN,
                                              CFG_SPEC_NEXTN,
                                              CFG_MAX_NUM_SEQS, CFG_NUM_GPU_BLOCKS, CFG_PREFIX_CACHING,
                                              CFG_ROLE, CFG_SG_CHUNK_SIZE, CFG_SG_CLIP, CFG_SG_LPM,
                                              CFG_SG_HOST_LOOP, CFG_SG_MAX_PREFILL_TOKENS, CFG_SG_PD_INTERVAL,
                                              CFGF_SG_DECAY_STEP, CFGF_SG_INIT_RATIO, CFGF_SG_MIN_RATIO,
                                              EV_ADMITTED, EV_FINISHED, EV_PREEMPTED, EV_PRESSURE,
                                              EV_PRESSURE_SGLANG, PL_ACTIVE_BLOCKS, PL_INACTIVE_BLOCKS,
                                              ROLE_DECODE, ROLE_PREFILL, RQ_ADMISSIONS, RQ_ALLOCATED,
                                              RQ_COMMITTED_PREFILL, RQ_FIRST_CACHED, RQ_GENERATED,
                                              RQ_HL_COMMIT_STAMP, RQ_HL_COMMIT_THROUGH, RQ_HL_DONE_STAMP,
                                              RQ_HL_TOKEN_STAMP, RQ_HL_TOKENS_PENDING,
                                              RQ_LEASE_OFF, RQ_MAX_CACHED, RQ_MAX_OUTPUT, RQ_NUM_COMPUTED,
                                              RQ_NUM_HASHED, RQ_PREEMPTIONS, RQ_PROMPT_LEN, RQ_SESSION_ROW,
                                              RQ_SG_CACHED, RQ_SG_LAST, RQ_SG_LPM_KEY, RQ_SG_LPM_RECORDED,
                                              RQ_SG_READY_NEXT, RQ_SRC_ROW, RQ_STATUS, RQ_TERM_NEXT,
                                              RQ_TERMINAL, RQ_WORKER, RQF_FIRST_ADMIT_MS, RQF_TERMINAL_MS,
                                              RS_DONE, RS_HELD, RS_NOT_ARRIVED, RS_PREEMPTED, RS_RUNNING,
                                              RS_WAITING, RW_DECODE_PASSES, RW_EVICTABLE, RW_INSERT_SHARED,
                                              RW_PAGE_SIZE, RW_PAGES_USED, SM_GROUP_PASS, SM_PASS_LOG_LEN,
                                              SM_PREFILL_Q_OFF, SM_Q_LEN, SM_Q_OFF, TERM_COMPLETED, TERM_NONE,
                                              TERM_REJECTED, WK_CAP_GEN, WK_PASS_STAMP, WK_PEND_LEN,
                                              WK_PREEMPTIONS_TOTAL, WK_RUN_LEN, WK_RUN_OFF, WK_SG_PASS_FLAGS,
                                              WK_SG_PREFILL_ROUNDS, WK_SG_RATIO_BITS, WK_SG_READY_HEAD,
                                              WK_SG_READY_LEN, WK_SG_READY_TAIL, WK_STAT_ROW, WK_TERM_HEAD,
                                              WK_WAIT_CAP, WK_WAIT_HEAD, WK_WAIT_LEN, WK_WAIT_OFF)
from aisim_fast.kernels.features import gate
from aisim_fast.kernels.sglang import host_loop as hl
from aisim_fast.kernels.sglang import radix as rx
from aisim_fast.kernels.spec import sampler as spec_sampler
from aisim_fast.kernels.stats.sketch import fold_gap_run
from aisim_fast.kernels.timing.pass_timing import decode_ns, ns_to_ms, prefill_ns
from aisim_fast.kernels.trace.output_plan import output_token_ids

RETRACT_STEPS = 20  # tokens of headroom per surviving request after a retraction
DECODE_LOG_INTERVAL = 40  # SGLang's decode_log_interval: passes between decode stats reports


# ---------------------------------------------------------------------------------
# request helpers
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _seq(rq, q):
    return rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_GENERATED]


@kernel(cache=True, _nrt=False, inline="always")
def _remaining(rq, q):
    return max(0, rq.i64[q, RQ_MAX_OUTPUT] - rq.i64[q, RQ_GENERATED])


@kernel(cache=True, _nrt=False, inline="always")
def _ratio(wk, w):
    return np.int64(wk.i64[w, WK_SG_RATIO_BITS]).view(np.float64)


@kernel(cache=True, _nrt=False, inline="always")
def _set_ratio(wk, w, x):
    wk.i64[w, WK_SG_RATIO_BITS] = np.float64(x).view(np.int64)



@kernel(cache=True, _nrt=False)
def _ensure_keys(rq, wl, q, n_pages, ps, scratch_tokens):
    """Page keys of q's first n_pages pages, computed once (kept across retraction).

    A page's key is its content: with one-token pages the token itself (a prompt
    token is its trace block's interned id, a generated one the row's output token
    id), else the tokens-only hash of the page. The tree's edges hold
    keys in path order, so content keys match exactly the prefixes tokens would."""
    k0 = rq.i64[q, RQ_LEASE_OFF]
    i = rq.i64[q, RQ_NUM_HASHED]
    if i >= n_pages:
        return
    if ps == 1:
        prompt = rq.i64[q, RQ_PROMPT_LEN]
        row = rq.i64[q, RQ_SRC_ROW]
        tbs = wl.trace_block_size[row]
        h0 = wl.hash_indptr[row]
        # prompt tokens: a trace block's id over its run of tokens (one division per
        # call, not per token: this fills millions of keys). A slice fill, not an
        # element loop: Numba's loop keeps a negative-index check per store and is not
        # vectorized (4x slower on a 10k-request trace's 11.5M keys)
        end = min(n_pages, prompt)
        block = i // tbs
        while i < end:
            stop = min((block + 1) * tbs, end)
            rq.seq_hash[k0 + i:k0 + stop] = np.uint64(wl.hash_ids[h0 + block])
            i = stop
            block += 1
        if i < n_pages:
            # generated tokens: the row's output token ids, filled up to the end of the
            # plan block (16 words) that holds the last one asked for, so that a decode
            # step computes a block per 16 tokens, not one per token (the lease holds
            # every token the request may generate)
            off = wl.out_plan[row]
            end = n_pages
            if off >= 0:
                end = max(n_pages, min(prompt + rq.i64[q, RQ_MAX_OUTPUT],
                                       n_pages + 15 - (off + n_pages - 1 - prompt) % 16))
            output_token_ids(wl.out_plan, wl.out_authored, row, i - prompt, end - i, rq.seq_hash, k0 + i)
            n_pages = end
    else:
        while i < n_pages:
            rq.seq_hash[k0 + i] = local_block_hash(rq, wl, q, i, ps, scratch_tokens)
            i += 1
    rq.i64[q, RQ_NUM_HASHED] = n_pages


@kernel(cache=True, _nrt=False)
def _evict_for(r, w, tokens):
    """Make ``tokens`` available if the tree can (evicting only the deficit)."""
    have = rx.available_tokens(r, w)
    if tokens > have:
        rx.evict(r, w, tokens - have)


@kernel(cache=True, _nrt=False)
def _take_pages(r, rq, w, q, first, count):
    """count fresh pages into q's lease at page index ``first``; False when the
    worker's page slots ran out (the caller checked the pool)."""
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for j in range(count):
        b = rx.page_alloc(r, w)
        if b < 0:
            return False
        rq.lease[k0 + first + j] = b
    return True


# ---------------------------------------------------------------------------------
# KV operations on a request (§4)
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def first_allocation(cfg, r, rq, wl, w, q, chunk_end, cap, path, scratch_tokens):
    """§4.1: lock the cached prefix (matched up to ``cap``, the read-only match the
    admission step just made), take pages for the rest of the chunk. Returns the
    prefix tokens matched, -1 when it does not fit, -2 when the page slots ran out."""
    ps = r.w64[w, RW_PAGE_SIZE]
    n_lock = min(cap, chunk_end) // ps
    _ensure_keys(rq, wl, q, n_lock, ps, scratch_tokens)
    k0 = rq.i64[q, RQ_LEASE_OFF]
    if cfg.i64[w, CFG_PREFIX_CACHING] != 0:
        # every one of the n_lock pages is in the tree: the admission step matched
        # them (cap = that match) and nothing changed the tree since
        matched, last = rx.match_lock_known(r, w, rq.seq_hash, k0, n_lock)
        if last < 0:
            return -2
    else:
        matched, last = 0, rx.root(r, w)
    prefix = matched * ps
    req_pages = ceil_div(chunk_end, ps) - matched
    if req_pages * ps > rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE]:
        rx.dec_lock(r, w, last)
        return -1
    _evict_for(r, w, req_pages * ps)
    # the lease's first ``matched`` entries are the tree's pages on last's path: never
    # read (everything below SG_CACHED is the tree's business), so not written
    if not _take_pages(r, rq, w, q, matched, req_pages):
        return -2
    rq.i64[q, RQ_SG_CACHED] = prefix
    rq.i64[q, RQ_SG_LAST] = last
    return prefix


@kernel(cache=True, _nrt=False)
def extend_allocation(r, rq, w, q, chunk_end):
    """§4.2: pages for a chunk continuation. 0 ok, -1 does not fit, -2 no slots."""
    ps = r.w64[w, RW_PAGE_SIZE]
    have = rq.i64[q, RQ_ALLOCATED] // ps
    new_pages = ceil_div(chunk_end, ps) - have
    if new_pages <= 0:
        return 0
    if new_pages * ps > rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE]:
        return -1
    _evict_for(r, w, new_pages * ps)
    if not _take_pages(r, rq, w, q, have, new_pages):
        return -2
    return 0


@kernel(cache=True, _nrt=False)
def _adopt_tree_pages(r, rq, w, q, node, lo, hi, path):
    """Where the tree's page on ``node``'s path differs from q's lease page in page
    positions [lo, hi), free q's page and take the tree's (canonicalize)."""
    depth = rx.path_pages(r, w, node, path, 0, lo)
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for j in range(lo, min(hi, depth)):
        if path[j] != rq.lease[k0 + j]:
            rx.page_free(r, w, rq.lease[k0 + j])
            rq.lease[k0 + j] = path[j]


@kernel(cache=True, _nrt=False, inline="always")
def _log_insert(r, rq, w, end, q, hi, n_keys, scratch_tokens):
    """KV events of an insert of q's pages up to ``hi`` (``n_keys`` of them offered):
    the ones the tree did not hold yet are Stored."""
    if rx.kv_logged(r, w) and end >= 0:
        n_new = n_keys - r.w64[w, RW_INSERT_SHARED]
        if n_new > 0:
            rx.log_inserted(r, w, end, q, hi - n_new, n_new, scratch_tokens,
                            rq.i64[q, RQ_SESSION_ROW] != 0)


@kernel(cache=True, _nrt=False)
def cache_prefix(cfg, r, rq, wl, w, q, path, scratch_tokens):
    """§4.3: the materialized complete pages beyond the cached prefix enter the tree."""
    cache_prefix_through(cfg, r, rq, wl, w, q, rq.i64[q, RQ_NUM_COMPUTED], path, scratch_tokens)


@kernel(cache=True, _nrt=False)
def cache_prefix_through(cfg, r, rq, wl, w, q, through, path, scratch_tokens):
    """The complete pages of q's first ``through`` tokens beyond its cached prefix
    enter the tree (``cache_prefix`` at what a forward materialized)."""
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return
    ps = r.w64[w, RW_PAGE_SIZE]
    aligned = (through // ps) * ps
    cached = rq.i64[q, RQ_SG_CACHED]
    if aligned == 0 or aligned <= cached:
        return
    lo, hi = cached // ps, aligned // ps
    _ensure_keys(rq, wl, q, hi, ps, scratch_tokens)
    k0 = rq.i64[q, RQ_LEASE_OFF]
    last = rq.i64[q, RQ_SG_LAST]
    new_last = rx.insert(r, w, last, rq.seq_hash, k0 + lo, hi - lo, rq.lease, k0 + lo)
    _log_insert(r, rq, w, new_last, q, hi, hi - lo, scratch_tokens)
    if new_last != last:
        rx.inc_lock(r, w, new_last)
        if r.w64[w, RW_INSERT_SHARED] > 0:  # else the tree took every page given
            _adopt_tree_pages(r, rq, w, q, new_last, lo, hi, path)
        rx.dec_lock(r, w, last)
    rq.i64[q, RQ_SG_LAST] = new_last
    rq.i64[q, RQ_SG_CACHED] = aligned


@kernel(cache=True, _nrt=False)
def finish_kv(cfg, r, rq, wl, w, q, path, scratch_tokens):
    """§4.4: a finished request's complete pages enter the tree, the rest of its
    lease goes back to the pool, its lock is released."""
    ps = r.w64[w, RW_PAGE_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    n_pages = rq.i64[q, RQ_ALLOCATED] // ps
    last = rq.i64[q, RQ_SG_LAST]
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        for j in range(n_pages):
            rx.page_free(r, w, rq.lease[k0 + j])
        rx.dec_lock(r, w, last)
    else:
        seq_aligned = (_seq(rq, q) // ps) * ps
        complete = (min(seq_aligned, rq.i64[q, RQ_NUM_COMPUTED]) // ps) * ps
        c_pages = complete // ps
        for j in range(c_pages, n_pages):
            rx.page_free(r, w, rq.lease[k0 + j])
        if complete == 0:
            rx.dec_lock(r, w, last)
        else:
            lo = rq.i64[q, RQ_SG_CACHED] // ps
            _ensure_keys(rq, wl, q, c_pages, ps, scratch_tokens)
            new_last = rx.insert(r, w, last, rq.seq_hash, k0 + lo, c_pages - lo, rq.lease, k0 + lo)
            _log_insert(r, rq, w, new_last, q, c_pages, c_pages - lo, scratch_tokens)
            if r.w64[w, RW_INSERT_SHARED] > 0:
                # lease pages the tree did not take are duplicates: back to the pool
                depth = rx.path_pages(r, w, new_last, path, 0, lo)
                for j in range(lo, min(c_pages, depth)):
                    if path[j] != rq.lease[k0 + j]:
                        rx.page_free(r, w, rq.lease[k0 + j])
            rx.dec_lock(r, w, last)
    rq.i64[q, RQ_SG_LAST] = -1
    rq.i64[q, RQ_SG_CACHED] = 0


@kernel(cache=True, _nrt=False)
def release_on_retraction(r, rq, w, q):
    """§4.5: the pages beyond the cached prefix go back, the lock is released; the
    request keeps its keys and generated tokens and is recomputed later."""
    ps = r.w64[w, RW_PAGE_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for j in range(rq.i64[q, RQ_SG_CACHED] // ps, rq.i64[q, RQ_ALLOCATED] // ps):
        rx.page_free(r, w, rq.lease[k0 + j])
    rx.dec_lock(r, w, rq.i64[q, RQ_SG_LAST])
    rq.i64[q, RQ_SG_LAST] = -1
    rq.i64[q, RQ_SG_CACHED] = 0
    rq.i64[q, RQ_NUM_COMPUTED] = 0
    rq.i64[q, RQ_ALLOCATED] = 0


@kernel(cache=True, _nrt=False)
def drop_queued(r, rq, wk, w, q):
    """CancelRequest of q on SGLang worker w: out of the running list or the waiting
    queue, its lease aborted like a retraction's (pages beyond the cached prefix
    freed, the lock released: the prefix already in the tree stays, evictable).
    Returns -1 when q is in neither, else whether capacity moved (a freed page or a
    released lock), which bumps the rank's capacity generation."""
    off = wk.i64[w, WK_RUN_OFF]
    found = False
    for j in range(wk.i64[w, WK_RUN_LEN]):
        if wk.run_q[off + j] == q:
            run_remove_at(wk, w, j)
            found = True
            break
    if not found:
        for j in range(wk.i64[w, WK_WAIT_LEN]):
            if wait_at(wk, w, j) == q:
                wait_remove_at(wk, w, j)
                found = True
                break
    if not found:
        return -1
    ps = r.w64[w, RW_PAGE_SIZE]
    moved = rq.i64[q, RQ_ALLOCATED] // ps > rq.i64[q, RQ_SG_CACHED] // ps \
        or (rq.i64[q, RQ_SG_LAST] >= 0 and rq.i64[q, RQ_SG_LAST] != rx.root(r, w))
    release_on_retraction(r, rq, w, q)
    return 1 if moved else 0


# ---------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def _finish(cfg, p, rq, wl, wk, w, q, path, scratch_tokens):
    """q completes in this pass. A disaggregated prefill (source) request keeps its
    lease instead - its KV is held for the decode side until ReleaseSource - and its
    terminal-list entry is the SourceHeld event of the pass."""
    held = cfg.i64[w, CFG_ROLE] == ROLE_PREFILL
    if held:
        rq.i64[q, RQ_STATUS] = RS_HELD
    else:
        finish_kv(cfg, p.radix, rq, wl, w, q, path, scratch_tokens)
        wk.i64[w, WK_CAP_GEN] += 1
        rq.i64[q, RQ_STATUS] = RS_DONE
        rq.i64[q, RQ_TERMINAL] = TERM_COMPLETED
    if event_log_on(p):
        # a held source's finish is noted as held (no terminal), as vLLM's is
        note_event(p, w, EV_FINISHED, q, np.int64(TERM_NONE if held else TERM_COMPLETED), rq.i64[q, RQ_GENERATED])
    push_terminal(rq, wk, w, q)


@kernel(cache=True, _nrt=False)
def _finish_done(cfg, p, rq, wl, wk, w, first, path, scratch_tokens):
    """Finish, in running order, the requests from running index ``first`` on that have
    nothing left to generate; the others keep their order."""
    off = wk.i64[w, WK_RUN_OFF]
    keep = first
    for j in range(first, wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if _remaining(rq, q) == 0:
            _finish(cfg, p, rq, wl, wk, w, q, path, scratch_tokens)
        else:
            wk.run_q[off + keep] = q
            keep += 1
    wk.i64[w, WK_RUN_LEN] = keep


@kernel(cache=True, _nrt=False, inline="always")
def _count_token(rq, q, stamp):
    """Under the host loop: q's next token, counted now (the scheduler's state has it)
    and timed when the forward that gives it is observed (``_observe_forward``)."""
    rq.i64[q, RQ_GENERATED] += 1
    rq.i64[q, RQ_HL_TOKENS_PENDING] += 1
    rq.i64[q, RQ_HL_TOKEN_STAMP] = stamp


@kernel(cache=True, _nrt=False)
def _observe_forward(cfg, p, rq, wl, wk, sims, s, w, stamp, end_ms, path, scratch_tokens):
    """The host loop observes the forward in flight at ``end_ms``, the end of the pass
    with ``stamp`` (kernels.sglang.host_loop): its tokens get their time, in batch
    order (the running order now: retractions since took theirs back), the prefixes
    it materialized enter the radix tree, then the requests it gave their last token
    finish; the others keep their order."""
    off = wk.i64[w, WK_RUN_OFF]
    log_outputs = outputs_logged(p, s)
    run_gap = 0.0
    run_count = 0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        pending = rq.i64[q, RQ_HL_TOKENS_PENDING]
        if pending == 2 or (pending == 1 and rq.i64[q, RQ_HL_TOKEN_STAMP] < stamp):
            g = rq.i64[q, RQ_GENERATED] - (pending - 1)  # the older pending token
            run_gap, run_count, _ = time_token(cfg, p, rq, wk, sims, s, w, q, g, end_ms, run_gap, run_count,
                                                log_outputs, g >= rq.i64[q, RQ_MAX_OUTPUT])
            rq.i64[q, RQ_HL_TOKENS_PENDING] = pending - 1
    fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], run_gap, run_count)
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if rq.i64[q, RQ_HL_COMMIT_STAMP] != 0 and rq.i64[q, RQ_HL_COMMIT_STAMP] < stamp:
            cache_prefix_through(cfg, p.radix, rq, wl, w, q, rq.i64[q, RQ_HL_COMMIT_THROUGH], path,
                                 scratch_tokens)
            rq.i64[q, RQ_HL_COMMIT_STAMP] = 0
    keep = 0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if rq.i64[q, RQ_HL_DONE_STAMP] != 0 and rq.i64[q, RQ_HL_DONE_STAMP] < stamp:
            rq.i64[q, RQ_HL_DONE_STAMP] = 0
            _finish(cfg, p, rq, wl, wk, w, q, path, scratch_tokens)
        else:
            wk.run_q[off + keep] = q
            keep += 1
    wk.i64[w, WK_RUN_LEN] = keep


# the host loop's calls, compiled only for batches that run it (kernels.features)
_hl_forward_end = gate("sglang_host_loop", hl.forward_end, 0.0)
_hl_iteration_end = gate("sglang_host_loop", hl.iteration_end, (0.0, False))
_hl_receive = gate("sglang_host_loop", hl.receive)
_hl_finished_in_batch = gate("sglang_host_loop", hl.finished_in_batch, np.int64(0))
_hl_observe_forward = gate("sglang_host_loop", _observe_forward)
_spec_accepted = gate("speculation", spec_sampler.accepted_tokens, np.int64(1))


# ---------------------------------------------------------------------------------
# an effect-free zero-duration pass: the reference's same-timestamp retries
# ---------------------------------------------------------------------------------
MAX_SAME_TIMESTAMP_RETRIES = 1024  # the reference's bound on consecutive retries


@kernel(cache=True, _nrt=False)
def effect_free_pass_gives_up(cfg, wk, w):
    """Worker w's pass changed nothing and took no time while it still holds work.
    The reference runs such a pass again at the same instant for as long as the pass
    changes the new-token ratio (a pass that forms no prefill batch decays it one
    step, even with nothing running), and gives up on the run when that happened
    MAX_SAME_TIMESTAMP_RETRIES times in a row. Applies those decays; returns whether
    the reference gives up (else the ratio now sits at its floor, where a pass no
    longer changes it)."""
    ratio = _ratio(wk, w)
    floor = cfg.f64[w, CFGF_SG_MIN_RATIO]
    step = cfg.f64[w, CFGF_SG_DECAY_STEP]
    for _ in range(MAX_SAME_TIMESTAMP_RETRIES):
        decayed = max(ratio - step, floor)
        if decayed == ratio:
            _set_ratio(wk, w, ratio)
            return False
        ratio = decayed
    _set_ratio(wk, w, ratio)
    return True


# what a rank's pass did, for its attention-DP group's end (WK_SG_PASS_FLAGS)
PASS_PREFILLED = 1
PASS_MODEL_WORK = 2
PASS_INTERVAL_IDLE = 4


@kernel(cache=True, _nrt=False)
def finish_group_pass(cfg, wk, lead, dp):
    """The end of an attention-DP group pass for every rank of the group, idle ones
    included (the reference's synchronized EXTEND signal): ``prefill_decode_interval``
    counts group passes, restarting when any rank prefilled; a rank whose deferred pass
    had nothing to decode goes back to its initial new-token ratio only when no rank
    of the group ran the model."""
    any_prefilled = False
    any_model = False
    for w in range(lead, lead + dp):
        any_prefilled = any_prefilled or (wk.i64[w, WK_SG_PASS_FLAGS] & PASS_PREFILLED) != 0
        any_model = any_model or (wk.i64[w, WK_SG_PASS_FLAGS] & PASS_MODEL_WORK) != 0
    for w in range(lead, lead + dp):
        if (wk.i64[w, WK_SG_PASS_FLAGS] & PASS_INTERVAL_IDLE) != 0 and not any_model:
            _set_ratio(wk, w, cfg.f64[w, CFGF_SG_INIT_RATIO])
        rounds = wk.i64[w, WK_SG_PREFILL_ROUNDS]
        wk.i64[w, WK_SG_PREFILL_ROUNDS] = cfg.i64[w, CFG_SG_PD_INTERVAL] if any_prefilled \
            else max(rounds - 1, 0)
        wk.i64[w, WK_SG_PASS_FLAGS] = 0


@kernel(cache=True, _nrt=False)
def worker_in_flight(rq, sims, s, w):
    """Requests worker w holds as the reference's replay counts them for a worker:
    taken by a submit or an accepted destination and not yet completed (a held
    source no longer counts)."""
    n = 0
    for q in range(sims.i64[s, SM_Q_OFF], sims.i64[s, SM_Q_OFF] + sims.i64[s, SM_Q_LEN]):
        st = rq.i64[q, RQ_STATUS]
        if rq.i64[q, RQ_WORKER] == w and st != RS_DONE and st != RS_NOT_ARRIVED and st != RS_HELD:
            n += 1
    p0 = sims.i64[s, SM_PREFILL_Q_OFF]
    if p0 >= 0:
        for q in range(p0, p0 + sims.i64[s, SM_Q_LEN]):
            st = rq.i64[q, RQ_STATUS]
            if rq.i64[q, RQ_WORKER] == w and (st == RS_WAITING or st == RS_RUNNING or st == RS_PREEMPTED):
                n += 1
    return n


# ---------------------------------------------------------------------------------
# the ready list of a decode rank: activated destinations waiting for a running slot
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def ready_remove(rq, wk, w, q):
    """Take q out of w's ready list; False when it is not there."""
    prev = -1
    cur = wk.i64[w, WK_SG_READY_HEAD]
    while cur >= 0 and cur != q:
        prev = cur
        cur = rq.i64[cur, RQ_SG_READY_NEXT]
    if cur < 0:
        return False
    nxt = rq.i64[q, RQ_SG_READY_NEXT]
    if prev < 0:
        wk.i64[w, WK_SG_READY_HEAD] = nxt
    else:
        rq.i64[prev, RQ_SG_READY_NEXT] = nxt
    if wk.i64[w, WK_SG_READY_TAIL] == q:
        wk.i64[w, WK_SG_READY_TAIL] = prev
    rq.i64[q, RQ_SG_READY_NEXT] = -1
    wk.i64[w, WK_SG_READY_LEN] -= 1
    return True



@kernel(cache=True, _nrt=False)
def ready_push(rq, wk, w, q):
    """q (activated, prompt KV resident) joins the back of w's ready list."""
    rq.i64[q, RQ_SG_READY_NEXT] = -1
    tail = wk.i64[w, WK_SG_READY_TAIL]
    if tail < 0:
        wk.i64[w, WK_SG_READY_HEAD] = q
    else:
        rq.i64[tail, RQ_SG_READY_NEXT] = q
    wk.i64[w, WK_SG_READY_TAIL] = q
    wk.i64[w, WK_SG_READY_LEN] += 1


@kernel(cache=True, _nrt=False)
def promote_ready(cfg, p, rq, wl, wk, w, now_ms, path, scratch_tokens):
    """The reference's ``promote_prebuilt_ready``: activated requests join the running
    batch in activation order while running slots remain, each an admission with no
    reused tokens (its prompt came over the transfer); its prompt's complete pages
    enter the tree now (``cache_prefix``: duplicates of pages the tree has go back).
    A promotion starts a capacity generation, so the pending head is tried again at
    the pass end (reference runs e1, e8: a destination that fits once an activated
    prompt is in the tree is reserved at the end of the pass that promoted it).
    Returns how many."""
    n = 0
    while wk.i64[w, WK_SG_READY_LEN] > 0 and wk.i64[w, WK_RUN_LEN] < cfg.i64[w, CFG_MAX_NUM_SEQS]:
        q = wk.i64[w, WK_SG_READY_HEAD]
        wk.i64[w, WK_SG_READY_HEAD] = rq.i64[q, RQ_SG_READY_NEXT]
        wk.i64[w, WK_SG_READY_LEN] -= 1
        if wk.i64[w, WK_SG_READY_LEN] == 0:
            wk.i64[w, WK_SG_READY_TAIL] = -1
        rq.i64[q, RQ_SG_READY_NEXT] = -1
        rq.i64[q, RQ_ADMISSIONS] += 1
        if rq.i64[q, RQ_FIRST_CACHED] < 0:
            rq.i64[q, RQ_FIRST_CACHED] = 0
            rq.f64[q, RQF_FIRST_ADMIT_MS] = now_ms
        rq.i64[q, RQ_STATUS] = RS_RUNNING
        run_push_back(wk, w, q)
        if event_log_on(p):
            note_event(p, w, EV_ADMITTED, q, np.int64(0), rq.i64[q, RQ_ADMISSIONS])
        cache_prefix(cfg, p.radix, rq, wl, w, q, path, scratch_tokens)
        n += 1
    if n > 0:
        wk.i64[w, WK_CAP_GEN] += 1
    return n


# ---------------------------------------------------------------------------------
# longest-prefix-match order (§7)
# ---------------------------------------------------------------------------------
LPM_MAX_WAITING = 128    # longer queues keep their fifo order
LPM_SHORT_PREFIX = 32    # tokens: a request matching at most this much ...
LPM_DUP_TOKENS = 32      # ... whose leading pages an earlier one shares goes last


@kernel(cache=True, _nrt=False)
def lpm_order(cfg, r, rq, wl, wk, w, scratch_tokens):
    """Reorder the waiting queue by the longest cached prefix (read-only matches of
    every complete page of each sequence), stable; a request with a short match whose
    leading pages an earlier request in the scan already showed is deprioritized."""
    n = wk.i64[w, WK_WAIT_LEN]
    if n < 2 or n > LPM_MAX_WAITING or cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return
    ps = r.w64[w, RW_PAGE_SIZE]
    dup_pages = ceil_div(LPM_DUP_TOKENS, ps)
    for i in range(n):
        q = wait_at(wk, w, i)
        seq = _seq(rq, q)
        n_keys = seq // ps
        _ensure_keys(rq, wl, q, n_keys, ps, scratch_tokens)
        k0 = rq.i64[q, RQ_LEASE_OFF]
        prefix = rx.match_readonly(r, w, rq.seq_hash, k0, n_keys) * ps
        deprioritized = 0
        rq.i64[q, RQ_SG_LPM_RECORDED] = 0
        if prefix <= LPM_SHORT_PREFIX and seq >= dup_pages * ps:
            for j in range(i):
                e = wait_at(wk, w, j)
                if rq.i64[e, RQ_SG_LPM_RECORDED] == 1:
                    e0 = rq.i64[e, RQ_LEASE_OFF]
                    same = True
                    for k in range(dup_pages):
                        if rq.seq_hash[e0 + k] != rq.seq_hash[k0 + k]:
                            same = False
                            break
                    if same:
                        deprioritized = 1
                        break
            if deprioritized == 0:
                rq.i64[q, RQ_SG_LPM_RECORDED] = 1
        rq.i64[q, RQ_SG_LPM_KEY] = deprioritized * (np.int64(1) << 40) - prefix
    # stable insertion sort of the ring by key
    for i in range(1, n):
        x = wait_at(wk, w, i)
        key = rq.i64[x, RQ_SG_LPM_KEY]
        j = i - 1
        while j >= 0 and rq.i64[wait_at(wk, w, j), RQ_SG_LPM_KEY] > key:
            _wait_set(wk, w, j + 1, wait_at(wk, w, j))
            j -= 1
        _wait_set(wk, w, j + 1, x)


@kernel(cache=True, _nrt=False, inline="always")
def _wait_set(wk, w, i, q):
    wk.wait_q[wk.i64[w, WK_WAIT_OFF] + (wk.i64[w, WK_WAIT_HEAD] + i) % wk.i64[w, WK_WAIT_CAP]] = q


# ---------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False)
def _admit(cfg, p, rq, wl, wk, w, now_ms, acc, path, scratch_tokens):
    """§5: the prefill batch. Admitted requests are appended to the running list (the
    one whose chunk stops short goes back to the waiting front); acc[ACC_BATCH] batch size,
    acc[ACC_ISL] total isl, acc[ACC_PREFIX] total prefix, acc[ACC_ADMITTED] first admissions. Returns False
    when the page slots ran out."""
    r = p.radix
    slots = max(0, cfg.i64[w, CFG_MAX_NUM_SEQS] - wk.i64[w, WK_RUN_LEN])
    if slots == 0 or wk.i64[w, WK_WAIT_LEN] == 0:
        return True  # nothing to admit (and no budget to work out over the running batch)
    ps = r.w64[w, RW_PAGE_SIZE]
    ratio = _ratio(wk, w)
    clip = cfg.i64[w, CFG_SG_CLIP]
    off = wk.i64[w, WK_RUN_OFF]
    reserved = 0.0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        reserved += float(min(_remaining(rq, wk.run_q[off + j]), clip)) * ratio
    rem_total = float(rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE]) - reserved
    rem_input = float(cfg.i64[w, CFG_SG_MAX_PREFILL_TOKENS])
    rem_chunk = float(cfg.i64[w, CFG_SG_CHUNK_SIZE])
    caching = cfg.i64[w, CFG_PREFIX_CACHING] != 0
    partial = -1
    while acc[ACC_BATCH] < slots and wk.i64[w, WK_WAIT_LEN] > 0:
        q = wait_at(wk, w, 0)
        seq = _seq(rq, q)
        mat = rq.i64[q, RQ_NUM_COMPUTED]
        cached_prefix = 0
        if mat == 0 and caching:
            cap_len = seq if rq.i64[q, RQ_MAX_OUTPUT] == 0 else seq - 1
            n_keys = cap_len // ps
            _ensure_keys(rq, wl, q, n_keys, ps, scratch_tokens)
            cached_prefix = rx.match_readonly(r, w, rq.seq_hash, rq.i64[q, RQ_LEASE_OFF], n_keys) * ps
        start = max(mat, cached_prefix)
        extend = seq - start
        if extend == 0 and mat > 0:
            break
        if float(ceil_div(extend, ps) * ps) <= rem_chunk:
            chunk = extend
        else:
            chunk = (np.int64(rem_chunk) // ps) * ps
            if chunk == 0:
                break
            chunk = min(chunk, extend)
        charged = float(ceil_div(chunk, ps) * ps)
        out_res = 0.0 if chunk < extend else float(min(_remaining(rq, q), clip))
        if charged + out_res >= rem_total or charged > rem_input or charged > rem_chunk:
            break
        chunk_end = start + chunk
        if mat == 0:
            prefix = first_allocation(cfg, r, rq, wl, w, q, chunk_end, start, path, scratch_tokens)
            if prefix == -2:
                return False
            if prefix < 0:
                break
        else:
            res = extend_allocation(r, rq, w, q, chunk_end)
            if res == -2:
                return False
            if res < 0:
                break
            prefix = mat
        wait_remove_at(wk, w, 0)
        rq.i64[q, RQ_NUM_COMPUTED] = chunk_end
        rq.i64[q, RQ_ALLOCATED] = ceil_div(chunk_end, ps) * ps
        rq.i64[q, RQ_COMMITTED_PREFILL] += chunk_end - prefix
        if mat == 0:  # an admission (a re-admission after a retraction too)
            rq.i64[q, RQ_ADMISSIONS] += 1
            if rq.i64[q, RQ_FIRST_CACHED] < 0:
                rq.i64[q, RQ_FIRST_CACHED] = prefix
                rq.f64[q, RQF_FIRST_ADMIT_MS] = now_ms
            rq.i64[q, RQ_MAX_CACHED] = max(rq.i64[q, RQ_MAX_CACHED], prefix)
            acc[ACC_ADMITTED] += 1
            if event_log_on(p):
                note_event(p, w, EV_ADMITTED, q, prefix, rq.i64[q, RQ_ADMISSIONS])
        rq.i64[q, RQ_STATUS] = RS_RUNNING
        acc[ACC_BATCH] += 1
        acc[ACC_ISL] += chunk_end
        acc[ACC_PREFIX] += prefix
        rem_total -= charged + out_res
        rem_input -= charged
        rem_chunk -= charged
        if chunk < extend:
            partial = q
            break
        run_push_back(wk, w, q)
        if rem_chunk <= 0.0:
            break
    if partial >= 0:
        cache_prefix(cfg, r, rq, wl, w, partial, path, scratch_tokens)
        wait_push_front(wk, w, partial)
    return True


@kernel(cache=True, _nrt=False, inline="always")
def _retract_before(rq, a, b):
    """a sorts before b for retraction: more generated tokens, then a shorter prompt
    (victims come off the end)."""
    ga, gb = rq.i64[a, RQ_GENERATED], rq.i64[b, RQ_GENERATED]
    return ga > gb or (ga == gb and rq.i64[a, RQ_PROMPT_LEN] < rq.i64[b, RQ_PROMPT_LEN])


@kernel(cache=True, _nrt=False)
def _sort_for_retraction(rq, wk, w):
    """The reference's retract_decode: the running batch sorted (stable) so that the
    victims - fewest generated tokens, then the longest prompt, then the last such -
    come off its end; the survivors keep the sorted order afterwards."""
    off = wk.i64[w, WK_RUN_OFF]
    for i in range(1, wk.i64[w, WK_RUN_LEN]):
        x = wk.run_q[off + i]
        j = i - 1
        while j >= 0 and _retract_before(rq, x, wk.run_q[off + j]):
            wk.run_q[off + j + 1] = wk.run_q[off + j]
            j -= 1
        wk.run_q[off + j + 1] = x


@kernel(cache=True, _nrt=False)
def _decode_need(r, rq, wk, w, burst):
    """(tokens the running batch's next tokens need beyond their pages, the batch's
    sequence tokens): the decode step's memory need and its timing input, in one
    walk of the running list. ``burst``: tokens a request may emit in the step (1; a
    speculating rank's nextn + 1, capped by what each has left)."""
    ps = r.w64[w, RW_PAGE_SIZE]
    off = wk.i64[w, WK_RUN_OFF]
    need = 0
    kv = 0
    if ps == 1:  # no page rounding (and no division per request and pass)
        for j in range(wk.i64[w, WK_RUN_LEN]):
            q = wk.run_q[off + j]
            seq = _seq(rq, q)
            kv += seq
            need += max(0, seq + min(burst, _remaining(rq, q)) - rq.i64[q, RQ_ALLOCATED])
        return need, kv
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        seq = _seq(rq, q)
        kv += seq
        grow = ceil_div(seq + min(burst, _remaining(rq, q)), ps) * ps - rq.i64[q, RQ_ALLOCATED]
        need += max(0, grow)
    return need, kv


@kernel(cache=True, _nrt=False, inline="always")
def _add_token_slot(r, rq, w, q):
    """Room for q's next token: a page when its pages are full. False: no slot left."""
    ps = r.w64[w, RW_PAGE_SIZE]
    mat = rq.i64[q, RQ_NUM_COMPUTED]
    if ps == 1:  # every token its page (no division per emitted token)
        b = rx.page_alloc(r, w)
        if b < 0:
            return False
        rq.lease[rq.i64[q, RQ_LEASE_OFF] + mat] = b
    elif mat % ps == 0:
        b = rx.page_alloc(r, w)
        if b < 0:
            return False
        rq.lease[rq.i64[q, RQ_LEASE_OFF] + mat // ps] = b
    if _seq(rq, q) + 1 > rq.i64[q, RQ_ALLOCATED]:
        rq.i64[q, RQ_ALLOCATED] += ps
    return True


@kernel(cache=True, _nrt=False)
def run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """One pass of SGLang worker w from ``now_ms``: ``(end_ms, had_effect, arena_full)``.
    Under the host loop (kernels.sglang.host_loop) the pass is one scheduler iteration:
    its tokens are timed at its forward's end, requests it finishes stay in the batch
    until the next pass observes the forward, and the pass ends when the previous
    forward is observed."""
    r = p.radix
    wk.i64[w, WK_PASS_STAMP] += 1
    host_loop = cfg.i64[w, CFG_SG_HOST_LOOP] != 0
    stamp = wk.i64[w, WK_PASS_STAMP]
    launched = False  # the host loop: this pass launched a forward (ending at tok_ms)
    tok_ms = now_ms
    if host_loop:
        _hl_receive(cfg.features, rq, wk, w, now_ms)
    ps = r.w64[w, RW_PAGE_SIZE]
    for i in range(acc.shape[0]):
        acc[i] = 0
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    path = hits
    n_rejected = 0
    # 1. prompts at or past max_model_len are rejected (their outputs at the pass end)
    if limit >= 0:
        j = 0
        while j < wk.i64[w, WK_WAIT_LEN]:
            q = wait_at(wk, w, j)
            if rq.i64[q, RQ_PROMPT_LEN] >= limit and rq.i64[q, RQ_NUM_COMPUTED] == 0:
                wait_remove_at(wk, w, j)
                rq.i64[q, RQ_STATUS] = RS_DONE
                rq.i64[q, RQ_TERMINAL] = TERM_REJECTED
                if event_log_on(p):
                    note_event(p, w, EV_FINISHED, q, np.int64(TERM_REJECTED), rq.i64[q, RQ_GENERATED])
                push_terminal(rq, wk, w, q)
                n_rejected += 1
                continue
            j += 1
    # a decode rank: activated destinations join the running batch first (they are
    # already in it when a prefill batch stalls the running requests)
    n_promoted = promote_ready(cfg, p, rq, wl, wk, w, now_ms, path, scratch_tokens) \
        if wk.i64[w, WK_SG_READY_LEN] > 0 else 0
    acc[ACC_ADMITTED] += n_promoted
    if cfg.i64[w, CFG_SG_LPM] != 0:
        lpm_order(cfg, r, rq, wl, wk, w, scratch_tokens)
    prev = wk.i64[w, WK_RUN_LEN]
    # prefill_decode_interval (engine.md 7.8): after a pass that computed prefill tokens,
    # the next `interval` passes form no prefill batch, chunk continuations included
    rounds = wk.i64[w, WK_SG_PREFILL_ROUNDS]
    defer_prefill = rounds > 0
    # no fresh prefill batch either while activated requests still wait for a slot or
    # a destination is pending (not yet reserved) on this rank (engine.md 10.3)
    fresh_kv = wk.i64[w, WK_SG_READY_LEN] == 0 and wk.i64[w, WK_PEND_LEN] == 0
    if fresh_kv and not defer_prefill \
            and not _admit(cfg, p, rq, wl, wk, w, now_ms, acc, path, scratch_tokens):
        return now_ms, True, True
    b = acc[ACC_BATCH]
    # a deferred pass with nothing to decode is idle: it does not decay the ratio, and
    # (no model work) resets it to its initial value
    interval_idle = False
    if defer_prefill:
        interval_idle = True
        for j in range(wk.i64[w, WK_RUN_LEN]):
            if _remaining(rq, wk.run_q[wk.i64[w, WK_RUN_OFF] + j]) > 0:
                interval_idle = False
                break
    run_gap = 0.0
    run_count = 0
    log_outputs = outputs_logged(p, s)
    n_tokens = 0
    n_retracted = 0
    off = wk.i64[w, WK_RUN_OFF]
    dc_n = 0
    dc_kv = 0
    if b > 0:
        # prefill-only pass: the running requests before the new ones wait. A decode
        # worker charges no prefill time (a retracted request's recompute there is free)
        if cfg.i64[w, CFG_ROLE] == ROLE_DECODE:
            end_ms = now_ms + 0.0
        else:
            end_ms = now_ms + ns_to_ms(prefill_ns(cfg, w, b, acc[ACC_ISL], acc[ACC_PREFIX]))
        tok_ms = end_ms
        if host_loop:
            tok_ms = _hl_forward_end(cfg.features, wk, w, now_ms, end_ms)
            launched = True
        n_run = wk.i64[w, WK_RUN_LEN]
        # §6.2 first tokens of the newly prefilled requests, in order
        prefill_role = cfg.i64[w, CFG_ROLE] == ROLE_PREFILL
        need = 0
        for j in range(prev, n_run):
            q = wk.run_q[off + j]
            if _remaining(rq, q) > 1:
                need += ceil_div(_seq(rq, q) + 1, ps) * ps - rq.i64[q, RQ_ALLOCATED]
        _evict_for(r, w, need)
        reserved_ok = rx.available_tokens(r, w) >= need
        for j in range(prev, n_run):
            q = wk.run_q[off + j]
            rem = _remaining(rq, q)
            if rem == 0:
                if host_loop:  # it leaves the batch when the forward is observed
                    rq.i64[q, RQ_HL_DONE_STAMP] = stamp
                continue  # terminal without a token
            if rem == 1:  # its only token is its last: no KV slot for it
                if prefill_role:
                    # a disaggregated source: its prefilled prompt enters the tree now
                    # and stays locked while the source is held (reference run
                    # sx-pd-seqs: a held prompt is a prefix hit for later prefills)
                    cache_prefix(cfg, r, rq, wl, w, q, path, scratch_tokens)
                if host_loop:
                    _count_token(rq, q, stamp)
                    rq.i64[q, RQ_HL_DONE_STAMP] = stamp
                else:
                    run_gap, run_count, _ = emit_token(cfg, p, rq, wk, sims, s, w, q, tok_ms, run_gap,
                                                     run_count, log_outputs, _remaining(rq, q) == 1)
                n_tokens += 1
                continue
            if reserved_ok:
                if not _add_token_slot(r, rq, w, q):
                    return now_ms, True, True
                # the prefilled sequence enters the tree before the token is appended
                # (under the host loop when the forward is observed)
                if host_loop:
                    rq.i64[q, RQ_HL_COMMIT_STAMP] = stamp
                    rq.i64[q, RQ_HL_COMMIT_THROUGH] = rq.i64[q, RQ_NUM_COMPUTED]
                else:
                    cache_prefix(cfg, r, rq, wl, w, q, path, scratch_tokens)
                rq.i64[q, RQ_NUM_COMPUTED] += 1
                if host_loop:
                    _count_token(rq, q, stamp)
                else:
                    run_gap, run_count, _ = emit_token(cfg, p, rq, wk, sims, s, w, q, tok_ms, run_gap,
                                                     run_count, log_outputs, _remaining(rq, q) == 1)
                n_tokens += 1
            elif host_loop:
                rq.i64[q, RQ_HL_COMMIT_STAMP] = stamp
                rq.i64[q, RQ_HL_COMMIT_THROUGH] = rq.i64[q, RQ_NUM_COMPUTED]
            else:
                cache_prefix(cfg, r, rq, wl, w, q, path, scratch_tokens)
        # then the completed ones finish, in completion order; the rest run on (under the
        # host loop they finish when the forward is observed)
        if not host_loop:
            _finish_done(cfg, p, rq, wl, wk, w, prev, path, scratch_tokens)
    elif wk.i64[w, WK_RUN_LEN] > 0:
        # §6.3 decode pass over every running request
        if not host_loop:
            _finish_done(cfg, p, rq, wl, wk, w, np.int64(0), path, scratch_tokens)
        # memory check and retraction (under the host loop, members whose last token is
        # in flight are past retraction: the check is over the others)
        n_done = _hl_finished_in_batch(cfg.features, rq, wk, w) if host_loop else 0
        # a speculating rank's verify pass may emit nextn + 1 tokens per request (kernels.spec)
        burst = cfg.i64[w, CFG_SPEC_NEXTN] + 1 if cfg.i64[w, CFG_ROLE] != ROLE_PREFILL else np.int64(1)
        while True:
            need, dc_kv = _decode_need(r, rq, wk, w, burst)
            if rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE] >= need \
                    or wk.i64[w, WK_RUN_LEN] - n_done <= 1:
                break
            if n_retracted == 0:
                _sort_for_retraction(rq, wk, w)
            idx = wk.i64[w, WK_RUN_LEN] - 1
            while rq.i64[wk.run_q[off + idx], RQ_HL_DONE_STAMP] != 0:
                idx -= 1
            v = wk.run_q[off + idx]
            # the pressure event (layout: PREEMPTED, PRESSURE, PRESSURE_SGLANG rows);
            # active blocks are the pages in use, cached ones included
            logged = event_log_on(p)
            request_blocks = ceil_div(rq.i64[v, RQ_ALLOCATED], ps)
            logical_available = (rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE]) // ps
            required = ceil_div(need, ps)
            if logged:
                note_event(p, w, EV_PREEMPTED, v, wk.i64[w, WK_RUN_LEN], r.w64[w, RW_PAGES_USED])
            run_remove_at(wk, w, idx)
            if host_loop:
                # the token the forward in flight sampled for it is neither delivered nor
                # kept, nor the prefix that forward would commit for it
                rq.i64[v, RQ_GENERATED] -= rq.i64[v, RQ_HL_TOKENS_PENDING]
                rq.i64[v, RQ_HL_TOKENS_PENDING] = 0
                rq.i64[v, RQ_HL_COMMIT_STAMP] = 0
            release_on_retraction(r, rq, w, v)
            if logged:
                note_event(p, w, EV_PRESSURE, request_blocks, r.w64[w, RW_PAGES_USED], np.int64(-1))
                note_event(p, w, EV_PRESSURE_SGLANG, logical_available, required, np.int64(0))
            rq.i64[v, RQ_STATUS] = RS_PREEMPTED
            rq.i64[v, RQ_PREEMPTIONS] += 1
            wk.i64[w, WK_PREEMPTIONS_TOTAL] += 1
            wk.i64[w, WK_CAP_GEN] += 1
            # to the waiting back in retraction order (nothing reads the queue before
            # the pass ends)
            wait_push_back(wk, w, v)
            n_retracted += 1
            floor_tokens = RETRACT_STEPS * wk.i64[w, WK_RUN_LEN]
            if rx.available_tokens(r, w) < floor_tokens:
                rx.evict(r, w, floor_tokens - rx.available_tokens(r, w))
        if n_retracted > 0:  # else the check above saw this very batch
            need, dc_kv = _decode_need(r, rq, wk, w, burst)
        _evict_for(r, w, need)
        n_run = wk.i64[w, WK_RUN_LEN]
        if n_retracted > 0:
            out_sum = 0.0
            max_sum = 0.0
            n_left = 0
            for j in range(n_run):
                q = wk.run_q[off + j]
                if rq.i64[q, RQ_HL_DONE_STAMP] != 0:
                    continue  # (host loop) past the check, as above
                out_sum += float(rq.i64[q, RQ_GENERATED])
                max_sum += float(rq.i64[q, RQ_MAX_OUTPUT])
                n_left += 1
            _set_ratio(wk, w, min(1.0, (out_sum + float(RETRACT_STEPS) * float(n_left)) / (max_sum + 1.0)))
        # (under the host loop, members whose last token is in flight are still in the
        # batch the step is timed over: reference runs, bit for bit)
        dc_n = n_run
        total_kv = cfg.i64[w, CFG_NUM_GPU_BLOCKS] * ps
        end_ms = (now_ms + 0.0 + 0.0) + ns_to_ms(decode_ns(cfg, w, dc_n, dc_kv, total_kv))
        reserved_ok = rx.available_tokens(r, w) >= need
        if not reserved_ok:
            end_ms = now_ms + 0.0 + 0.0
        tok_ms = end_ms
        if host_loop:  # ghost members alone still form a batch
            tok_ms = _hl_forward_end(cfg.features, wk, w, now_ms, end_ms)
            launched = True
        if reserved_ok:
            keep = 0
            for j in range(n_run):
                q = wk.run_q[off + j]
                if host_loop and rq.i64[q, RQ_HL_DONE_STAMP] != 0:
                    wk.run_q[off + keep] = q  # in the batch until its forward is observed
                    keep += 1
                    continue
                # a speculating rank's verify pass: the accepted tokens, each with its slot,
                # a page it completes entering the tree before the next is appended
                n_emit = 1 if burst == 1 else min(_spec_accepted(cfg.features, cfg, wk, w), _remaining(rq, q))
                for k in range(n_emit):
                    if k > 0:
                        cache_prefix(cfg, r, rq, wl, w, q, path, scratch_tokens)
                    if not _add_token_slot(r, rq, w, q):
                        return now_ms, True, True
                    rq.i64[q, RQ_NUM_COMPUTED] += 1
                    if host_loop:
                        _count_token(rq, q, stamp)
                    else:
                        run_gap, run_count, _ = emit_token(cfg, p, rq, wk, sims, s, w, q, tok_ms, run_gap,
                                                         run_count, log_outputs, _remaining(rq, q) == 1)
                    n_tokens += 1
                if rq.i64[q, RQ_GENERATED] >= rq.i64[q, RQ_MAX_OUTPUT] and not host_loop:
                    _finish(cfg, p, rq, wl, wk, w, q, path, scratch_tokens)
                else:
                    if rq.i64[q, RQ_GENERATED] >= rq.i64[q, RQ_MAX_OUTPUT]:
                        rq.i64[q, RQ_HL_DONE_STAMP] = stamp
                    wk.run_q[off + keep] = q
                    keep += 1
            wk.i64[w, WK_RUN_LEN] = keep
        if n_retracted == 0 and not interval_idle:
            _set_ratio(wk, w, max(_ratio(wk, w) - cfg.f64[w, CFGF_SG_DECAY_STEP],
                                  cfg.f64[w, CFGF_SG_MIN_RATIO]))
    else:
        end_ms = now_ms
    fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], run_gap, run_count)
    observed = False
    if host_loop:
        # the pass ends when the forward in flight is observed; what it gave the
        # scheduler (tokens, prefix commits, finished requests) becomes visible then
        end_ms, observed = _hl_iteration_end(cfg.features, wk, w, now_ms, launched, tok_ms)
        if observed:
            _hl_observe_forward(cfg.features, cfg, p, rq, wl, wk, sims, s, w, stamp, end_ms, path,
                                scratch_tokens)
            if b == 0 and dc_n == 0 and wk.i64[w, WK_RUN_LEN] == 0 and not launched and not interval_idle:
                # an iteration that only observed decays the ratio as any non-prefill one
                _set_ratio(wk, w, max(_ratio(wk, w) - cfg.f64[w, CFGF_SG_DECAY_STEP],
                                      cfg.f64[w, CFGF_SG_MIN_RATIO]))

    # every terminal of this pass becomes visible at its end
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        rq.f64[q, RQF_TERMINAL_MS] = end_ms
        q = rq.i64[q, RQ_TERM_NEXT]
    had_effect = b > 0 or n_tokens > 0 or n_rejected > 0 or n_retracted > 0 or n_promoted > 0 \
        or wk.i64[w, WK_TERM_HEAD] >= 0 or launched or observed
    prefilled = acc[ACC_ISL] - acc[ACC_PREFIX] > 0  # a fully cached zero-output admission is no prefill
    model_work = prefilled or (b == 0 and n_tokens > 0)
    if sims.i64[s, SM_GROUP_PASS] != 0:
        # an attention-DP rank: the group's end applies the interval over all its ranks
        wk.i64[w, WK_SG_PASS_FLAGS] = (PASS_PREFILLED if prefilled else 0) \
            | (PASS_MODEL_WORK if model_work else 0) | (PASS_INTERVAL_IDLE if interval_idle else 0)
    else:
        # one rank: its own synchronization domain (finish_group_pass of itself)
        if interval_idle and not model_work:
            _set_ratio(wk, w, cfg.f64[w, CFGF_SG_INIT_RATIO])
        interval = cfg.i64[w, CFG_SG_PD_INTERVAL]
        wk.i64[w, WK_SG_PREFILL_ROUNDS] = interval if prefilled else max(rounds - 1, 0)
    if not had_effect:
        # a pass of the countdown only: it changed the worker, logs no forward
        return end_ms, rounds > 0, False
    # KV events: the reference's SGLang rank reports the facts it buffered at the end
    # of a pass that ran a prefill batch, of every DECODE_LOG_INTERVAL-th pass without
    # one (counted from the run's start) and of a pass after which nothing runs
    # (SGLang's prefill / decode stats logging, which publishes its KV events)
    if b == 0:
        r.w64[w, RW_DECODE_PASSES] += 1
    if b > 0 or r.w64[w, RW_DECODE_PASSES] % DECODE_LOG_INTERVAL == 0 or wk.i64[w, WK_RUN_LEN] == 0:
        rx.report_kv(r, w, end_ms)
    if sims.i64[s, SM_PASS_LOG_LEN] < sims.pass_log.shape[1]:
        row = sims.i64[s, SM_PASS_LOG_LEN]
        pf_kv = acc[ACC_PREFIX]
        append_pass_row(p, wk, sims, s, w, now_ms, end_ms, b, acc[ACC_ISL] - pf_kv, pf_kv, acc[ACC_ISL] - pf_kv,
                        np.int64(dc_n), np.int64(dc_kv), acc[ACC_ADMITTED], np.int64(n_retracted),
                        np.int64(n_tokens), np.int64(dc_n), np.int64(dc_kv))
        evictable_pages = r.w64[w, RW_EVICTABLE] // ps
        sims.pass_log[s, row, PL_ACTIVE_BLOCKS] = r.w64[w, RW_PAGES_USED] - evictable_pages
        sims.pass_log[s, row, PL_INACTIVE_BLOCKS] = evictable_pages
    return end_ms, had_effect, False
