"""The busy workers of each simulation as a min-heap by (pass end, worker index)
(``wk.busy_heap`` from the simulation's first worker, ``SM_BUSY_LEN`` entries): the
event loop takes the passes ending at an instant, and the next instant, from its top
instead of scanning every worker, which made an instant cost O(workers)."""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import SM_BUSY_LEN, SM_W_OFF


@kernel(cache=True, _nrt=False, inline="always")
def _ends_before(wk, a, b):
    """Busy-heap order: pass end, then worker index (completions in worker order)."""
    ea = wk.pass_end_ms[a]
    eb = wk.pass_end_ms[b]
    return ea < eb or (ea == eb and a < b)


@kernel(cache=True, _nrt=False)
def busy_push(wk, sims, s, w):
    """Worker w started a pass that ends after now: into the simulation's busy heap."""
    base = sims.i64[s, SM_W_OFF]
    h = wk.busy_heap
    i = sims.i64[s, SM_BUSY_LEN]
    sims.i64[s, SM_BUSY_LEN] = i + 1
    while i > 0:
        parent = (i - 1) // 2
        if _ends_before(wk, w, h[base + parent]):
            h[base + i] = h[base + parent]
            i = parent
        else:
            break
    h[base + i] = w


@kernel(cache=True, _nrt=False)
def busy_pop(wk, sims, s):
    """The busy worker whose pass ends first (lowest index among equal ends)."""
    base = sims.i64[s, SM_W_OFF]
    h = wk.busy_heap
    top = h[base]
    n = sims.i64[s, SM_BUSY_LEN] - 1
    sims.i64[s, SM_BUSY_LEN] = n
    if n == 0:
        return top
    last = h[base + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _ends_before(wk, h[base + c + 1], h[base + c]):
            c += 1
        if _ends_before(wk, h[base + c], last):
            h[base + i] = h[base + c]
            i = c
        else:
            break
    h[base + i] = last
    return top


@kernel(cache=True, _nrt=False, inline="always")
def next_pass_end_ms(wk, sims, s):
    """End of the first pass in flight (inf when no worker is busy)."""
    if sims.i64[s, SM_BUSY_LEN] == 0:
        return np.inf
    return wk.pass_end_ms[wk.busy_heap[sims.i64[s, SM_W_OFF]]]
