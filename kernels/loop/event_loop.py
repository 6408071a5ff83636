"""The event loop of one simulation and the batch entry kernels, one compiled pair
per topology and backend family (four): an aggregated run compiles no handoff code, a
disaggregated one no decode runs, and only SGLang runs compile SGLang's scheduler.

The loop follows the reference's per-instant drain (spec/replay.md §1.4, verified
against the goldens): pass completions in worker order (prefill workers come first),
then transfers completing now (disaggregated), then arrivals, then the FIFO handoff
action queue (disaggregated), then idle workers with work start passes in worker
order; a pass that ends at ``now`` completes inside the drive and its worker goes
again. Repeat until nothing changes, then jump to the next pass end, release time or
transfer completion.

A call advances each simulation through every instant up to ``horizon_ms`` (inf =
to completion) and returns; the next call continues from there with exactly the
state a single call would have had (an instant is always drained whole, and a
drained instant drained again changes nothing). A call also returns early when the
pass log is full (``SIM_NEED_FLUSH``, resumed mid-drive) or the simulation ends
(done, dead end, arena or queue capacity exceeded).

The topology is a compile-time constant of each compiled loop (a closure
variable, so Numba prunes the other topology's branches before typing them), and so
is the backend family (vLLM / TRT-LLM, or SGLang): one source, four
specializations, and a run compiles only the ones it uses. Within a set, the
optional features (router, attention DP, TRT-LLM, AIC) compile only for batches whose
``cfg.features`` carry them (kernels.features).

The event loop and its batch entries use no Numba runtime (NRT): ``replay_batch``
allocates the scratch arrays, and they are compiled with ``_nrt=False``. A Numba call
that receives an array otherwise reference-counts it on entry and exit (a call
into the runtime and an atomic operation per array), and the loops pass the whole
state bundle (~25 arrays) to a few functions per forward pass: without the runtime
those calls cost nothing extra, which halved the kernel time of a 10k-request
replay. The arrays all belong to the driver and outlive the call."""

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit

from aisim_fast.kernels.disagg.handoff import (complete_disagg_ranks, drain_actions, drain_transfers,
                                                next_transfer_ms)
from aisim_fast.kernels.dp.attention_dp import (begin_group_pass_gated, end_group_pass_gated,
                                                group_has_work_gated, group_woken_gated, rank_has_work,
                                                rank_queued)
from aisim_fast.kernels.jit import compile_for, compile_notice, kernel_part, mark_compiled
from aisim_fast.kernels.kv.block_pool import (NO_PASS, event_log_on, event_set_clock, kv_events_visible_at,
                                              outputs_logged)
from aisim_fast.kernels.loop.arrivals import (admit_arrivals, arrivals_due, complete_group_gated,
                                              complete_pass, next_release_ms)
from aisim_fast.kernels.loop.backends import (decode_run, group_rank_pass, group_sglang_rank_pass, run_pass,
                                              sglang_run_pass)
from aisim_fast.kernels.loop.busy_heap import busy_pop, busy_push, next_pass_end_ms
from aisim_fast.kernels.schema.layout import (ACC_SIZE, CFG_DP_RANK, CFG_DP_SIZE, CFG_SPEC_NEXTN, CFG_POLICY, EVH_LEN,
                                              POLICY_SGLANG, PW_PASS_NUM, SIM_ARENA_FULL, SIM_CAPACITY,
                                              SIM_DEAD_END, SIM_DONE, SIM_EVENTS_FULL, SIM_NEED_FLUSH,
                                              SIM_PAUSED, SIM_RUNNING, SM_DEAD_IN_FLIGHT,
                                              SM_DECODE_RUN_PASSES, SM_FRONTEND, SM_INDEPENDENT,
                                              SM_NUM_TERMINAL,
                                              SM_OPEN_HANDOFFS, SM_PASS_LOG_LEN, SM_PREFILL_LEN, SM_Q_LEN,
                                              SM_RESUME_WORKER, SM_STATUS, SM_W_LEN, SM_W_OFF, WK_BUSY,
                                              WK_HL_IN_FLIGHT, WK_LAST_PASS_NS, WK_OVERFLOW, WK_RUN_LEN, WK_SG_READY_LEN,
                                              WK_STALLED, WK_WAIT_LEN)
from aisim_fast.kernels.sglang.core import effect_free_pass_gives_up, finish_group_pass, worker_in_flight
from aisim_fast.kernels.sglang.frontend import deliver_gated, next_deadline_gated
from aisim_fast.kernels.vllm.decode_run import quiet_until_ms


def _event_loop(disaggregated, sglang=False):
    """The event loop compiled for one topology (``disaggregated`` is a constant) and
    backend family (``sglang``: SGLang workers; else vLLM / TRT-LLM)."""
    # The closure holds constants only: Numba keys a closure's cache entry by the pickle
    # of its variables, and a kernel pickles with a per-process uuid, so a closure over
    # one would compile anew in every process. Kernels are called by their global names,
    # the other backend's call pruned by the constant ``sglang``.
    # the handoff's backend: its type prunes the other backend's code (disagg.handoff)
    sg = 1 if sglang else None

    def run_simulation(cfg, p, rq, wl, wk, sims, s, horizon_ms, acc, hits, fresh, scratch_tokens):
        """Advance simulation s through every instant up to ``horizon_ms``, until it is
        done or needs the driver."""
        w0 = sims.i64[s, SM_W_OFF]
        w1 = w0 + sims.i64[s, SM_W_LEN]
        log_rows = sims.pass_log.shape[1]
        sims.i64[s, SM_STATUS] = SIM_RUNNING
        now_ms = sims.now_ms[s]
        resume_w = sims.i64[s, SM_RESUME_WORKER]
        sims.i64[s, SM_RESUME_WORKER] = -1
        # a call may follow changes the driver made (requests added): look at every
        # worker once; afterwards only those something woke
        for w in range(w0, w1):
            wk.ready[w] = 1
        events_on = event_log_on(p)
        # attention DP: ranks of dp_size per logical worker behind one pass barrier
        # (kernels.dp.attention_dp; each pool of a disaggregated simulation its own size)
        dp_any = max(cfg.i64[w0, CFG_DP_SIZE], cfg.i64[w0 + sims.i64[s, SM_PREFILL_LEN], CFG_DP_SIZE])
        # a decode run emits without visiting each request: not while every token is
        # logged, nor for ranks that wait for their siblings; and only for a lone
        # worker (a round-robin worker unit, a one-worker run) or independent ones
        # (kernels.vllm.decode_run): else any other worker's pass end ends a run, so runs
        # hold a pass or two and cost more than plain passes (10k-request trace on 8
        # workers run whole: 8% more for kv_router, random and round robin; 19-29%
        # more at a twentieth to a third of its rate); nor for speculating ranks, whose
        # passes each draw how many tokens they emit (kernels.spec)
        decode_runs = not outputs_logged(p, s) and dp_any == 1 and (
            w1 - w0 == 1 or sims.i64[s, SM_INDEPENDENT] != 0) and cfg.i64[w0, CFG_SPEC_NEXTN] == 0
        n_event_rows = p.event_log.shape[1] - 1  # event rows
        while True:
            if events_on:
                event_set_clock(p, s, now_ms)  # the time of this instant's KV events
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
                    # passes ending now, in worker order (the busy heap's order)
                    while next_pass_end_ms(wk, sims, s) == now_ms:
                        w = busy_pop(wk, sims, s)
                        wk.ready[w] = 1
                        changed = True
                        dp = cfg.i64[w, CFG_DP_SIZE]  # a group: its rank 0 is in the heap
                        if disaggregated:
                            _, full = complete_disagg_ranks(cfg, p, rq, wl, wk, sims, s, w, dp, now_ms,
                                                            hits, fresh, scratch_tokens, sg)
                            if full:
                                sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                return
                        elif dp > 1:
                            complete_group_gated(cfg.features, cfg, rq, wk, sims, s, w, dp)
                        else:
                            complete_pass(cfg, rq, wk, sims, s, w)
                    if disaggregated and drain_transfers(rq, sims, s, now_ms):
                        changed = True
                    if not disaggregated and sims.i64[s, SM_FRONTEND] != 0 \
                            and deliver_gated(cfg.features, rq, wk, sims, s, now_ms) > 0:
                        changed = True  # SGLang frontend stages delivered to their schedulers
                    if not disaggregated and arrivals_due(rq, sims, s, now_ms) \
                            and admit_arrivals(cfg, p, rq, wl, wk, sims, s, now_ms) > 0:
                        changed = True
                    if disaggregated:
                        ran, full = drain_actions(cfg, p, rq, wl, wk, sims, s, now_ms, hits, fresh,
                                                  scratch_tokens, sg)
                        if full:
                            sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                            return
                        changed = changed or ran
                # drive: a pass that ends at this instant completes inside the drive and
                # its worker goes again before higher ids; what its completion releases
                # (arrivals, handoff actions) waits for the next iteration of the drain
                for w in range(first_w, w1):
                    dp = cfg.i64[w, CFG_DP_SIZE]
                    if dp > 1:
                        if cfg.i64[w, CFG_DP_RANK] != 0 or not group_woken_gated(cfg.features, wk, w, dp):
                            continue  # a group is driven from its rank 0
                        while group_has_work_gated(cfg.features, wk, w, dp):
                            if log_rows > 0 and sims.i64[s, SM_PASS_LOG_LEN] + dp > log_rows:
                                wk.ready[w] = 1  # the resumed drive starts with it
                                sims.now_ms[s] = now_ms
                                sims.i64[s, SM_RESUME_WORKER] = w
                                sims.i64[s, SM_STATUS] = SIM_NEED_FLUSH
                                return
                            first_row = sims.i64[s, SM_PASS_LOG_LEN]
                            first_event = p.event_log[s, 0, EVH_LEN] if events_on else 0
                            begin_group_pass_gated(cfg.features, sims, s)
                            end_ms = now_ms
                            had_effect = False
                            for r in range(w, w + dp):
                                if not rank_has_work(wk, r):
                                    # it waits for the barrier all the same, with no pass
                                    # of its own in flight (kv_router: all it stored and
                                    # evicted is seen)
                                    p.w64[r, PW_PASS_NUM] = NO_PASS
                                    continue
                                if sglang:
                                    rank_end_ms, rank_effect, arena_full = group_sglang_rank_pass(
                                        cfg.features, cfg, p, rq, wl, wk, sims, s, r, now_ms, acc, hits,
                                        fresh, scratch_tokens)
                                else:
                                    rank_end_ms, rank_effect, arena_full = group_rank_pass(
                                        cfg.features, cfg, p, rq, wl, wk, sims, s, r, now_ms, acc, hits,
                                        fresh, scratch_tokens)
                                if arena_full:
                                    sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                    return
                                end_ms = max(end_ms, rank_end_ms)
                                if rank_effect:
                                    had_effect = True
                                else:
                                    wk.i64[r, WK_STALLED] = 1  # until new work reaches it
                            if sglang:
                                finish_group_pass(cfg, wk, w, dp)
                            end_group_pass_gated(cfg.features, cfg, p, rq, wk, sims, s, w, dp, end_ms, first_row, first_event)
                            if end_ms != now_ms:
                                busy_push(wk, sims, s, w)
                            elif disaggregated:
                                # a decode rank's reservation retry at completion is an effect
                                reserved, full = complete_disagg_ranks(cfg, p, rq, wl, wk, sims, s, w, dp,
                                                                       now_ms, hits, fresh, scratch_tokens, sg)
                                if full:
                                    sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                    return
                                had_effect = had_effect or reserved
                            else:
                                complete_group_gated(cfg.features, cfg, rq, wk, sims, s, w, dp)
                            if not had_effect:
                                gives_up = sglang and end_ms == now_ms and not disaggregated
                                if sglang and end_ms == now_ms and disaggregated:
                                    # the group retries while any rank's ratio still decays
                                    for r in range(w, w + dp):
                                        if rank_queued(wk, r) and effect_free_pass_gives_up(cfg, wk, r):
                                            gives_up = True
                                if gives_up:
                                    # as a lone SGLang worker (below): a dead end
                                    dead = 0
                                    for r in range(w, w + dp):
                                        dead += worker_in_flight(rq, sims, s, r)
                                    sims.i64[s, SM_DEAD_IN_FLIGHT] = dead
                                    sims.now_ms[s] = now_ms
                                    sims.i64[s, SM_STATUS] = SIM_DEAD_END
                                    return
                                break
                            changed = True
                        continue
                    if wk.ready[w] == 0:
                        continue  # busy, stalled or without work since it was last driven
                    wk.ready[w] = 0
                    while wk.i64[w, WK_BUSY] == 0 and wk.i64[w, WK_STALLED] == 0 \
                            and (wk.i64[w, WK_RUN_LEN] > 0 or wk.i64[w, WK_WAIT_LEN] > 0
                                 or (sglang and disaggregated and wk.i64[w, WK_SG_READY_LEN] > 0)
                                 # an SGLang host loop still to observe its last forward
                                 or (sglang and wk.i64[w, WK_HL_IN_FLIGHT] != 0)):
                        if log_rows > 0 and sims.i64[s, SM_PASS_LOG_LEN] >= log_rows:
                            wk.ready[w] = 1  # the resumed drive starts with it
                            sims.now_ms[s] = now_ms
                            sims.i64[s, SM_RESUME_WORKER] = w
                            sims.i64[s, SM_STATUS] = SIM_NEED_FLUSH
                            return
                        quiet_ms = -np.inf
                        if not disaggregated and not sglang and decode_runs:
                            quiet_ms = min(quiet_until_ms(rq, wk, sims, s, w, now_ms), horizon_ms)
                        if quiet_ms - now_ms > 3e-6 * wk.i64[w, WK_LAST_PASS_NS]:
                            # decode passes up to the next event, without walking the
                            # running list per pass (kernels.vllm.decode_run), when the next
                            # event leaves room for three passes as long as the last one:
                            # a run walks the running list twice, and a shorter one costs
                            # more than its passes run plainly
                            end_ms, n_passes, arena_full = decode_run(
                                cfg, p, rq, wl, wk, sims, s, w, now_ms, quiet_ms,
                                log_rows - sims.i64[s, SM_PASS_LOG_LEN] if log_rows > 0 else 1 << 62,
                                acc, hits, fresh, scratch_tokens)
                            if arena_full:
                                sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                return
                            if n_passes > 0:
                                sims.i64[s, SM_DECODE_RUN_PASSES] += n_passes
                                wk.i64[w, WK_LAST_PASS_NS] = np.int64((end_ms - now_ms) * 1e6 / n_passes)
                                wk.i64[w, WK_BUSY] = 1
                                wk.pass_end_ms[w] = end_ms
                                busy_push(wk, sims, s, w)  # a decode run ends after now
                                changed = True
                                break
                        first_event = p.event_log[s, 0, EVH_LEN] if events_on else 0
                        if sglang:
                            end_ms, had_effect, arena_full = sglang_run_pass(
                                cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)
                        else:
                            end_ms, had_effect, arena_full = run_pass(
                                cfg, p, rq, wl, wk, sims, s, w, now_ms, acc, hits, fresh, scratch_tokens)
                        if arena_full:
                            sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                            return
                        if events_on:
                            kv_events_visible_at(p, s, first_event, end_ms)  # at the pass end
                        wk.i64[w, WK_LAST_PASS_NS] = np.int64((end_ms - now_ms) * 1e6)
                        wk.i64[w, WK_BUSY] = 1
                        wk.pass_end_ms[w] = end_ms
                        if end_ms != now_ms:
                            busy_push(wk, sims, s, w)
                        if end_ms == now_ms:
                            if disaggregated:
                                # a decode worker's reservation retry at completion is an effect
                                reserved, full = complete_disagg_ranks(cfg, p, rq, wl, wk, sims, s, w, np.int64(1),
                                                                       now_ms, hits, fresh, scratch_tokens, sg)
                                if full:
                                    sims.i64[s, SM_STATUS] = SIM_ARENA_FULL
                                    return
                                had_effect = had_effect or reserved
                            else:
                                complete_pass(cfg, rq, wk, sims, s, w)
                        if not had_effect:
                            if sglang and end_ms == now_ms and (
                                    effect_free_pass_gives_up(cfg, wk, w) or not disaggregated):
                                # the reference gives up on an SGLang worker whose pass
                                # keeps changing nothing at one instant; an aggregated
                                # one no handoff command could ever wake: a dead end
                                # with that worker's requests in flight
                                sims.i64[s, SM_DEAD_IN_FLIGHT] = worker_in_flight(rq, sims, s, w)
                                sims.now_ms[s] = now_ms
                                sims.i64[s, SM_STATUS] = SIM_DEAD_END
                                return
                            # nothing can change for this worker until new work reaches it
                            wk.i64[w, WK_STALLED] = 1
                            break
                        changed = True
                if disaggregated and arrivals_due(rq, sims, s, now_ms) \
                        and admit_arrivals(cfg, p, rq, wl, wk, sims, s, now_ms) > 0:
                    # the reference submits this instant's arrivals to the prefill pool
                    # only after its workers went: an arrival at a pass end joins the
                    # pass its worker starts then only when that worker had no work
                    changed = True
            if events_on and p.event_log[s, 0, EVH_LEN] > n_event_rows:
                # more events than the log holds: the driver reruns with a larger log
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_EVENTS_FULL
                return
            t_next = min(next_release_ms(rq, sims, s), next_transfer_ms(rq, sims, s),
                         next_pass_end_ms(wk, sims, s))
            if sims.i64[s, SM_FRONTEND] != 0:
                t_next = min(t_next, next_deadline_gated(cfg.features, wk, sims, s))
            if wk.i64[w0, WK_OVERFLOW]:
                # a queue push found no room (and wrote nothing): the results would be
                # wrong, the driver reruns with larger queues
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_CAPACITY
                return
            if sims.i64[s, SM_NUM_TERMINAL] == sims.i64[s, SM_Q_LEN] and sims.i64[s, SM_OPEN_HANDOFFS] == 0:
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_DONE
                return
            if events_on and 2 * p.event_log[s, 0, EVH_LEN] > n_event_rows:
                # half full at the end of an instant: the driver drains the log and
                # the next call goes on from this (drained) instant
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_NEED_FLUSH
                return
            if t_next == np.inf:
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_DEAD_END
                return
            if t_next > horizon_ms:
                # every instant up to the horizon is drained: the next call goes on from here
                sims.now_ms[s] = now_ms
                sims.i64[s, SM_STATUS] = SIM_PAUSED
                return
            now_ms = t_next

    # compiled on its own, not inlined into the batch entry: Numba inlines by copying
    # the callee's IR, at a cost that grows with its blocks times its variables (~20
    # CPU-s for this loop)
    return njit(cache=True, _nrt=False)(_variant(run_simulation, disaggregated, sglang))


def _variant(fn, disaggregated, sglang):
    """``fn`` (a closure of one kernel set) named after its set. Numba names a compiled
    function's machine code after its qualified name and a per-process counter: two
    closures of one source compiled in different processes can get the same symbol,
    and a process that loads both from the cache then runs the first one's code for
    both (an SGLang disaggregated batch ran the aggregated loop). One name per set
    keeps their symbols and cache files apart."""
    tag = ("disaggregated" if disaggregated else "aggregated") + ("_sglang" if sglang else "")
    fn.__name__ = f"{fn.__name__}_{tag}"
    fn.__qualname__ = f"{fn.__qualname__}_{tag}"
    return fn


run_simulation_aggregated = _event_loop(False)
run_simulation_disaggregated = _event_loop(True)
run_simulation_aggregated_sglang = _event_loop(False, sglang=True)
run_simulation_disaggregated_sglang = _event_loop(True, sglang=True)


def _batch_entry(disaggregated, sglang=False):
    """The batch entry kernel of one topology: a serial loop over simulations that
    releases the GIL, so the driver runs chunks of a batch on parallel threads
    (``replay_batch``). A ``parallel=True`` loop would cost ~8 CPU-seconds more to
    compile, on every first run, for the same threads. The scratch arrays come from the
    driver, so the entry needs no Numba runtime (see the module docstring). It calls its
    set's loop by global name (closures over constants only: see ``_event_loop``)."""

    def replay(cfg, p, rq, wl, wk, sims, sim_ids, horizon_ms, acc, hits, fresh, scratch_tokens):
        """Advance every simulation in ``sim_ids`` that is still running (or paused at
        a horizon or for a flush) through every instant up to ``horizon_ms``, until
        done, dead end, capacity exceeded, or its pass log is full. Simulations share
        no state, so calls on disjoint ``sim_ids`` (each with scratch of its own) may
        run concurrently."""
        for i in range(sim_ids.shape[0]):
            s = sim_ids[i]
            status = sims.i64[s, SM_STATUS]
            if status != SIM_RUNNING and status != SIM_NEED_FLUSH and status != SIM_PAUSED:
                continue
            if disaggregated:
                if sglang:
                    run_simulation_disaggregated_sglang(cfg, p, rq, wl, wk, sims, s, horizon_ms, acc, hits,
                                                        fresh, scratch_tokens)
                else:
                    run_simulation_disaggregated(cfg, p, rq, wl, wk, sims, s, horizon_ms, acc, hits, fresh,
                                                 scratch_tokens)
            elif sglang:
                run_simulation_aggregated_sglang(cfg, p, rq, wl, wk, sims, s, horizon_ms, acc, hits, fresh,
                                                 scratch_tokens)
            else:
                run_simulation_aggregated(cfg, p, rq, wl, wk, sims, s, horizon_ms, acc, hits, fresh,
                                          scratch_tokens)

    return njit(cache=True, nogil=True, _nrt=False)(_variant(replay, disaggregated, sglang))


replay_aggregated_batch = _batch_entry(False)
replay_disaggregated_batch = _batch_entry(True)
replay_sglang_batch = _batch_entry(False, sglang=True)
replay_sglang_disaggregated_batch = _batch_entry(True, sglang=True)


_THREADS = [0]  # set_kernel_threads: 0 = NUMBA_NUM_THREADS


def set_kernel_threads(n: int) -> None:
    """Run batches on ``n`` threads from now on (0: back to ``NUMBA_NUM_THREADS``); a
    sweep's worker processes run one each."""
    _THREADS[0] = max(0, int(n))


def kernel_threads() -> int:
    """Threads a batch runs on: ``set_kernel_threads``, else ``NUMBA_NUM_THREADS``
    (Numba's own setting, every core by default)."""
    return _THREADS[0] or max(1, int(numba.config.NUMBA_NUM_THREADS))


_EXECUTORS: dict = {}


def _executor(n_threads: int) -> ThreadPoolExecutor:
    """One thread pool per thread count, kept for the process: a sweep runs many
    batches, and starting threads for each would cost more than a small batch."""
    pool = _EXECUTORS.get(n_threads)
    if pool is None:
        pool = _EXECUTORS[n_threads] = ThreadPoolExecutor(n_threads, thread_name_prefix="aisim-kernel")
    return pool


_CHECKED: set = set()  # (batch entry, features) compiled or loaded in this process


def _scratch(max_lease_blocks, max_block_size):
    """The scratch arrays of one batch call (one set per concurrent call): the pass
    counters, a lease's hit and fresh blocks, one block's tokens."""
    return (np.zeros(ACC_SIZE, np.int64), np.empty(max(1, int(max_lease_blocks)), np.int32),
            np.empty(max(1, int(max_lease_blocks)), np.int32),
            np.empty(max(1, int(max_block_size)), np.uint32))


def replay_batch(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size,
                 horizon_ms=np.inf):
    """Advance the simulations ``sim_ids`` (see the entries above), each with the entry
    of its topology: a batch may mix them, and only the entries it uses compile.
    Chunks of the batch run on ``kernel_threads()`` threads, longest first."""
    sim_ids = np.asarray(sim_ids, np.int64)
    disagg = sims.i64[sim_ids, SM_PREFILL_LEN] > 0
    # a simulation runs one backend (both pools of a disaggregated one): its first worker's
    sglang = cfg.i64[sims.i64[sim_ids, SM_W_OFF], CFG_POLICY] == POLICY_SGLANG
    jobs = []
    n_threads = kernel_threads()
    parts = []
    for part, entry, ids in (("aggregated", replay_aggregated_batch, sim_ids[~disagg & ~sglang]),
                             ("disaggregated", replay_disaggregated_batch, sim_ids[disagg & ~sglang]),
                             ("sglang", replay_sglang_batch, sim_ids[sglang & ~disagg]),
                             ("sglang_disaggregated", replay_sglang_disaggregated_batch,
                              sim_ids[sglang & disagg])):
        if len(ids) == 0:
            continue
        parts.append(kernel_part(part, cfg.features))
        if n_threads == 1 or len(ids) == 1:
            jobs.append((entry, ids))
            continue
        # simulations in order of their size (requests) so the largest start first;
        # small chunks keep the threads busy until the end
        order = ids[np.argsort(-sims.i64[ids, SM_Q_LEN], kind="stable")]
        n_chunks = min(len(order), 4 * n_threads)
        # each chunk a contiguous copy: one compiled version per entry (a strided
        # slice is another array type, and so another 20-70 s compile the first time a
        # run splits, after the part's compile notice had already been given)
        jobs.extend((entry, np.ascontiguousarray(order[c::n_chunks])) for c in range(n_chunks))
    horizon_ms = float(horizon_ms)
    compile_notice(parts)
    for entry, ids in jobs:
        # compile (or load) each entry first, under the cache lock; then run unlocked.
        # The state's types are fixed by its layout and its feature set (each set its
        # own version, kernels.features) and the ids are always contiguous, and typing
        # the whole state costs ~1 ms, so each entry is checked once per process and
        # feature set
        if (entry, cfg.features) not in _CHECKED:
            compile_for(entry, tuple(numba.typeof(a) for a in (cfg, p, rq, wl, wk, sims, ids, horizon_ms)
                                     + _scratch(1, 1)))
            _CHECKED.add((entry, cfg.features))
    if n_threads == 1 or len(jobs) == 1:
        scratch = _scratch(max_lease_blocks, max_block_size)
        for entry, ids in jobs:
            entry(cfg, p, rq, wl, wk, sims, ids, horizon_ms, *scratch)
    else:
        pool = _executor(n_threads)
        futures = [pool.submit(entry, cfg, p, rq, wl, wk, sims, ids, horizon_ms,
                               *_scratch(max_lease_blocks, max_block_size)) for entry, ids in jobs]
        for f in futures:
            f.result()
    for part in parts:
        mark_compiled(part)
