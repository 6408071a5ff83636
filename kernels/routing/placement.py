"""Placement: which worker of a pool a request (or a handoff's destination) goes to.

One policy code per simulation (``sims.i64[s, SM_PLACEMENT]``, ``PLACE_*`` in
layout), read at every decision, so a batch may mix policies:

* ``round_robin`` - the reference's: the pool's cursor (``SM_RR_CURSOR`` for the
  aggregated or prefill pool, ``SM_DECODE_CURSOR`` for the decode pool) picks worker
  ``cursor mod N`` and advances, whatever the state of the workers;
* ``random`` - uniform over the pool from the simulation's own seeded generator
  (splitmix64 in ``SM_RNG_STATE``): reproducible run to run, and independent of how
  the batch is packed or split over threads.

Adding a policy means a code in layout, a branch in ``place`` and its name in
``PLACEMENT_NAMES``. A policy other than round robin can send more requests to one
worker than round robin's ``ceil(n / N)``; the queues it fills are bounded, and a
full one ends the simulation with ``SIM_CAPACITY`` (the driver reruns it larger).
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import PLACE_RANDOM, SM_PLACEMENT, SM_RNG_STATE

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


@kernel(cache=True, _nrt=False)
def next_random(sims, s):
    """The next 64-bit output of simulation s's splitmix64 generator."""
    z = np.uint64(sims.i64[s, SM_RNG_STATE]) + _GOLDEN_GAMMA
    sims.i64[s, SM_RNG_STATE] = np.int64(z)
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


@kernel(cache=True, _nrt=False)
def place(sims, s, w_first, n_workers, cursor_field):
    """Worker for the next request of a pool of ``n_workers`` starting at ``w_first``;
    ``cursor_field`` is the pool's round-robin cursor column of ``sims.i64``."""
    if sims.i64[s, SM_PLACEMENT] == PLACE_RANDOM:
        return w_first + np.int64(next_random(sims, s) % np.uint64(n_workers))
    cursor = sims.i64[s, cursor_field]
    sims.i64[s, cursor_field] = cursor + 1
    return w_first + cursor % n_workers
