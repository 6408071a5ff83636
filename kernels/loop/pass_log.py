"""The per-pass log (ForwardPassMetrics rows, ``sims.pass_log[s, row, PL_*]``): the row
writer of every backend and every pass path. Two callers then correct what only they
know: SGLang's pass its block columns (pages of the radix cache, ``sglang.core``), and an
attention-DP group's pass its end time at the group's barrier (``dp.attention_dp``)."""

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import num_active
from aisim_fast.kernels.schema.layout import (PL_ACTIVE_BLOCKS, PL_RANK, PL_END_MS, PL_INACTIVE_BLOCKS,
                                              PL_NUM_ADMITTED, PL_NUM_DECODE_REQUESTS, PL_NUM_OUTPUT_TOKENS,
                                              PL_NUM_PREEMPTED, PL_NUM_PREFILL_REQUESTS, PL_NUM_RUNNING,
                                              PL_NUM_WAITING, PL_START_MS, PL_SUM_DECODE_KV_TOKENS,
                                              PL_SUM_PREFILL_KV_TOKENS, PL_SUM_PREFILL_PROMPT_TOKENS,
                                              PL_SUM_PREFILL_TOKENS, PL_TIMED_DECODE_KV_TOKENS,
                                              PL_TIMED_DECODE_REQUESTS, PL_WORKER, PW_LRU_LEN,
                                              SM_PASS_LOG_LEN, SM_W_OFF, WK_RUN_LEN, WK_WAIT_LEN)


@kernel(cache=True, _nrt=False)
def append_pass_row(p, wk, sims, s, w, start_ms, end_ms, n_pf, pf_tokens, pf_kv, pf_prompt, n_dc,
                    dc_kv, n_admitted, n_preempted, n_tokens, timed_dc, timed_dc_kv):
    """Append one ForwardPassMetrics row (the caller checked there is room); queue
    lengths and block counts are read as the pass leaves them; ``timed_dc`` /
    ``timed_dc_kv``: the decode batch the pass was timed on."""
    row = sims.i64[s, SM_PASS_LOG_LEN]
    sims.i64[s, SM_PASS_LOG_LEN] = row + 1
    log = sims.pass_log[s, row]
    log[PL_WORKER] = w - sims.i64[s, SM_W_OFF]  # a rank (the driver names its worker and number)
    log[PL_RANK] = 0
    log[PL_START_MS] = start_ms
    log[PL_END_MS] = end_ms
    log[PL_NUM_PREFILL_REQUESTS] = n_pf
    log[PL_SUM_PREFILL_TOKENS] = pf_tokens
    log[PL_SUM_PREFILL_KV_TOKENS] = pf_kv
    log[PL_SUM_PREFILL_PROMPT_TOKENS] = pf_prompt
    log[PL_TIMED_DECODE_REQUESTS] = timed_dc
    log[PL_TIMED_DECODE_KV_TOKENS] = timed_dc_kv
    log[PL_NUM_DECODE_REQUESTS] = n_dc
    log[PL_SUM_DECODE_KV_TOKENS] = dc_kv
    log[PL_NUM_ADMITTED] = n_admitted
    log[PL_NUM_PREEMPTED] = n_preempted
    log[PL_NUM_OUTPUT_TOKENS] = n_tokens
    log[PL_NUM_RUNNING] = wk.i64[w, WK_RUN_LEN]
    log[PL_NUM_WAITING] = wk.i64[w, WK_WAIT_LEN]
    log[PL_ACTIVE_BLOCKS] = num_active(p, w)
    log[PL_INACTIVE_BLOCKS] = p.w64[w, PW_LRU_LEN]
