"""The batch entry point: every simulation of a batch runs its whole event loop
(aggregated or disaggregated) in one kernel call, one simulation per thread.

Only this function uses Numba's runtime (NRT): it allocates the per-simulation
scratch arrays. Everything it calls is compiled with ``_nrt=False``. A Numba call
that receives an array otherwise reference-counts it on entry and exit (a call
into the runtime and an atomic operation per array), and the loops pass the whole
state bundle (~25 arrays) to a few functions per forward pass: without the runtime
those calls cost nothing extra, which halved the kernel time of a 10k-request
replay. The arrays all belong to the driver and outlive the call."""

import numpy as np
from numba import njit, prange

from .disagg_loop import run_disagg_simulation
from .layout import SIM_NEED_FLUSH, SIM_RUNNING, SM_PREFILL_LEN, SM_STATUS
from .replay_loop import run_simulation
from .vllm_pass import ACC_SIZE


@njit(cache=True, parallel=True)
def replay_batch(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size):
    """Advance every simulation in ``sim_ids`` (those still running or paused for a
    flush) until done, dead end, or its pass log is full. Scratch buffers are per
    simulation, so threads share nothing."""
    for i in prange(sim_ids.shape[0]):
        s = sim_ids[i]
        if sims.i64[s, SM_STATUS] != SIM_RUNNING and sims.i64[s, SM_STATUS] != SIM_NEED_FLUSH:
            continue
        acc = np.zeros(ACC_SIZE, np.int64)
        hits = np.empty(max_lease_blocks, np.int32)
        fresh = np.empty(max_lease_blocks, np.int32)
        scratch_tokens = np.empty(max_block_size, np.uint32)
        if sims.i64[s, SM_PREFILL_LEN] > 0:
            run_disagg_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
        else:
            run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
