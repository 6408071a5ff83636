"""TRT-LLM's GUARANTEED_NO_EVICT capacity policy over the shared block pool (the
reference runs it on the vLLM core, spec engine.md §6): a request is admitted only
when every block it needs to finish fits beside what the running requests still
need to finish, so nothing is ever preempted; the prefix is not capped; a decode
rank reserves fresh blocks only and holds back the completion tails of its
reserved and activated destinations (``WK_TRT_TAIL``).

Same signatures as ``vllm.policy``; ``vllm.capacity`` picks one per worker.
"""

from numba import njit

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import num_active, reserve
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_MAX_MODEL_LEN, CFG_MAX_NUM_SEQS,
                                              CFG_NUM_GPU_BLOCKS, RQ_ALLOCATED, RQ_MAX_OUTPUT, RQ_PROMPT_LEN,
                                              WK_RUN_LEN, WK_RUN_OFF, WK_TRT_TAIL)


@njit(cache=True, _nrt=False)
def blocks_to_finish(cfg, p, rq, w, q, active_cached):
    """Blocks q still needs to reach its full output (prompt + output budget, within
    ``max_model_len``), beyond what its lease (or, before admission, the active
    cached prefix) already covers."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    out = rq.i64[q, RQ_MAX_OUTPUT]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    if limit >= 0:
        out = min(out, limit - rq.i64[q, RQ_PROMPT_LEN])
    to_completion = ceil_div(rq.i64[q, RQ_PROMPT_LEN] + out, bs)
    if rq.i64[q, RQ_ALLOCATED] > 0:
        have = ceil_div(rq.i64[q, RQ_ALLOCATED], bs)
    else:
        have = active_cached // bs
    return max(0, to_completion - have)


@kernel(cache=True, _nrt=False)
def running_tail(cfg, p, rq, wk, w):
    """Blocks the running requests still need to finish, plus (decode rank) those of
    reserved and activated-waiting destinations."""
    tail = wk.i64[w, WK_TRT_TAIL]
    for j in range(wk.i64[w, WK_RUN_LEN]):
        tail += blocks_to_finish(cfg, p, rq, w, wk.run_q[wk.i64[w, WK_RUN_OFF] + j], 0)
    return tail


@kernel(cache=True, _nrt=False)
def prefix_cap(cfg, rq, w, q, cached, active):
    """No recompute cap."""
    return cached, active


@kernel(cache=True, _nrt=False)
def rejects(cfg, rq, w, q, capacity):
    """A fresh waiting request whose whole completion can never fit the pool."""
    return ceil_div(rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_MAX_OUTPUT], cfg.i64[w, CFG_BLOCK_SIZE]) > capacity


@kernel(cache=True, _nrt=False)
def admission_shortfall(cfg, p, rq, wk, w, q, active_cached, capacity):
    """Blocks missing to admit q with every running request still able to finish."""
    available = capacity - num_active(p, w) - running_tail(cfg, p, rq, wk, w)
    return blocks_to_finish(cfg, p, rq, w, q, active_cached) - available


@kernel(cache=True, _nrt=False)
def preempts(cfg, w):
    """Guaranteed-no-evict never preempts."""
    return False


@kernel(cache=True, _nrt=False)
def reserve_destination(cfg, p, rq, wk, w, q, n_blocks, hits, fresh):
    """Disaggregated decode rank: reserve fresh blocks for q's prompt when its whole
    completion fits and a running slot is free (reserved and activated destinations
    take no slot until a pass admits them); its tail beyond the prompt is held back
    from admissions."""
    if wk.i64[w, WK_RUN_LEN] >= cfg.i64[w, CFG_MAX_NUM_SEQS]:
        return 0, 0
    capacity = cfg.i64[w, CFG_NUM_GPU_BLOCKS]
    available = capacity - num_active(p, w) - running_tail(cfg, p, rq, wk, w)
    to_finish = blocks_to_finish(cfg, p, rq, w, q, 0)
    if to_finish > available:
        return 0, 0
    res = reserve(p, w, capacity, hits, 0, n_blocks, fresh)
    if res == 1:
        wk.i64[w, WK_TRT_TAIL] += to_finish - n_blocks
    return res, 0


@kernel(cache=True, _nrt=False)
def destination_impossible(cfg, p, rq, w, q):
    """The decode rank can never hold q's whole completion."""
    return blocks_to_finish(cfg, p, rq, w, q, 0) > cfg.i64[w, CFG_NUM_GPU_BLOCKS]


@kernel(cache=True, _nrt=False)
def on_activated_admitted(cfg, p, rq, wk, w, q):
    """An admitted destination's tail now counts through the running list."""
    wk.i64[w, WK_TRT_TAIL] -= blocks_to_finish(cfg, p, rq, w, q, 0)


@kernel(cache=True, _nrt=False)
def on_destination_dropped(cfg, p, rq, wk, w, q, reserved_blocks):
    """A canceled reserved destination (``reserved_blocks`` > 0, before its blocks
    are released) or activated one gives its held-back tail back."""
    wk.i64[w, WK_TRT_TAIL] -= blocks_to_finish(cfg, p, rq, w, q, 0) - reserved_blocks
