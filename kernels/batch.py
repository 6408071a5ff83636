"""The batch entry point: every simulation of a batch runs its whole event loop
(aggregated or disaggregated) in one kernel call, one simulation per thread."""

import numpy as np
from numba import njit, prange

from .disagg_loop import run_disagg_simulation
from .layout import SIM_NEED_FLUSH, SIM_RUNNING, SM_PREFILL_LEN, SM_STATUS
from .replay_loop import run_simulation


@njit(cache=True, parallel=True)
def replay_batch(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size):
    """Advance every simulation in ``sim_ids`` (those still running or paused for a
    flush) until done, dead end, or its pass log is full. Scratch buffers are per
    simulation, so threads share nothing."""
    for i in prange(sim_ids.shape[0]):
        s = sim_ids[i]
        if sims.i64[s, SM_STATUS] != SIM_RUNNING and sims.i64[s, SM_STATUS] != SIM_NEED_FLUSH:
            continue
        acc = np.zeros(8, np.int64)
        hits = np.empty(max_lease_blocks, np.int32)
        fresh = np.empty(max_lease_blocks, np.int32)
        scratch_tokens = np.empty(max_block_size, np.uint32)
        if sims.i64[s, SM_PREFILL_LEN] > 0:
            run_disagg_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
        else:
            run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
