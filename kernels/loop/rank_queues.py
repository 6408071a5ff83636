"""The queues of a rank (worker): the running list (index order matters for the
preemption cursor), the waiting ring (preempted requests go to its front) and the
terminal list of the pass in flight. Pushes into a full list write nothing and flag
the simulation (``WK_OVERFLOW`` of its first worker): the event loop then ends the simulation with
``SIM_CAPACITY`` instead of letting a ring wrap over live entries.
"""

from numba import njit

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import (RQ_TERM_NEXT, WK_OVERFLOW, WK_RUN_CAP, WK_RUN_LEN, WK_RUN_OFF,
                                               WK_SIM_W0, WK_STALLED, WK_TERM_HEAD, WK_TERM_TAIL, WK_WAIT_CAP,
                                               WK_WAIT_HEAD, WK_WAIT_LEN, WK_WAIT_OFF)


@kernel(cache=True, _nrt=False, inline="always")
def wake(wk, w):
    """Something that may let worker w start a pass happened (work, room, a freed
    reservation): clear its stall and mark it for the event loop's drive."""
    wk.i64[w, WK_STALLED] = 0
    wk.ready[w] = 1


@njit(cache=True, _nrt=False, inline="always")
def wait_at(wk, w, i):
    return wk.wait_q[wk.i64[w, WK_WAIT_OFF] + (wk.i64[w, WK_WAIT_HEAD] + i) % wk.i64[w, WK_WAIT_CAP]]


@kernel(cache=True, _nrt=False, inline="always")
def wait_push_back(wk, w, q):
    """Append q to the waiting ring; a full ring writes nothing and flags the
    worker (the event loop then ends the simulation with SIM_CAPACITY)."""
    cap = wk.i64[w, WK_WAIT_CAP]
    if wk.i64[w, WK_WAIT_LEN] >= cap:
        wk.i64[wk.i64[w, WK_SIM_W0], WK_OVERFLOW] = 1
        return False
    wk.wait_q[wk.i64[w, WK_WAIT_OFF] + (wk.i64[w, WK_WAIT_HEAD] + wk.i64[w, WK_WAIT_LEN]) % cap] = q
    wk.i64[w, WK_WAIT_LEN] += 1
    return True


@kernel(cache=True, _nrt=False, inline="always")
def wait_push_front(wk, w, q):
    cap = wk.i64[w, WK_WAIT_CAP]
    if wk.i64[w, WK_WAIT_LEN] >= cap:
        wk.i64[wk.i64[w, WK_SIM_W0], WK_OVERFLOW] = 1
        return
    h = (wk.i64[w, WK_WAIT_HEAD] - 1 + cap) % cap
    wk.i64[w, WK_WAIT_HEAD] = h
    wk.wait_q[wk.i64[w, WK_WAIT_OFF] + h] = q
    wk.i64[w, WK_WAIT_LEN] += 1


@kernel(cache=True, _nrt=False)
def wait_remove_at(wk, w, i):
    """Remove entry ``i`` keeping the order of the others."""
    cap = wk.i64[w, WK_WAIT_CAP]
    off = wk.i64[w, WK_WAIT_OFF]
    head = wk.i64[w, WK_WAIT_HEAD]
    if i == 0:
        wk.i64[w, WK_WAIT_HEAD] = (head + 1) % cap
    else:
        for j in range(i, wk.i64[w, WK_WAIT_LEN] - 1):
            wk.wait_q[off + (head + j) % cap] = wk.wait_q[off + (head + j + 1) % cap]
    wk.i64[w, WK_WAIT_LEN] -= 1


@kernel(cache=True, _nrt=False, inline="always")
def run_push_back(wk, w, q):
    """Append q to the running list (full: nothing written, the worker flagged)."""
    n = wk.i64[w, WK_RUN_LEN]
    if n >= wk.i64[w, WK_RUN_CAP]:
        wk.i64[wk.i64[w, WK_SIM_W0], WK_OVERFLOW] = 1
        return
    wk.run_q[wk.i64[w, WK_RUN_OFF] + n] = q
    wk.i64[w, WK_RUN_LEN] = n + 1


@kernel(cache=True, _nrt=False, inline="always")
def run_remove_at(wk, w, i):
    off = wk.i64[w, WK_RUN_OFF]
    n = wk.i64[w, WK_RUN_LEN]
    for j in range(i, n - 1):
        wk.run_q[off + j] = wk.run_q[off + j + 1]
    wk.i64[w, WK_RUN_LEN] = n - 1


@kernel(cache=True, _nrt=False, inline="always")
def push_terminal(rq, wk, w, q):
    """Append q to the worker's terminal list (output order, visible at the pass end)."""
    rq.i64[q, RQ_TERM_NEXT] = -1
    tail = wk.i64[w, WK_TERM_TAIL]
    if tail < 0:
        wk.i64[w, WK_TERM_HEAD] = q
    else:
        rq.i64[tail, RQ_TERM_NEXT] = q
    wk.i64[w, WK_TERM_TAIL] = q
