"""SGLang's frontend stages (a rank's ``frontend``): the pools a request crosses
between its arrival and the scheduler's inbox. Compiled only for batches with the
feature (``Features.sglang_frontend``; the calls go through ``kernels.features.gate``).

The model follows the reference's. A worker's stages are crossed in order, one job
per stage. Each stage is a pool of ``workers`` servers: a job waits (FIFO) for a free
server, then holds it. The ``k`` jobs in service share the stage, and each is
served at the rate of ``service_ms x concurrency_scale[k - 1]`` (1 past the list's
end). A job owes a fraction of its service that the sharing reprices whenever it
changes. Completions are settled deadline by deadline. At each deadline every job
due then completes (in stage order, then slot order) before freed servers take
waiting jobs. A job that leaves the last stage reaches the scheduler's inbox at that
instant (``RQF_FRONTEND_READY_MS``); the host loop receives it at its next iteration.
The stages only ever see arrivals, so their deadlines are instants of the event
loop (``next_deadline_ms``).

Waiting jobs are linked by ``RQ_LINK`` (unused by aggregated runs, the only ones with
a frontend: it implies the host loop).
"""

import numpy as np

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.rank_queues import wait_push_back, wake
from aisim_fast.kernels.schema.layout import (FS_ACTIVE, FS_SCALE_LEN, FS_SCALE_OFF, FS_SERVICE_BITS,
                                              FS_SLOT_OFF, FS_WAIT_HEAD, FS_WAIT_TAIL, FS_WORKERS, RQ_LINK,
                                              RQ_STATUS, RQF_FRONTEND_READY_MS, RS_WAITING, SM_W_LEN,
                                              SM_W_OFF, WK_FE_NOW_BITS, WK_FE_STAGE_OFF, WK_FE_STAGES)

# a job this close to done at a deadline completes there (rounding at large times
# must not leave it spinning at one instant), as in the reference
DONE_EPS = 1e-12


@kernel(cache=True, _nrt=False, inline="always")
def _now(wk, w):
    return np.int64(wk.i64[w, WK_FE_NOW_BITS]).view(np.float64)


@kernel(cache=True, _nrt=False)
def _latency_ms(wk, g):
    """Service time of a job on stage row g at its current sharing."""
    service = np.int64(wk.fe_stage[g, FS_SERVICE_BITS]).view(np.float64)
    sharing = wk.fe_stage[g, FS_ACTIVE]
    i = max(sharing - 1, 0)
    scale = wk.fe_scale[wk.fe_stage[g, FS_SCALE_OFF] + i] if i < wk.fe_stage[g, FS_SCALE_LEN] else 1.0
    return service * scale


@kernel(cache=True, _nrt=False)
def _progress_to(wk, w, t_ms):
    """Every job in service works until ``t_ms`` at its stage's current rate."""
    elapsed = t_ms - _now(wk, w)
    g0 = wk.i64[w, WK_FE_STAGE_OFF]
    for g in range(g0, g0 + wk.i64[w, WK_FE_STAGES]):
        latency = _latency_ms(wk, g)
        k0 = wk.fe_stage[g, FS_SLOT_OFF]
        for k in range(k0, k0 + wk.fe_stage[g, FS_ACTIVE]):
            wk.fe_slot_rem[k] = 0.0 if latency == 0.0 else wk.fe_slot_rem[k] - elapsed / latency
    wk.i64[w, WK_FE_NOW_BITS] = np.float64(t_ms).view(np.int64)


@kernel(cache=True, _nrt=False)
def _refill(rq, wk, w):
    """Free servers take waiting jobs, stage by stage."""
    g0 = wk.i64[w, WK_FE_STAGE_OFF]
    for g in range(g0, g0 + wk.i64[w, WK_FE_STAGES]):
        while wk.fe_stage[g, FS_ACTIVE] < wk.fe_stage[g, FS_WORKERS] and wk.fe_stage[g, FS_WAIT_HEAD] >= 0:
            q = wk.fe_stage[g, FS_WAIT_HEAD]
            wk.fe_stage[g, FS_WAIT_HEAD] = rq.i64[q, RQ_LINK]
            if rq.i64[q, RQ_LINK] < 0:
                wk.fe_stage[g, FS_WAIT_TAIL] = -1
            rq.i64[q, RQ_LINK] = -1
            k = wk.fe_stage[g, FS_SLOT_OFF] + wk.fe_stage[g, FS_ACTIVE]
            wk.fe_slot_q[k] = q
            wk.fe_slot_rem[k] = 1.0
            wk.fe_stage[g, FS_ACTIVE] += 1


@kernel(cache=True, _nrt=False, inline="always")
def _enqueue(rq, wk, g, q):
    rq.i64[q, RQ_LINK] = -1
    tail = wk.fe_stage[g, FS_WAIT_TAIL]
    if tail < 0:
        wk.fe_stage[g, FS_WAIT_HEAD] = q
    else:
        rq.i64[tail, RQ_LINK] = q
    wk.fe_stage[g, FS_WAIT_TAIL] = q


@kernel(cache=True, _nrt=False)
def _next_job_deadline_ms(wk, w):
    """The earliest completion at the current rates (inf when no job is in service)."""
    t = np.inf
    now = _now(wk, w)
    g0 = wk.i64[w, WK_FE_STAGE_OFF]
    for g in range(g0, g0 + wk.i64[w, WK_FE_STAGES]):
        latency = _latency_ms(wk, g)
        k0 = wk.fe_stage[g, FS_SLOT_OFF]
        for k in range(k0, k0 + wk.fe_stage[g, FS_ACTIVE]):
            t = min(t, now + max(wk.fe_slot_rem[k], 0.0) * latency)
    return t


@kernel(cache=True, _nrt=False)
def _settle(rq, wk, w, t_ms):
    """Complete every job due by ``t_ms``, deadline by deadline, then move the pools'
    clock to ``t_ms``; returns how many requests reached the scheduler."""
    n_ready = 0
    g0 = wk.i64[w, WK_FE_STAGE_OFF]
    g1 = g0 + wk.i64[w, WK_FE_STAGES]
    while True:
        deadline = _next_job_deadline_ms(wk, w)
        if not deadline <= t_ms:
            break
        # which jobs are due, from the rates before the deadline
        now = _now(wk, w)
        for g in range(g0, g1):
            latency = _latency_ms(wk, g)
            k0 = wk.fe_stage[g, FS_SLOT_OFF]
            for k in range(k0, k0 + wk.fe_stage[g, FS_ACTIVE]):
                wk.fe_slot_due[k] = 1 if now + max(wk.fe_slot_rem[k], 0.0) * latency <= deadline else 0
        _progress_to(wk, w, deadline)
        # every job due completes before any server takes a waiting job
        for g in range(g0, g1):
            k0 = wk.fe_stage[g, FS_SLOT_OFF]
            keep = k0
            for k in range(k0, k0 + wk.fe_stage[g, FS_ACTIVE]):
                q = wk.fe_slot_q[k]
                if wk.fe_slot_due[k] != 0 or wk.fe_slot_rem[k] <= DONE_EPS:
                    if g + 1 < g1:
                        _enqueue(rq, wk, g + 1, q)
                    else:
                        # it leaves the frontend for the scheduler's inbox
                        rq.f64[q, RQF_FRONTEND_READY_MS] = deadline
                        rq.i64[q, RQ_STATUS] = RS_WAITING
                        wait_push_back(wk, w, q)
                        wake(wk, w)
                        n_ready += 1
                else:
                    wk.fe_slot_q[keep] = q
                    wk.fe_slot_rem[keep] = wk.fe_slot_rem[k]
                    keep += 1
            wk.fe_stage[g, FS_ACTIVE] = keep - k0
        _refill(rq, wk, w)
    _progress_to(wk, w, t_ms)
    return n_ready


@kernel(cache=True, _nrt=False)
def submit(rq, wk, w, q, now_ms):
    """Request q, placed on worker w, arrives at its frontend at ``now_ms``."""
    _settle(rq, wk, w, now_ms)
    _enqueue(rq, wk, wk.i64[w, WK_FE_STAGE_OFF], q)
    _refill(rq, wk, w)


@kernel(cache=True, _nrt=False)
def deliver(rq, wk, sims, s, now_ms):
    """Every worker of simulation s settles its frontend to ``now_ms``: the requests
    that left it reach their scheduler's inbox. Returns how many did. Every instant
    advances every pool, whether a job is due or not, as the reference's do: a job's
    owed service is rounded at each step, and the exit times are its to the last bit
    (three workers on the 1k trace: 33 of 1,000 exits a bit off otherwise)."""
    n = 0
    w0 = sims.i64[s, SM_W_OFF]
    for w in range(w0, w0 + sims.i64[s, SM_W_LEN]):
        if wk.i64[w, WK_FE_STAGES] > 0:
            n += _settle(rq, wk, w, now_ms)
    return n


@kernel(cache=True, _nrt=False)
def next_deadline_ms(wk, sims, s):
    """The earliest frontend completion of simulation s (inf when none is due)."""
    t = np.inf
    w0 = sims.i64[s, SM_W_OFF]
    for w in range(w0, w0 + sims.i64[s, SM_W_LEN]):
        if wk.i64[w, WK_FE_STAGES] > 0:
            t = min(t, _next_job_deadline_ms(wk, w))
    return t


# behind the sglang_frontend feature gate (kernels.features): a run without stages
# never compiles them
submit_gated = gate("sglang_frontend", submit)
deliver_gated = gate("sglang_frontend", deliver, np.int64(0))
next_deadline_gated = gate("sglang_frontend", next_deadline_ms, 0.0)
