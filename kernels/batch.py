"""The batch entry point: every simulation of a batch runs its whole event loop
(aggregated or disaggregated) in one kernel call, one simulation per thread."""

import numpy as np
from numba import njit, prange

from .borrow import borrow
from .disagg_loop import run_disagg_simulation
from .layout import (SIM_NEED_FLUSH, SIM_RUNNING, SM_PREFILL_LEN, SM_STATUS, Pool, RankConfig,
                     Requests, Sims, Workers, Workload)
from .replay_loop import run_simulation


@njit(cache=True)
def _borrowed(cfg, p, rq, wl, wk, sims):
    """The state bundles as reference-count-free views (see ``borrow``)."""
    return (RankConfig(borrow(cfg.i64), borrow(cfg.f64)),
            Pool(borrow(p.w64), borrow(p.b32), borrow(p.blk_hash), borrow(p.tab)),
            Requests(borrow(rq.i64), borrow(rq.f64), borrow(rq.lease), borrow(rq.seq_hash)),
            Workload(borrow(wl.hash_indptr), borrow(wl.hash_ids), borrow(wl.trace_block_size),
                     borrow(wl.phash_indptr), borrow(wl.phash)),
            Workers(borrow(wk.i64), borrow(wk.pass_end_ms), borrow(wk.run_q), borrow(wk.wait_q)),
            Sims(borrow(sims.i64), borrow(sims.now_ms), borrow(sims.start_order),
                 borrow(sims.heap_q), borrow(sims.actq), borrow(sims.xfer_heap),
                 borrow(sims.token_stat), borrow(sims.token_hist), borrow(sims.pass_log),
                 borrow(sims.hlog)))


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
        b_cfg, b_p, b_rq, b_wl, b_wk, b_sims = _borrowed(cfg, p, rq, wl, wk, sims)
        if sims.i64[s, SM_PREFILL_LEN] > 0:
            run_disagg_simulation(b_cfg, b_p, b_rq, b_wl, b_wk, b_sims, s, borrow(acc), borrow(hits),
                                  borrow(fresh), borrow(scratch_tokens))
        else:
            run_simulation(b_cfg, b_p, b_rq, b_wl, b_wk, b_sims, s, borrow(acc), borrow(hits),
                           borrow(fresh), borrow(scratch_tokens))
