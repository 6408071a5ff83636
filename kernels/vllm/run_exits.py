"""How a request leaves a vLLM-core worker's running list: preempted by recompute
(the pool is exhausted) or finished. The schedule step and the speculative verify
pass's block reservation (``spec.vllm_burst``) both preempt; both emission paths
finish."""

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on, note_event, num_active
from aisim_fast.kernels.kv.lease import release_lease
from aisim_fast.kernels.loop.rank_queues import push_terminal, run_remove_at, wait_push_front
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_PREEMPTION_FIFO, CFG_ROLE, EV_FINISHED,
                                              EV_PREEMPTED, EV_PRESSURE, ROLE_PREFILL, RQ_ALLOCATED,
                                              RQ_GENERATED, RQ_NUM_COMPUTED, RQ_PREEMPTIONS, RQ_STATUS,
                                              RQ_TERMINAL, RS_DONE, RS_HELD, RS_PREEMPTED, TERM_COMPLETED,
                                              WK_CAP_GEN, WK_PREEMPTIONS_TOTAL, WK_RUN_LEN, WK_RUN_OFF,
                                              WK_WAIT_LEN)


@kernel(cache=True, _nrt=False)
def preempt(cfg, p, rq, wk, w):
    """Preempt the last (lifo) or first (fifo) running request; returns it or -1."""
    n = wk.i64[w, WK_RUN_LEN]
    if n == 0:
        return -1
    idx = 0 if cfg.i64[w, CFG_PREEMPTION_FIFO] != 0 else n - 1
    v = wk.run_q[wk.i64[w, WK_RUN_OFF] + idx]
    logged = event_log_on(p)
    # the pressure event's state before (layout: its PREEMPTED and PRESSURE rows)
    waiting_before = wk.i64[w, WK_WAIT_LEN]
    request_blocks = ceil_div(rq.i64[v, RQ_ALLOCATED], cfg.i64[w, CFG_BLOCK_SIZE])
    if logged:
        note_event(p, w, EV_PREEMPTED, v, n, num_active(p, w))
    run_remove_at(wk, w, idx)
    rq.i64[v, RQ_STATUS] = RS_PREEMPTED
    rq.i64[v, RQ_NUM_COMPUTED] = 0
    rq.i64[v, RQ_PREEMPTIONS] += 1
    wk.i64[w, WK_PREEMPTIONS_TOTAL] += 1
    wk.i64[w, WK_CAP_GEN] += 1
    wait_push_front(wk, w, v)
    release_lease(cfg, p, rq, w, v)
    if logged:
        note_event(p, w, EV_PRESSURE, request_blocks, num_active(p, w), waiting_before)
    return v


@kernel(cache=True, _nrt=False)
def finish_request(cfg, p, rq, wk, w, q):
    """A request completes in this pass: lease back to the pool (tail first), onto
    the worker's terminal list. A disaggregated prefill (source) request instead
    keeps its lease - its KV is held for the decode side until ReleaseSource - and
    its terminal-list entry is the SourceHeld event of the pass."""
    wk.i64[w, WK_CAP_GEN] += 1  # its running slot is free (and its KV, unless held)
    if cfg.i64[w, CFG_ROLE] == ROLE_PREFILL:
        rq.i64[q, RQ_STATUS] = RS_HELD
    else:
        release_lease(cfg, p, rq, w, q)
        rq.i64[q, RQ_STATUS] = RS_DONE
        rq.i64[q, RQ_TERMINAL] = TERM_COMPLETED
    if event_log_on(p):
        note_event(p, w, EV_FINISHED, q, rq.i64[q, RQ_TERMINAL], rq.i64[q, RQ_GENERATED])
    push_terminal(rq, wk, w, q)
