"""The vLLM scheduler core: one forward pass of a rank (``scheduler/vllm/core.rs`` of
the reference; behaviour as verified in spec/engine.md §5, §6, §14). vLLM and
TRT-LLM both run it; where they differ (admission, rejection, preemption, the
prefix cap, destination reservation) it asks the worker's capacity policy
(``vllm.capacity``: ``vllm.policy`` or ``trtllm.policy``).

A pass, in order: running requests first (token budget, chunked prefill, KV
allocation with preemption by recompute), then the strict-FIFO waiting queue
(rejections, the admission decision, ``max_num_seqs``), then prefill timing from
the batch counters, then every ready request emits one token; the decode batch
excludes first tokens produced by the pass that computed their prompt.

State is mutated eagerly at pass start; the replay loop makes terminals visible
at the pass end it returns (tokens are stamped with that end here).
"""

import numpy as np

from aisim_fast.kernels.dp.attention_dp import defers_prefills_gated
from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on, note_event, outputs_logged
from aisim_fast.kernels.kv.lease import allocate, finalize, prefix_cost
from aisim_fast.kernels.loop.pass_log import append_pass_row
from aisim_fast.kernels.loop.rank_queues import push_terminal, run_push_back, wait_at, wait_remove_at
from aisim_fast.kernels.loop.request_state import ceil_div, remaining_generation, remaining_tokens, seq_len
from aisim_fast.kernels.loop.token_output import emit_token
from aisim_fast.kernels.schema.layout import (ACC_ADMITTED, ACC_BATCH, ACC_BUDGET, ACC_COMPLETE,
                                              ACC_DECODE_BATCH, ACC_DECODE_KV, ACC_ISL, ACC_PREEMPTED_ANY,
                                              ACC_PREFIX, ACC_REJECTED, ACC_SCHEDULED_TOKENS, ACC_SIZE,
                                              CFG_BLOCK_SIZE, CFG_CHUNKED_PREFILL, CFG_MAX_MODEL_LEN,
                                              CFG_MAX_NUM_BATCHED_TOKENS, CFG_MAX_NUM_SEQS,
                                              CFG_NUM_GPU_BLOCKS, CFG_POLICY, CFG_PREFILL_CADENCE,
                                              CFG_ROLE, CFG_SPEC_NEXTN, EV_ADMITTED, EV_FINISHED,
                                              POLICY_TRTLLM, PW_PASS_NUM, ROLE_DECODE, ROLE_PREFILL,
                                              RQ_ADMISSIONS, RQ_ALLOCATED, RQ_COMMITTED_PREFILL,
                                              RQ_FAST_LIMIT, RQ_FIRST_CACHED, RQ_GENERATED, RQ_MAX_CACHED,
                                              RQ_MAX_OUTPUT, RQ_NUM_COMPUTED, RQ_PROMPT_LEN,
                                              RQ_SCHED_CLASS, RQ_SCHED_LEN, RQ_SCHED_PREFIX,
                                              RQ_SCHED_PROMPT, RQ_SCHED_STAMP, RQ_SCHED_TERMINAL,
                                              RQ_SCHED_TOKENS, RQ_STATUS, RQ_TERM_NEXT, RQ_TERMINAL,
                                              RQF_FIRST_ADMIT_MS, RQF_TERMINAL_MS, RS_ACTIVATED, RS_DONE,
                                              RS_HELD, RS_RUNNING, RS_WAITING, SM_PASS_LOG_LEN,
                                              TERM_COMPLETED, TERM_REJECTED, WK_CAP_GEN, WK_CAPACITY_BOUND,
                                              WK_PASS_STAMP, WK_PEND_LEN, WK_PREEMPTIONS_TOTAL, WK_RUN_LEN,
                                              WK_RUN_OFF, WK_STAT_ROW, WK_TERM_HEAD, WK_WAIT_LEN)
from aisim_fast.kernels.stats.sketch import fold_gap_run
from aisim_fast.kernels.timing.pass_timing import decode_ns, ns_to_ms, prefill_ns
from aisim_fast.kernels.spec import vllm_burst
from aisim_fast.kernels.spec.vllm_burst import charge_lookahead
from aisim_fast.kernels.vllm import capacity as capacity_policy
from aisim_fast.kernels.vllm.decode_step import (CLASS_COMPLETE, CLASS_DECODE, classify, fast_decode_step,
                                                 stamp_scheduled)
from aisim_fast.kernels.vllm.run_exits import finish_request, preempt

# a speculating worker's verify pass (kernels.spec.vllm_burst), behind its feature gate
_emit_bursts = gate("speculation", vllm_burst.emit_bursts, (0.0, np.int64(0), False))

# schedule_request outcomes
SCHEDULED = 0
BLOCKED = 1
CURRENT_PREEMPTED = 2
ALLOC_ARENA_FULL = 3


@kernel(cache=True, _nrt=False)
def capped_prefix_cost(cfg, p, rq, w, q):
    """(cached, active cached) tokens of q's prefix lookup after the policy's cap."""
    cached, active = prefix_cost(cfg, p, rq, w, q)
    return capacity_policy.prefix_cap(cfg, rq, w, q, cached, active)


# ---------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------


# inline: a call would pass the state bundles (~25 arrays, each several words) on
# every pass, 40% of a disaggregated replay's kernel time (it has no decode runs); the
# event loop inlines it at one site only (kernels.loop.backends)
@kernel(cache=True, _nrt=False, inline="always")
def run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """Run one pass of worker ``w`` starting at ``now_ms``.

    Reads and writes the worker's queues, pool and the requests it owns; pushes
    terminals (with ``terminal_ms`` = pass end) onto the worker's terminal list.
    ``acc`` is an int64[ACC_SIZE] scratch for the pass counters. Returns
    ``(end_ms, had_effect, arena_full)``."""
    wk.i64[w, WK_PASS_STAMP] += 1
    p.w64[w, PW_PASS_NUM] = wk.i64[w, WK_PASS_STAMP]  # blocks it publishes carry it (kv_router)
    # unique across the workers of a simulation: a disaggregated request is
    # scheduled on two workers and must not match a stale stamp of the other
    stamp = wk.i64[w, WK_PASS_STAMP] * 65536 + (w % 65536) + 1
    preemptions_before = wk.i64[w, WK_PREEMPTIONS_TOTAL]
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    capacity = cfg.i64[w, CFG_NUM_GPU_BLOCKS]
    not_decode = cfg.i64[w, CFG_ROLE] != ROLE_DECODE
    # acc: layout.PASS_COUNTERS; the decode batch's are kept as requests are scheduled (decode_step.classify)
    for i in range(ACC_SIZE):
        acc[i] = 0
    acc[ACC_BUDGET] = cfg.i64[w, CFG_MAX_NUM_BATCHED_TOKENS]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]

    # attention DP's prefill cadence: a deferring pass continues no prompt chunk and
    # admits nothing that needs more than one new token
    # (a cadence is set only for ranks of a group: kernels.dp.attention_dp)
    defer = cfg.i64[w, CFG_PREFILL_CADENCE] > 1 and defers_prefills_gated(cfg.features, cfg, rq, wk, w)

    # a speculating decode step also spends token budget on its drafts (kernels.spec)
    spec_lookahead = cfg.i64[w, CFG_SPEC_NEXTN] \
        if cfg.i64[w, CFG_ROLE] != ROLE_PREFILL and cfg.i64[w, CFG_POLICY] != POLICY_TRTLLM else 0
    # running first; the cursor is an index (a fifo victim before it shifts the list)
    rq_i = rq.i64
    i = 0
    while i < wk.i64[w, WK_RUN_LEN] and acc[ACC_BUDGET] > 0:
        q = wk.run_q[wk.i64[w, WK_RUN_OFF] + i]
        if defer and rq_i[q, RQ_NUM_COMPUTED] < rq_i[q, RQ_PROMPT_LEN]:
            i += 1
            continue
        # the fast path first (the bulk of all scheduling, inline: a call would pass
        # the whole state), else the full schedule step
        if fast_decode_step(rq_i, q, acc, stamp, limit) > 0:
            if spec_lookahead > 0:
                charge_lookahead(rq_i, q, acc, spec_lookahead)
            i += 1
            continue
        out = schedule_request(cfg, p, rq, wl, wk, w, q, np.bool_(False), np.int64(0), now_ms, stamp,
                               acc, hits, fresh, scratch_tokens, not_decode, np.int64(0))
        if out == SCHEDULED:
            if spec_lookahead > 0 and rq_i[q, RQ_SCHED_PROMPT] == 0 and rq_i[q, RQ_GENERATED] > 0 \
                    and rq_i[q, RQ_SCHED_TOKENS] > 0:
                charge_lookahead(rq_i, q, acc, spec_lookahead)
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
    i_wait = np.int64(0)  # typed: a literal start would compile schedule_request twice
    while acc[ACC_PREEMPTED_ANY] == 0 and wk.i64[w, WK_RUN_LEN] < cfg.i64[w, CFG_MAX_NUM_SEQS] \
            and i_wait < wk.i64[w, WK_WAIT_LEN]:
        q = wait_at(wk, w, i_wait)
        activated = rq.i64[q, RQ_STATUS] == RS_ACTIVATED
        if dest_pending and not activated:
            i_wait += 1
            continue
        if activated and not (limit >= 0 and rq.i64[q, RQ_PROMPT_LEN] >= limit):
            # prompt KV resident: no capacity check, nothing to allocate or compute
            capacity_policy.on_activated_admitted(cfg, p, rq, wk, w, q)
            out = schedule_request(cfg, p, rq, wl, wk, w, q, np.bool_(True), np.int64(0), now_ms, stamp,
                                   acc, hits, fresh, scratch_tokens, not_decode, i_wait)
            if out == ALLOC_ARENA_FULL:
                return now_ms, True, True
            if acc[ACC_BUDGET] == 0:
                break
            continue
        reject = limit >= 0 and rq.i64[q, RQ_PROMPT_LEN] >= limit
        if not reject and rq.i64[q, RQ_STATUS] == RS_WAITING:
            reject = capacity_policy.rejects(cfg, rq, w, q, capacity)
        if reject:
            wait_remove_at(wk, w, i_wait)
            wk.i64[w, WK_CAP_GEN] += 1
            rq.i64[q, RQ_STATUS] = RS_DONE
            rq.i64[q, RQ_TERMINAL] = TERM_REJECTED
            if event_log_on(p):
                note_event(p, w, EV_FINISHED, q, np.int64(TERM_REJECTED), rq.i64[q, RQ_GENERATED])
            push_terminal(rq, wk, w, q)
            acc[ACC_REJECTED] += 1
            continue
        cached, active_cached = capped_prefix_cost(cfg, p, rq, w, q)
        if capacity_policy.admission_shortfall(cfg, p, rq, wk, w, q, active_cached, capacity) > 0:
            break
        if defer and seq_len(rq, q) - cached > 1:
            break
        budget_before = acc[ACC_BUDGET]
        out = schedule_request(cfg, p, rq, wl, wk, w, q, np.bool_(True), cached, now_ms, stamp, acc,
                               hits, fresh, scratch_tokens, not_decode, np.int64(0))
        if out == ALLOC_ARENA_FULL:
            return now_ms, True, True
        if out != SCHEDULED:
            break
        if budget_before == acc[ACC_BUDGET] and acc[ACC_BUDGET] == 0:
            break

    if acc[ACC_PREEMPTED_ANY] == 0 and not defer:
        # a pass that could prefill and left requests waiting: the cadence yields until
        # one clears the queue (the reference's prefill_capacity_bound)
        wk.i64[w, WK_CAPACITY_BOUND] = 1 if wk.i64[w, WK_WAIT_LEN] > 0 else 0

    # timing: prefill first, then the decode batch
    pf_ns = prefill_ns(cfg, w, acc[ACC_BATCH], acc[ACC_ISL], acc[ACC_PREFIX])
    decode_start_ms = now_ms + ns_to_ms(pf_ns)
    n_complete = acc[ACC_COMPLETE]
    # the per-request loops below index the field matrices directly (hoisted once)
    rq_i = rq.i64
    cfg_i = cfg.i64
    run_q = wk.run_q
    off = wk.i64[w, WK_RUN_OFF]
    n_run = wk.i64[w, WK_RUN_LEN]

    # emit, in the reference's output order: first the requests whose generation was
    # already complete (terminal without a token; their leases go back to the LRU
    # first), then the tokens of the ready requests in running order
    n_no_token = 0
    for j in range(n_run if n_complete > 0 else 0):
        q = run_q[off + j]
        prompt = rq_i[q, RQ_PROMPT_LEN]
        generated = rq_i[q, RQ_GENERATED]
        if rq_i[q, RQ_NUM_COMPUTED] >= prompt + generated \
                and remaining_tokens(rq_i[q, RQ_MAX_OUTPUT], generated, prompt, limit) <= 0:
            finish_request(cfg, p, rq, wk, w, q)
            n_no_token += 1
    if cfg_i[w, CFG_SPEC_NEXTN] > 0:
        # a verify pass: its own decode batch, KV reservation and bursts of tokens
        end_ms, n_tokens, arena_full = _emit_bursts(cfg.features, cfg, p, rq, wl, wk, sims, s, w,
                                                    decode_start_ms, acc, scratch_tokens)
        if arena_full:
            return now_ms, True, True
    else:
        # only requests scheduled in this pass can be ready to emit: every other running
        # request emitted in its last pass and needs a computed token first
        if cfg_i[w, CFG_ROLE] == ROLE_PREFILL:
            dc_ns = np.int64(0)
        else:
            dc_ns = decode_ns(cfg, w, acc[ACC_DECODE_BATCH], acc[ACC_DECODE_KV], capacity * bs)
        end_ms = decode_start_ms + ns_to_ms(dc_ns)
        n_tokens = np.int64(0)
        run_gap_ms = 0.0  # current run of equal token gaps, folded when it ends
        run_count = 0
        log_outputs = outputs_logged(p, s)
        keep = 0
        for j in range(n_run):
            q = run_q[off + j]
            if n_no_token > 0 and rq_i[q, RQ_STATUS] == RS_DONE:
                continue
            done = False
            generated = rq_i[q, RQ_GENERATED]
            prompt = rq_i[q, RQ_PROMPT_LEN]
            if rq_i[q, RQ_NUM_COMPUTED] >= prompt + generated:
                done = remaining_tokens(rq_i[q, RQ_MAX_OUTPUT], generated + 1, prompt, limit) <= 0
                run_gap_ms, run_count, _ = emit_token(cfg, p, rq, wk, sims, s, w, q, end_ms, run_gap_ms,
                                                      run_count, log_outputs, done)
                n_tokens += 1
            if done:
                finish_request(cfg, p, rq, wk, w, q)
            else:
                run_q[off + keep] = q
                keep += 1
        wk.i64[w, WK_RUN_LEN] = keep
        fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], run_gap_ms, run_count)

    # every terminal of this pass becomes visible at its end
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        rq.f64[q, RQF_TERMINAL_MS] = end_ms
        q = rq.i64[q, RQ_TERM_NEXT]

    had_effect = acc[ACC_ADMITTED] > 0 or acc[ACC_SCHEDULED_TOKENS] > 0 or acc[ACC_REJECTED] > 0 or acc[ACC_PREEMPTED_ANY] > 0 or n_tokens > 0 \
        or wk.i64[w, WK_TERM_HEAD] >= 0
    if sims.i64[s, SM_PASS_LOG_LEN] < sims.pass_log.shape[1]:  # logging on and room left
        log_pass(cfg, p, rq, wk, sims, s, w, now_ms, end_ms, stamp, acc, n_tokens,
                  wk.i64[w, WK_PREEMPTIONS_TOTAL] - preemptions_before)
    return end_ms, had_effect, False


@kernel(cache=True, _nrt=False)
def schedule_request(cfg, p, rq, wl, wk, w, q, from_waiting, cost_cached, now_ms, stamp, acc, hits,
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
    if prompt_remaining > 0 and cfg.i64[w, CFG_CHUNKED_PREFILL] == 0 and prompt_remaining > acc[ACC_BUDGET]:
        return BLOCKED
    desired = min(remaining_known, acc[ACC_BUDGET])
    if desired == 0 and remaining_known > 0:
        return BLOCKED
    target = before + desired
    after = target
    victims_queued = 0
    while True:
        if target > rq.i64[q, RQ_ALLOCATED]:
            if ceil_div(target, bs) <= ceil_div(rq.i64[q, RQ_ALLOCATED], bs):
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
        if not capacity_policy.preempts(cfg, w):
            after = before
            break
        v = preempt(cfg, p, rq, wk, w)
        if v < 0:
            after = before
            break
        victims_queued += 1
        acc[ACC_PREEMPTED_ANY] = 1
        if rq.i64[v, RQ_SCHED_STAMP] == stamp:
            # the victim's work in this pass is undone
            rq.i64[v, RQ_SCHED_STAMP] = 0
            acc[ACC_BUDGET] += rq.i64[v, RQ_SCHED_TOKENS]
            acc[ACC_SCHEDULED_TOKENS] -= rq.i64[v, RQ_SCHED_TOKENS]
            if rq.i64[v, RQ_SCHED_CLASS] == CLASS_DECODE:
                acc[ACC_DECODE_BATCH] -= 1
                acc[ACC_DECODE_KV] -= rq.i64[v, RQ_SCHED_LEN]
            elif rq.i64[v, RQ_SCHED_CLASS] == CLASS_COMPLETE:
                acc[ACC_COMPLETE] -= 1
            if rq.i64[v, RQ_SCHED_PROMPT] > 0:
                rq.i64[v, RQ_COMMITTED_PREFILL] -= rq.i64[v, RQ_SCHED_TOKENS]
                if not_decode:
                    acc[ACC_BATCH] -= 1
                    acc[ACC_ISL] -= rq.i64[v, RQ_SCHED_PREFIX] + rq.i64[v, RQ_SCHED_PROMPT]
                    acc[ACC_PREFIX] -= rq.i64[v, RQ_SCHED_PREFIX]
        if v == q:
            return CURRENT_PREEMPTED
    used = after - before
    if used == 0 and after < length:
        return BLOCKED

    if after // bs > before // bs:
        finalize(cfg, p, rq, wl, w, q, before, after, scratch_tokens)
    prompt_tokens = min(after, prompt) - prompt_before
    rem = remaining_generation(cfg, rq, w, q)
    # the first token of the pass that computed the prompt is not decode work
    stamp_scheduled(rq.i64, q, stamp, used, prompt_tokens, prompt_before, length, rem <= 0,
                    classify(acc, after, length, rem,
                             prompt_tokens > 0 and rq.i64[q, RQ_GENERATED] == 0))
    # the pass fast path may continue up to the end of this block, within the lease
    rq.i64[q, RQ_FAST_LIMIT] = min((after // bs + 1) * bs - 1,
                                   ceil_div(rq.i64[q, RQ_ALLOCATED], bs) * bs)
    if prompt_tokens > 0:
        # committed prefill work: every token of a pass chunk that computes prompt
        # tokens, on any worker (a decode-side recompute after preemption included)
        rq.i64[q, RQ_COMMITTED_PREFILL] += used
        if not_decode:
            acc[ACC_BATCH] += 1
            acc[ACC_ISL] += prompt_before + prompt_tokens
            acc[ACC_PREFIX] += prompt_before
    acc[ACC_BUDGET] -= used
    acc[ACC_SCHEDULED_TOKENS] += used
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
        if event_log_on(p):
            note_event(p, w, EV_ADMITTED, q, cached, rq.i64[q, RQ_ADMISSIONS])
        acc[ACC_ADMITTED] += 1
    return SCHEDULED


@kernel(cache=True, _nrt=False)
def schedule_request_ahead(cfg, p, rq, wl, wk, w, q, k_ahead, now_ms, stamp, acc, hits, fresh,
                           scratch_tokens):
    """The schedule step of running request q in the pass ``k_ahead`` passes into a
    run of decode passes (``vllm.decode_run``), whose counters are brought up to date only
    at the run's end: q is stepped as if it had computed and emitted ``k_ahead`` more
    tokens, and its counters are put back afterwards. An aggregated worker."""
    rq_i = rq.i64
    base_computed = rq_i[q, RQ_NUM_COMPUTED]
    base_generated = rq_i[q, RQ_GENERATED]
    rq_i[q, RQ_NUM_COMPUTED] = base_computed + k_ahead
    rq_i[q, RQ_GENERATED] = base_generated + k_ahead
    out = schedule_request(cfg, p, rq, wl, wk, w, q, np.bool_(False), np.int64(0), now_ms, stamp,
                           acc, hits, fresh, scratch_tokens, np.bool_(True), np.int64(0))
    rq_i[q, RQ_NUM_COMPUTED] = base_computed
    rq_i[q, RQ_GENERATED] = base_generated
    return out


@kernel(cache=True, _nrt=False)
def log_pass(cfg, p, rq, wk, sims, s, w, start_ms, end_ms, stamp, acc, n_tokens, n_preempted):
    """Append this pass's ForwardPassMetrics row to simulation s's pass log."""
    if sims.i64[s, SM_PASS_LOG_LEN] >= sims.pass_log.shape[1]:
        return
    # typed counters: a literal 0 start makes Numba compile the callee for it too
    n_pf = np.int64(0)
    pf_tokens = np.int64(0)
    pf_kv = np.int64(0)
    pf_prompt = np.int64(0)
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
                pf_prompt += rq.i64[q, RQ_SCHED_PROMPT]
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
                pf_prompt += rq.i64[q, RQ_SCHED_PROMPT]
            elif rq.i64[q, RQ_SCHED_TERMINAL] == 0:
                n_dc += 1
                dc_kv += rq.i64[q, RQ_SCHED_LEN]
        q = rq.i64[q, RQ_TERM_NEXT]
    timed_dc = acc[ACC_DECODE_BATCH] if cfg.i64[w, CFG_ROLE] != ROLE_PREFILL else np.int64(0)
    timed_dc_kv = acc[ACC_DECODE_KV] if cfg.i64[w, CFG_ROLE] != ROLE_PREFILL else np.int64(0)
    append_pass_row(p, wk, sims, s, w, start_ms, end_ms, n_pf, pf_tokens, pf_kv, pf_prompt, n_dc,
                    dc_kv, acc[ACC_ADMITTED], n_preempted, n_tokens, timed_dc, timed_dc_kv)


