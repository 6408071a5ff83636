"""The release heap of a simulation (``sims.heap_q``, slices at SM_Q_OFF): requests
waiting for their release time (a later turn after its think time, a prompt in a
tokenization pool, an agentic request its dependencies released), a binary min-heap
by (release time, session index, turn index): requests due at one instant go in
session order, as the reference's workload driver releases them."""

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import RQ_SESSION, RQ_TURN, RQF_READY_MS, SM_HEAP_LEN, SM_Q_OFF


@kernel(cache=True, _nrt=False, inline="always")
def released_before(t_a, s_a, u_a, t_b, s_b, u_b):
    """Release order: time, then session index, then turn index."""
    if t_a != t_b:
        return t_a < t_b
    if s_a != s_b:
        return s_a < s_b
    return u_a < u_b


@kernel(cache=True, _nrt=False)
def heap_push(sims, rq, s, q):
    base = sims.i64[s, SM_Q_OFF]
    i = sims.i64[s, SM_HEAP_LEN]
    sims.i64[s, SM_HEAP_LEN] = i + 1
    h = sims.heap_q
    while i > 0:
        parent = (i - 1) // 2
        pq = h[base + parent]
        if released_before(rq.f64[q, RQF_READY_MS], rq.i64[q, RQ_SESSION], rq.i64[q, RQ_TURN],
                   rq.f64[pq, RQF_READY_MS], rq.i64[pq, RQ_SESSION], rq.i64[pq, RQ_TURN]):
            h[base + i] = pq
            i = parent
        else:
            break
    h[base + i] = q


@kernel(cache=True, _nrt=False)
def heap_pop(sims, rq, s):
    base = sims.i64[s, SM_Q_OFF]
    h = sims.heap_q
    top = h[base]
    n = sims.i64[s, SM_HEAP_LEN] - 1
    sims.i64[s, SM_HEAP_LEN] = n
    if n == 0:
        return top
    last = h[base + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        qc = h[base + c]
        if c + 1 < n:
            qd = h[base + c + 1]
            if released_before(rq.f64[qd, RQF_READY_MS], rq.i64[qd, RQ_SESSION], rq.i64[qd, RQ_TURN],
                       rq.f64[qc, RQF_READY_MS], rq.i64[qc, RQ_SESSION], rq.i64[qc, RQ_TURN]):
                c += 1
                qc = qd
        if released_before(rq.f64[qc, RQF_READY_MS], rq.i64[qc, RQ_SESSION], rq.i64[qc, RQ_TURN],
                   rq.f64[last, RQF_READY_MS], rq.i64[last, RQ_SESSION], rq.i64[last, RQ_TURN]):
            h[base + i] = qc
            i = c
        else:
            break
    h[base + i] = last
    return top
