"""Synthetic traffic (``traffic.source_type: synthetic``): requests of fixed lengths
generated as the reference generates them, lowered to a ``Workload``.

A synthetic load is ``request_count`` requests of ``isl`` prompt and ``osl`` output
tokens, each its own single-turn session (``session_0``, ``session_1``, ...). The
first ``cached_prefix_tokens`` tokens of every prompt are one shared prefix, the rest
are the request's own, so prefix reuse between requests is exactly the shared prefix
(the reference's runs: the first request reuses nothing, each later one its prefix
rounded down to the engine's blocks). Token values only decide which blocks are equal;
they are not the reference's values, so KV-event hashes of a synthetic run differ
from the reference's while every request's timeline matches.

Arrivals, as the reference's load types make them:

* ``concurrency``: all at 0 behind a closed loop of ``concurrency`` requests in
  flight (each completion releases the next, re-stamped to that instant: the
  replay's ``concurrency``); ``request_count`` requests, or ``num_request_ratio`` x
  ``concurrency``;
* ``kv_capacity_fraction``: as ``concurrency``, the concurrency ``kv_load_ratio`` x
  the requests the generating pool's KV holds at once, each counted at ``isl + osl //
  2`` tokens (``config.payload.kv_fraction_concurrency``), at least 1;
* ``constant_rate``: every ``arrival_interval_ms`` (as a rate of
  ``1000 / arrival_interval_ms`` per second, gaps summed);
* ``poisson``: exponential gaps of mean ``1000 / request_rate`` ms drawn from the
  reference's generator seeded with ``arrival_seed`` (``trace.seeded_rng``), the first
  request at 0.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from aisim_fast.trace.seeded_rng import StdRng

LOAD_TYPES = ("concurrency", "constant_rate", "poisson", "kv_capacity_fraction")
_U32_END = 1 << 32
_SEED_STRIDE = 1_000_003  # a request's own tokens start at (index + 1) * this


@dataclass(frozen=True)
class SyntheticLoad:
    load_type: str
    request_count: int
    isl: int
    osl: int
    cached_prefix_tokens: int = 0
    concurrency: int = 0               # load_type concurrency (or resolved kv_capacity_fraction)
    kv_load_ratio: float = 0.0         # kv_capacity_fraction: the fraction of the KV pool's requests
    arrival_interval_ms: float = 0.0   # constant_rate
    request_rate: float = 0.0          # poisson, requests per second
    arrival_seed: int = 42             # poisson

    def arrivals_ms(self) -> np.ndarray:
        n = self.request_count
        if self.load_type in ("concurrency", "kv_capacity_fraction"):
            return np.zeros(n, np.float64)
        if self.load_type == "constant_rate":
            rate = 1000.0 / self.arrival_interval_ms
            gap_ms = 1000.0 / rate
            out, t = np.empty(n, np.float64), 0.0
            for i in range(n):
                out[i] = t
                t += gap_ms
            return out
        mean_gap_ms = 1000.0 / self.request_rate
        rng = StdRng(self.arrival_seed)
        out, t = np.empty(n, np.float64), 0.0
        for i in range(n):
            if i > 0:
                u = min(max(1.0 - rng.random_f64(), sys.float_info.min), 1.0)
                t += -mean_gap_ms * math.log(u)
            out[i] = t
        return out


def synthetic_workload(load: SyntheticLoad, max_rows: int | None = None):
    """The load's requests (the first ``max_rows``) as a ``trace.workload.Workload``:
    one-token trace blocks (``trace_block_size`` 1), so block hashing reads the
    tokens themselves."""
    from aisim_fast.trace.workload import Workload
    n = load.request_count if max_rows is None else min(load.request_count, max_rows)
    isl, shared = load.isl, min(load.cached_prefix_tokens, load.isl)
    own = np.arange(shared, isl, dtype=np.uint64)
    tokens = np.empty((n, isl), np.uint32)
    tokens[:, :shared] = np.arange(shared, dtype=np.uint32)
    for i in range(n):
        tokens[i, shared:] = ((i + 1) * _SEED_STRIDE + own) % _U32_END
    start_ms = load.arrivals_ms()[:n]
    names = np.empty(n, dtype=object)
    names[:] = [f"session_{i}" for i in range(n)]
    return Workload(
        path="traffic (synthetic)",
        trace_block_size=1,
        line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names,
        session=np.arange(n, dtype=np.int32),
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=np.full(n, isl, np.int64),
        output_len=np.full(n, load.osl, np.int64),
        hash_indptr=np.arange(n + 1, dtype=np.int64) * isl,
        hash_ids=tokens.reshape(-1),
        order=np.arange(n, dtype=np.int64),
    )
