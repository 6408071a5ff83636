"""vLLM's capacity policy over the shared block pool (``scheduler/vllm/policy.rs``,
spec engine.md §5-§6): a waiting request is admitted when the blocks of its known
sequence that are not already active fit in what is not in use; on exhaustion the
core preempts by recompute; the cached prefix is capped so that the last prompt
block is recomputed while logits are still needed.

Every function here has a TRT-LLM twin in ``trtllm.policy`` with the same
signature; ``vllm.capacity`` picks one by the worker's policy code (TRT-LLM has
two more hooks, for the completion tails it holds back).
"""


from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import num_active, reserve, table_find
from aisim_fast.kernels.loop.request_state import ceil_div, remaining_generation, seq_len
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_MAX_NUM_SEQS, CFG_NUM_GPU_BLOCKS,
                                              CFG_PREFIX_CACHING, CFG_SPEC_NEXTN, NO_BLOCK, RQ_LEASE_OFF, RQ_NUM_HASHED,
                                              RQ_PROMPT_LEN, WK_RUN_LEN)


@kernel(cache=True, _nrt=False)
def prefix_cap(cfg, rq, w, q, cached, active):
    """The recompute rules, while logits are still needed (a request that generates
    nothing keeps its whole hit): the cached prefix is capped at ``floor((len-1)/bs)*bs``
    (a fully cached aligned prompt recomputes its last block), and a speculating rank
    recomputes the last block of any hit too (its drafter needs that block's hidden
    states; measured: a zero-output agentic request keeps that block, differential
    seed 402 case 47)."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    if remaining_generation(cfg, rq, w, q) > 0:
        cap = ((seq_len(rq, q) - 1) // bs) * bs
        cached = min(cached, cap)
        active = min(active, cap)
        if cfg.i64[w, CFG_SPEC_NEXTN] > 0 and cached >= bs:
            cached -= bs
            active = min(active, cached)
    return cached, active


@kernel(cache=True, _nrt=False)
def rejects(cfg, rq, w, q, capacity):
    """A fresh waiting request whose known sequence can never fit the pool."""
    return ceil_div(seq_len(rq, q), cfg.i64[w, CFG_BLOCK_SIZE]) > capacity


@kernel(cache=True, _nrt=False)
def admission_shortfall(cfg, p, rq, wk, w, q, active_cached, capacity):
    """Blocks missing to admit q now (<= 0: it fits)."""
    needed = ceil_div(seq_len(rq, q), cfg.i64[w, CFG_BLOCK_SIZE]) - active_cached // cfg.i64[w, CFG_BLOCK_SIZE]
    return needed - (capacity - num_active(p, w))


@kernel(cache=True, _nrt=False)
def preempts(cfg, w):
    """vLLM preempts running requests (recompute) when the pool is exhausted."""
    return True


@kernel(cache=True, _nrt=False)
def reserve_destination(cfg, p, rq, wk, w, q, n_blocks, hits, fresh):
    """Disaggregated decode rank: reserve q's prompt blocks, reusing the longest
    resident prefix of complete prompt blocks, if a running slot is free. Returns
    (1 reserved / 0 not now / -1 arena exhausted, prefix blocks reused)."""
    if wk.i64[w, WK_RUN_LEN] >= cfg.i64[w, CFG_MAX_NUM_SEQS]:
        return 0, 0
    n_hit = 0
    if cfg.i64[w, CFG_PREFIX_CACHING] != 0:
        k0 = rq.i64[q, RQ_LEASE_OFF]
        while n_hit < rq.i64[q, RQ_NUM_HASHED]:
            b = table_find(p, w, rq.seq_hash[k0 + n_hit])
            if b == NO_BLOCK:
                break
            hits[n_hit] = b
            n_hit += 1
    return reserve(p, w, cfg.i64[w, CFG_NUM_GPU_BLOCKS], hits, n_hit, n_blocks - n_hit, fresh), n_hit


@kernel(cache=True, _nrt=False)
def destination_impossible(cfg, p, rq, w, q):
    """The decode rank can never hold q's prompt."""
    return ceil_div(rq.i64[q, RQ_PROMPT_LEN], cfg.i64[w, CFG_BLOCK_SIZE]) > cfg.i64[w, CFG_NUM_GPU_BLOCKS]
