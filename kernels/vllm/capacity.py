"""The capacity policy of a worker running the vLLM scheduler core, chosen by its
policy code (``cfg.i64[w, CFG_POLICY]``): vLLM's (``vllm.policy``) or TRT-LLM's
guaranteed-no-evict (``trtllm.policy``). Each hook is one branch per policy with
the same signature on both sides; a new capacity policy for the vLLM core is a
module with these functions and one line in each hook. The hooks are plain calls,
not inlined: they run a few times per admission, not per token, and inlining both
policies' code into every caller cost compile time for nothing."""

import numpy as np

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import CFG_POLICY, POLICY_TRTLLM
from aisim_fast.kernels.trtllm import policy as trtllm_policy
from aisim_fast.kernels.vllm import policy as vllm_policy

# TRT-LLM's side of each hook behind the trtllm feature gate (kernels.features): a
# batch without TRT-LLM workers compiles none of trtllm_policy
_NONE2 = (np.int64(0), np.int64(0))
_trt_prefix_cap = gate("trtllm", trtllm_policy.prefix_cap, _NONE2)
_trt_rejects = gate("trtllm", trtllm_policy.rejects, False)
_trt_admission_shortfall = gate("trtllm", trtllm_policy.admission_shortfall, np.int64(0))
_trt_preempts = gate("trtllm", trtllm_policy.preempts, False)
_trt_reserve_destination = gate("trtllm", trtllm_policy.reserve_destination, _NONE2)
_trt_destination_impossible = gate("trtllm", trtllm_policy.destination_impossible, False)
_trt_on_activated_admitted = gate("trtllm", trtllm_policy.on_activated_admitted)
_trt_on_destination_dropped = gate("trtllm", trtllm_policy.on_destination_dropped)


@kernel(cache=True, _nrt=False)
def prefix_cap(cfg, rq, w, q, cached, active):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_prefix_cap(cfg.features, cfg, rq, w, q, cached, active)
    return vllm_policy.prefix_cap(cfg, rq, w, q, cached, active)


@kernel(cache=True, _nrt=False)
def rejects(cfg, rq, w, q, capacity):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_rejects(cfg.features, cfg, rq, w, q, capacity)
    return vllm_policy.rejects(cfg, rq, w, q, capacity)


@kernel(cache=True, _nrt=False)
def admission_shortfall(cfg, p, rq, wk, w, q, active_cached, capacity):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_admission_shortfall(cfg.features, cfg, p, rq, wk, w, q, active_cached, capacity)
    return vllm_policy.admission_shortfall(cfg, p, rq, wk, w, q, active_cached, capacity)


@kernel(cache=True, _nrt=False)
def preempts(cfg, w):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_preempts(cfg.features, cfg, w)
    return vllm_policy.preempts(cfg, w)


@kernel(cache=True, _nrt=False)
def reserve_destination(cfg, p, rq, wk, w, q, n_blocks, hits, fresh):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_reserve_destination(cfg.features, cfg, p, rq, wk, w, q, n_blocks, hits, fresh)
    return vllm_policy.reserve_destination(cfg, p, rq, wk, w, q, n_blocks, hits, fresh)


@kernel(cache=True, _nrt=False)
def destination_impossible(cfg, p, rq, w, q):
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        return _trt_destination_impossible(cfg.features, cfg, p, rq, w, q)
    return vllm_policy.destination_impossible(cfg, p, rq, w, q)


@kernel(cache=True, _nrt=False)
def on_activated_admitted(cfg, p, rq, wk, w, q):
    """TRT-LLM's accounting of held-back tails (vLLM holds none back)."""
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        _trt_on_activated_admitted(cfg.features, cfg, p, rq, wk, w, q)


@kernel(cache=True, _nrt=False)
def on_destination_dropped(cfg, p, rq, wk, w, q, reserved_blocks):
    """TRT-LLM's accounting of held-back tails (vLLM holds none back)."""
    if cfg.i64[w, CFG_POLICY] == POLICY_TRTLLM:
        _trt_on_destination_dropped(cfg.features, cfg, p, rq, wk, w, q, reserved_blocks)
