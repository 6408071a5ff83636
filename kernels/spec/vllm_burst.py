"""The speculative verify pass of a vLLM-core worker (vLLM and TRT-LLM): what follows
the schedule step when the rank speculates (``aic_nextn``), as the reference's
``emit_speculative_ready_tokens`` does it.

* The ready requests (prompt computed through their last token, something left to
  generate) in running order are the decode batch, prompts completed in this pass
  included: each is timed as a decode step after its prefill.
* Before any token, the pass sets KV blocks aside for every ready request's longest
  burst, ``min(nextn + 1, remaining)`` tokens past its sequence for a verify step, one
  token for any other (``_verifies``); when the pool cannot
  hold them, vLLM preempts (its usual victim, which need not be ready) and tries again
  with the requests still ready, TRT-LLM (no preemption) emits nothing and times no
  decode.
* Then each ready request, in order, draws its accepted tokens (``spec.sampler``; a
  prefill worker's requests, a first token after the prompt and a preempted request's
  recompute take one token without a draw) and emits
  ``min(accepted, remaining)`` tokens at the pass end. Every token takes its KV slot
  from the reservation as it is emitted; the one before it is finalized first, so a
  block the burst completes is published in the pass. After a burst that does not
  finish the request exactly its last token is left to compute, as after a plain
  decode step. Blocks of rejected drafts go back unused.

On vLLM a speculating decode step also takes token budget for its drafts
(``charge_lookahead``: ``nextn`` more tokens, what is left of the budget), so prompt
chunks beside it are smaller; TRT-LLM's does not. The timing model never sees the
drafts: it prices a batch of ready requests at their lengths.
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import (cancel_reserved, num_free, outputs_logged, reserve_blocks,
                                              take_reserved)
from aisim_fast.kernels.kv.lease import finalize
from aisim_fast.kernels.loop.request_state import ceil_div, remaining_tokens
from aisim_fast.kernels.loop.token_output import emit_token
from aisim_fast.kernels.schema.layout import (ACC_BUDGET, ACC_DECODE_BATCH, ACC_DECODE_KV, ACC_PREEMPTED_ANY,
                                              ACC_SCHEDULED_TOKENS, CFG_BLOCK_SIZE, CFG_MAX_MODEL_LEN,
                                              CFG_NUM_GPU_BLOCKS, CFG_POLICY, CFG_ROLE, CFG_SPEC_NEXTN,
                                              NO_BLOCK,
                                              POLICY_TRTLLM, ROLE_PREFILL, RQ_ALLOCATED, RQ_GENERATED,
                                              RQ_LEASE_OFF, RQ_MAX_OUTPUT, RQ_NUM_COMPUTED, RQ_PROMPT_LEN,
                                              RQ_SCHED_CLASS, RQ_SCHED_PROMPT, RQ_SCHED_TOKENS, RQ_STATUS, RS_RUNNING,
                                              WK_RUN_LEN,
                                              WK_RUN_OFF, WK_STAT_ROW)
from aisim_fast.kernels.spec.sampler import accepted_tokens
from aisim_fast.kernels.stats.sketch import fold_gap_run
from aisim_fast.kernels.timing.pass_timing import decode_ns, ns_to_ms
from aisim_fast.kernels.vllm.decode_step import CLASS_DECODE
from aisim_fast.kernels.vllm import capacity as capacity_policy
from aisim_fast.kernels.vllm.run_exits import finish_request, preempt


@kernel(cache=True, _nrt=False, inline="always")
def charge_lookahead(rq_i, q, acc, drafts):
    """A decode step of a speculating rank just scheduled q: its drafts take token
    budget too (what is left of it), as scheduled tokens of q (a preemption later in
    the pass gives them back with the rest)."""
    extra = min(drafts, acc[ACC_BUDGET])
    acc[ACC_BUDGET] -= extra
    acc[ACC_SCHEDULED_TOKENS] += extra
    rq_i[q, RQ_SCHED_TOKENS] += extra


@kernel(cache=True, _nrt=False, inline="always")
def _burst_bounds(rq_i, q, limit):
    """(sequence length, tokens a burst may emit) of running request q: none while its
    sequence is not all computed (a prompt chunk still to run) or it has nothing left to
    generate; the one readiness test of the reservation and of the bursts."""
    prompt = rq_i[q, RQ_PROMPT_LEN]
    generated = rq_i[q, RQ_GENERATED]
    length = prompt + generated
    if rq_i[q, RQ_NUM_COMPUTED] < length:
        return length, np.int64(0)
    return length, remaining_tokens(rq_i[q, RQ_MAX_OUTPUT], generated, prompt, limit)


@kernel(cache=True, _nrt=False, inline="always")
def _verifies(rq_i, q, max_burst):
    """Whether ready request q's step this pass is a verify step on vLLM: a decode step
    (at most its token and its drafts scheduled, no prompt) of a request that has
    generated. A first token after the prompt, and a preempted request's recompute
    (prompt or output tokens again), emit one token without a draw."""
    return rq_i[q, RQ_GENERATED] > 0 and rq_i[q, RQ_SCHED_PROMPT] == 0 and rq_i[q, RQ_SCHED_TOKENS] <= max_burst


@kernel(cache=True, _nrt=False)
def emit_bursts(cfg, p, rq, wl, wk, sims, s, w, decode_start_ms, acc, scratch_tokens):
    """The rest of worker w's pass once its prefill is timed (``decode_start_ms``):
    returns ``(end_ms, tokens emitted, arena exhausted)``. Requests that finished
    without a token this pass are already off the running list's live entries (not
    RS_RUNNING); this drops them from it."""
    rq_i = rq.i64
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    capacity = cfg.i64[w, CFG_NUM_GPU_BLOCKS]
    prefill_role = cfg.i64[w, CFG_ROLE] == ROLE_PREFILL
    max_burst = 1 if prefill_role else cfg.i64[w, CFG_SPEC_NEXTN] + 1
    trtllm = cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM

    # the lookahead reservation, preempting until it fits; skipped where the pool's free
    # blocks hold every running request's longest burst (nothing is evicted then, and
    # blocks taken without a reservation leave the pool as the reservation would): the
    # decode batch is then the schedule step's (vLLM times no first token as decode)
    reserved = np.int64(0)
    n_ready = acc[ACC_DECODE_BATCH]
    kv_sum = acc[ACC_DECODE_KV]
    emit = True
    reserving = trtllm or num_free(p, w, capacity) < wk.i64[w, WK_RUN_LEN] * (ceil_div(max_burst, bs) + 1)
    lone_need = np.int64(0)  # tokens of the last ready request's longest burst
    while reserving:
        reserved = 0
        n_ready = 0
        kv_sum = 0
        off = wk.i64[w, WK_RUN_OFF]
        for j in range(wk.i64[w, WK_RUN_LEN]):
            q = wk.run_q[off + j]
            if rq_i[q, RQ_STATUS] != RS_RUNNING:
                continue
            length, rem = _burst_bounds(rq_i, q, limit)
            if rem <= 0:
                continue
            generated = rq_i[q, RQ_GENERATED]
            lookahead = min(max_burst, rem) if trtllm or _verifies(rq_i, q, max_burst) else 1
            reserved += ceil_div(length + lookahead, bs) - ceil_div(length, bs)
            lone_need = length + lookahead
            if trtllm or rq_i[q, RQ_SCHED_CLASS] == CLASS_DECODE:
                n_ready += 1
                kv_sum += length
        if reserve_blocks(p, w, capacity, reserved):
            break
        if wk.i64[w, WK_RUN_LEN] == 1 and ceil_div(lone_need, bs) > capacity:
            # a lone request whose burst can never fit: preempting it would only readmit
            # it to the same failure, pass after pass (the reference spins there); it
            # stays, emitting nothing, and the run ends as a dead end
            emit = False
            break
        if not capacity_policy.preempts(cfg, w) or preempt(cfg, p, rq, wk, w) < 0:
            emit = False  # nothing to give up: no token and no decode time this pass
            break
        acc[ACC_PREEMPTED_ANY] = 1
    if not emit:
        n_ready = 0
        kv_sum = 0
    acc[ACC_DECODE_BATCH] = n_ready
    acc[ACC_DECODE_KV] = kv_sum
    dc_ns = np.int64(0)
    if n_ready > 0 and not prefill_role:
        dc_ns = decode_ns(cfg, w, n_ready, kv_sum, capacity * bs)
    end_ms = decode_start_ms + ns_to_ms(dc_ns)

    # the bursts, in running order; the running list keeps what did not finish
    n_tokens = np.int64(0)
    run_gap_ms = 0.0  # current run of equal token gaps, folded when it ends
    run_count = 0
    log_outputs = outputs_logged(p, s)
    off = wk.i64[w, WK_RUN_OFF]
    keep = 0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if rq_i[q, RQ_STATUS] != RS_RUNNING:
            continue
        length, rem = _burst_bounds(rq_i, q, limit)
        if not emit or rem <= 0:
            wk.run_q[off + keep] = q
            keep += 1
            continue
        generated = rq_i[q, RQ_GENERATED]
        speculates = (trtllm or _verifies(rq_i, q, max_burst)) and not prefill_role
        accepted = accepted_tokens(cfg, wk, w) if speculates else np.int64(1)
        burst = min(accepted, rem)
        k0 = rq_i[q, RQ_LEASE_OFF]
        done = False
        for k in range(burst):
            if length % bs == 0:
                # the token before completed a block: finalized before the next is appended
                # (for the first token of the burst the schedule step did it already)
                finalize(cfg, p, rq, wl, w, q, length - 1, length, scratch_tokens)
            done = k + 1 == rem
            run_gap_ms, run_count, _ = emit_token(cfg, p, rq, wk, sims, s, w, q, end_ms, run_gap_ms,
                                                  run_count, log_outputs, done)
            n_tokens += 1
            length += 1
            allocated = rq_i[q, RQ_ALLOCATED]
            if allocated < length:
                for i in range(ceil_div(allocated, bs), ceil_div(length, bs)):
                    b = take_reserved(p, w, reserving)
                    if b == NO_BLOCK:
                        return end_ms, n_tokens, True
                    rq.lease[k0 + i] = b
                    reserved -= 1
                rq_i[q, RQ_ALLOCATED] = length
        if done:
            finish_request(cfg, p, rq, wk, w, q)
        else:
            rq_i[q, RQ_NUM_COMPUTED] = length - 1
            wk.run_q[off + keep] = q
            keep += 1
    wk.i64[w, WK_RUN_LEN] = keep
    if emit and reserving:
        cancel_reserved(p, w, reserved)
    fold_gap_run(sims.token_stat, sims.token_hist, wk.i64[w, WK_STAT_ROW], run_gap_ms, run_count)
    return end_ms, n_tokens, False
