"""The scheduler passes the event loop calls, one per backend family.

* ``run_pass``: the vLLM scheduler core (``vllm.core``) for vLLM and TRT-LLM workers;
  the two differ only in their capacity policy, chosen per worker by its policy code
  (``vllm.capacity``: ``vllm.policy`` or ``trtllm.policy``);
* ``sglang_run_pass``: the SGLang scheduler over its radix cache (``sglang.core``,
  ``sglang.radix``); SGLang simulations run in event loops of their own
  (``loop.event_loop``), so a batch without SGLang never compiles it;
* ``group_rank_pass`` / ``group_sglang_rank_pass``: the pass called (not inlined) for a
  rank of an attention-DP group, behind the attention_dp gate;
* ``decode_run``: runs of decode passes (``vllm.decode_run``), an optimization of the
  vLLM core; for SGLang it runs nothing and the loop takes the pass.

A new backend family is a module with a ``run_pass`` of the same signature, a policy
code in ``schema.layout``, an entry here and the event loop set that calls it.
"""

from numba import njit

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import CFG_POLICY, POLICY_TRTLLM, POLICY_VLLM
from aisim_fast.kernels.sglang import core as sglang_core
from aisim_fast.kernels.vllm import core as vllm_core, decode_run as vllm_decode_run


@njit(cache=True, _nrt=False, inline="always")
def run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """One forward pass of vLLM or TRT-LLM worker w from ``now_ms``:
    ``(end_ms, had_effect, arena_full)``."""
    return vllm_core.run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh,
                              scratch_tokens)


@njit(cache=True, _nrt=False, inline="always")
def sglang_run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """One forward pass of SGLang worker w (the same contract)."""
    return sglang_core.run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh,
                                scratch_tokens)


@kernel(cache=True, _nrt=False)
def rank_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens):
    """``run_pass`` called, not inlined: a rank's pass inside an attention-DP group.
    Numba inlines by copying the callee's IR (~5 CPU-s for the vLLM pass), so the
    event loop inlines the pass only where a lone worker runs it."""
    return run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)


# behind the attention_dp gate (kernels.features): a batch of lone workers compiles no
# group pass
_NO_PASS = (0.0, False, False)
group_rank_pass = gate("attention_dp", rank_pass, _NO_PASS)
group_sglang_rank_pass = gate("attention_dp", sglang_run_pass, _NO_PASS)


@kernel(cache=True, _nrt=False, inline="always")
def decode_run(cfg, p, rq, wl, wk, sims, s, w, now_ms, quiet_until, max_passes, acc, hits, fresh,
               scratch_tokens):
    """Worker w's decode passes up to ``quiet_until`` in one call where its backend
    has them: ``(end_ms, passes run, arena_full)``, 0 passes = take ``run_pass``."""
    policy = cfg.i64[w, CFG_POLICY]
    if policy == POLICY_VLLM or policy == POLICY_TRTLLM:
        return vllm_decode_run.decode_run(cfg, p, rq, wl, wk, sims, s, w, now_ms, quiet_until,
                                          max_passes, acc, hits, fresh, scratch_tokens)
    return now_ms, 0, False
