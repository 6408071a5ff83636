"""SGLang's overlapped host loop (``sglang.host_loop: true``): the timeline of one
scheduler iteration, compiled only for batches with the feature
(``Features.sglang_host_loop``; the calls go through ``kernels.features.gate``).

The scheduler thread runs one batch ahead of the GPU. An iteration that starts at
``selected`` takes in the requests that arrived, selects and launches its batch, and
only then waits for the previous forward and processes its result. The GPU is one
stream, so the forward runs from ``max(gpu_free, selected)`` for its modeled time. The
iteration ends once the previous forward is observed, at ``max(selected,
previous_forward_end)``, or at ``selected`` when nothing was in flight. What a forward
produces for the scheduler travels with it and becomes visible when it is observed,
at the end of the next iteration:

* its output tokens. The next iteration starts as soon as this one ends and
  observes this forward at ``max(its start, this forward's end)``, which is the
  forward's end. So a token's time is known when its forward launches, and it is
  given then (``forward_end``).
* its terminals. A request whose last token the forward gave stays in the batch, and
  keeps its slot and its KV, until the forward is observed; it is finished then
  (``RQ_HL_DONE_STAMP``; kernels.sglang.core ``_observe_forward``). It emits no token
  in the next forward, and the decode memory check and its retraction pass it over,
  but that step is timed over the whole batch, it included.
* the prefix-cache commit of a request's first token. Its prompt enters the radix
  tree when the forward is observed, after the next batch was selected
  (``RQ_HL_COMMIT_STAMP`` / ``RQ_HL_COMMIT_THROUGH``).

The iteration's own work (selection, launch, result processing) is free, as in the
reference's model. Only aggregated ranks run the host loop; the reference refuses it
for disaggregated ones.
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.rank_queues import wait_at
from aisim_fast.kernels.schema.layout import (RQ_HL_DONE_STAMP, RQF_RECEIVED_MS, WK_HL_GPU_FREE_BITS,
                                              WK_HL_IN_FLIGHT, WK_HL_IN_FLIGHT_END_BITS, WK_RUN_LEN, WK_RUN_OFF,
                                              WK_WAIT_LEN)


@kernel(cache=True, _nrt=False)
def forward_end(wk, w, now_ms, end_ms):
    """Launch the forward that the plain timeline runs from ``now_ms`` to ``end_ms``,
    and return when it ends on the GPU timeline. Its modeled time is ``end_ms -
    now_ms``, taken as the reference takes it; it starts once the GPU is free."""
    forward_ms = end_ms - now_ms
    gpu_free_ms = np.int64(wk.i64[w, WK_HL_GPU_FREE_BITS]).view(np.float64)
    gpu_end_ms = max(gpu_free_ms, now_ms) + forward_ms
    wk.i64[w, WK_HL_GPU_FREE_BITS] = np.float64(gpu_end_ms).view(np.int64)
    return gpu_end_ms


@kernel(cache=True, _nrt=False)
def iteration_end(wk, w, now_ms, launched, gpu_end_ms):
    """End the iteration that started at ``now_ms``: it observes the forward in flight
    (if any) and leaves its own (``launched``, ending at ``gpu_end_ms``) in flight.
    Returns (when the iteration ends, whether a forward was observed)."""
    observed = wk.i64[w, WK_HL_IN_FLIGHT] != 0
    end_ms = now_ms
    if observed:
        end_ms = max(now_ms, np.int64(wk.i64[w, WK_HL_IN_FLIGHT_END_BITS]).view(np.float64))
    if launched:
        wk.i64[w, WK_HL_IN_FLIGHT] = 1
        wk.i64[w, WK_HL_IN_FLIGHT_END_BITS] = np.float64(gpu_end_ms).view(np.int64)
    else:
        wk.i64[w, WK_HL_IN_FLIGHT] = 0
    return end_ms, observed



@kernel(cache=True, _nrt=False)
def receive(rq, wk, w, now_ms):
    """The iteration starting at ``now_ms`` drains the scheduler's inbox: the requests
    waiting that no iteration took in yet are received now."""
    for j in range(wk.i64[w, WK_WAIT_LEN]):
        q = wait_at(wk, w, j)
        if np.isnan(rq.f64[q, RQF_RECEIVED_MS]):
            rq.f64[q, RQF_RECEIVED_MS] = now_ms


@kernel(cache=True, _nrt=False)
def finished_in_batch(rq, wk, w):
    """Members of the running batch whose last token a forward already gave: they stay
    in the batch (and in its step's timing) until that forward is observed, but are
    past the decode memory check and its retraction."""
    off = wk.i64[w, WK_RUN_OFF]
    n = 0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        if rq.i64[wk.run_q[off + j], RQ_HL_DONE_STAMP] != 0:
            n += 1
    return n
