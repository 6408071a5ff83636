"""The batch entry point and the event loop of one simulation, aggregated or
disaggregated: every simulation of a batch runs to completion (or to the next point
that needs the driver) in one kernel call, one simulation per thread.

The loop follows the reference's per-instant drain (spec/replay.md §1.4, verified
against the goldens): pass completions in worker order (prefill workers come first),
then transfers completing now (disaggregated), then arrivals, then the FIFO handoff
action queue (disaggregated), then idle workers with work start passes in worker
order; a pass that ends at ``now`` completes inside the drive and its worker goes
again. Repeat until nothing changes, then jump to the next pass end, release time or
transfer completion.

Only ``replay_batch`` uses Numba's runtime (NRT): it allocates the per-simulation
scratch arrays. Everything it calls is compiled with ``_nrt=False``. A Numba call
that receives an array otherwise reference-counts it on entry and exit (a call
into the runtime and an atomic operation per array), and the loops pass the whole
state bundle (~25 arrays) to a few functions per forward pass: without the runtime
those calls cost nothing extra, which halved the kernel time of a 10k-request
replay. The arrays all belong to the driver and outlive the call."""

import numpy as np
from numba import njit, prange

from .decode_run import decode_run, quiet_until_ms
from .disagg_loop import complete_disagg_pass, drain_actions, drain_transfers, next_transfer_ms
from .layout import (
    SIM_ARENA_FULL, SIM_DEAD_END, SIM_DONE, SIM_NEED_FLUSH, SIM_RUNNING, SM_DECODE_RUN_PASSES,
    SM_NUM_TERMINAL,
    SM_OPEN_HANDOFFS, SM_PASS_LOG_LEN, SM_PREFILL_LEN, SM_Q_LEN, SM_RESUME_WORKER, SM_STATUS,
    SM_W_LEN, SM_W_OFF, WK_BUSY, WK_RUN_LEN, WK_STALLED, WK_WAIT_LEN,
)
from .replay_loop import admit_arrivals, arrivals_due, complete_pass, next_release_ms
from .vllm_pass import ACC_SIZE, run_pass


@njit(cache=True, _nrt=False)
def run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens):
    """Advance simulation s until it is done or needs the driver."""
    w0 = sims.i64[s, SM_W_OFF]
    w1 = w0 + sims.i64[s, SM_W_LEN]
    disagg = sims.i64[s, SM_PREFILL_LEN] > 0
    log_rows = sims.pass_log.shape[1]
    sims.i64[s, SM_STATUS] = SIM_RUNNING
    now_ms = sims.now_ms[s]
    resume_w = sims.i64[s, SM_RESUME_WORKER]
    sims.i64[s, SM_RESUME_WORKER] = -1
    while True:
        changed = True
        while changed:
            changed = False
            first_w = w0
            if resume_w >= 0:
                # continue the drive that a pass-log flush interrupted, as if no
                # call boundary had been there
                first_w = resume_w
                resume_w = -1
                changed = True
            else:
                for w in range(w0, w1):
                    if wk.i64[w, WK_BUSY] and wk.pass_end_ms[w] == now_ms:
                        changed = True
                        if disagg:
                            _, full = complete_disagg_pass(cfg, p, rq, wk, sims, s, w, now_ms, hits, fresh)
                            if full:
                                sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                return
                        else:
                            complete_pass(rq, wk, sims, s, w)
                if disagg and drain_transfers(rq, sims, s, now_ms):
                    changed = True
                if arrivals_due(rq, sims, s, now_ms) and admit_arrivals(cfg, rq, wl, wk, sims, s, now_ms) > 0:
                    changed = True
                if disagg:
                    ran, full = drain_actions(cfg, p, rq, wl, wk, sims, s, now_ms, hits, fresh)
                    if full:
                        sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                        return
                    changed = changed or ran
            # drive: a pass that ends at this instant completes inside the drive and
            # its worker goes again before higher ids; what its completion releases
            # (arrivals, handoff actions) waits for the next iteration of the drain
            for w in range(first_w, w1):
                while wk.i64[w, WK_BUSY] == 0 and wk.i64[w, WK_STALLED] == 0 \
                        and (wk.i64[w, WK_RUN_LEN] > 0 or wk.i64[w, WK_WAIT_LEN] > 0):
                    if log_rows > 0 and sims.i64[s, SM_PASS_LOG_LEN] >= log_rows:
                        sims.now_ms[s] = now_ms
                        sims.i64[s, SM_RESUME_WORKER] = w
                        sims.i64[s, SM_STATUS] = SIM_NEED_FLUSH
                        return
                    if not disagg:
                        # decode passes up to the next event, without walking the
                        # running list per pass (kernels.decode_run)
                        end_ms, n_passes, arena_full = decode_run(
                            cfg, p, rq, wl, wk, sims, s, w, now_ms,
                            quiet_until_ms(rq, wk, sims, s, w, now_ms),
                            log_rows - sims.i64[s, SM_PASS_LOG_LEN] if log_rows > 0 else 1 << 62,
                            acc, hits, fresh, scratch_tokens)
                        if arena_full:
                            sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                            return
                        if n_passes > 0:
                            sims.i64[s, SM_DECODE_RUN_PASSES] += n_passes
                            wk.i64[w, WK_BUSY] = 1
                            wk.pass_end_ms[w] = end_ms
                            changed = True
                            break
                    end_ms, had_effect, arena_full = run_pass(
                        cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)
                    if arena_full:
                        sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                        return
                    wk.i64[w, WK_BUSY] = 1
                    wk.pass_end_ms[w] = end_ms
                    if end_ms == now_ms:
                        if disagg:
                            # a decode worker's reservation retry at completion is an effect
                            reserved, full = complete_disagg_pass(cfg, p, rq, wk, sims, s, w, now_ms,
                                                                  hits, fresh)
                            if full:
                                sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                return
                            had_effect = had_effect or reserved
                        else:
                            complete_pass(rq, wk, sims, s, w)
                    if not had_effect:
                        # nothing can change for this worker until new work reaches it
                        wk.i64[w, WK_STALLED] = 1
                        break
                    changed = True
        if sims.i64[s, SM_NUM_TERMINAL] == sims.i64[s, SM_Q_LEN] and sims.i64[s, SM_OPEN_HANDOFFS] == 0:
            sims.now_ms[s] = now_ms
            sims.i64[s, SM_STATUS] = SIM_DONE
            return
        t_next = min(next_release_ms(rq, sims, s), next_transfer_ms(rq, sims, s))
        for w in range(w0, w1):
            if wk.i64[w, WK_BUSY] and wk.pass_end_ms[w] < t_next:
                t_next = wk.pass_end_ms[w]
        if t_next == np.inf:
            sims.now_ms[s] = now_ms
            sims.i64[s, SM_STATUS] = SIM_DEAD_END
            return
        now_ms = t_next


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
        run_simulation(cfg, p, rq, wl, wk, sims, s, acc, hits, fresh, scratch_tokens)
