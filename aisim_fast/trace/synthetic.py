"""Synthetic traffic (``traffic.source_type: synthetic`` and ``synthetic-session``):
requests of fixed lengths generated as the reference generates them, lowered to a
``Workload``.

A load is ``sessions`` sessions (``session_0``, ``session_1``, ...) of
``turns_per_session`` turns each (1 for ``synthetic``), every turn ``isl`` new
prompt tokens and ``osl`` output tokens. A later turn's prompt is its session's
history -- earlier turns' new tokens and the output they emitted -- then its own new
tokens (``session_history``): isl 64, osl 4 gives prompts of 64, 132, 200.

A turn's new tokens are blocks of ``block`` tokens (the engine's block size, or 1
when there is a cached prefix), each block one id repeated, the last block cut at
``isl``. The ids are the reference's: one counter in first-use order, from 0:

* the first ``cached_prefix_tokens`` blocks are ids 0, 1, ... in every turn of
  every session (``synthetic``'s shared prefix);
* with ``shared_prefix_ratio`` s > 0 and ``num_prefix_groups`` G > 0, each session
  draws a group (``StdRng::seed_from_u64(0)``, ``random_range(0..G)``, one draw per
  session in order) and its turns continue with the group's blocks up to
  ``round(blocks x s)`` blocks of the turn: block k of a group takes an id the first
  time any turn needs it, so sessions of a group share them (and a session repeats
  them at the start of each turn's new tokens);
* the rest of a turn's blocks take fresh ids.

So token values are the reference's and KV-event hashes agree with its too.

Arrivals of first turns, as the reference's load types make them:

* ``concurrency``: all at 0 behind a closed loop of ``concurrency`` sessions in
  flight, a session holding its place through its turns and think times (the
  replay's ``concurrency``);
* ``kv_capacity_fraction``: as ``concurrency``, the concurrency ``kv_load_ratio`` x
  the requests the generating pool's KV holds at once, each counted at ``isl + osl //
  2`` tokens (``config.payload.kv_fraction_concurrency``), at least 1;
* ``constant_rate``: every ``arrival_interval_ms`` (as a rate of
  ``1000 / arrival_interval_ms`` per second, gaps summed);
* ``poisson``: exponential gaps of mean ``1000 / request_rate`` ms drawn from the
  reference's generator seeded with ``arrival_seed`` (``trace.seeded_rng``), the first
  session at 0.

A later turn arrives ``inter_turn_delay_ms`` after its predecessor ends.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from aisim_fast.trace.seeded_rng import StdRng
from aisim_fast.trace.session_history import with_session_history

LOAD_TYPES = ("concurrency", "constant_rate", "poisson", "kv_capacity_fraction")
SOURCE_TYPES = ("synthetic", "synthetic-session")
_GROUP_SEED = 0  # the reference's generator seed: no payload field reaches it


@dataclass(frozen=True)
class SyntheticLoad:
    load_type: str
    request_count: int                 # sessions (requests of a single-turn source)
    isl: int                           # new prompt tokens per turn
    osl: int                           # output tokens per turn
    cached_prefix_tokens: int = 0
    concurrency: int = 0               # load_type concurrency (or resolved kv_capacity_fraction)
    kv_load_ratio: float = 0.0         # kv_capacity_fraction: the fraction of the KV pool's requests
    arrival_interval_ms: float = 0.0   # constant_rate
    request_rate: float = 0.0          # poisson, requests (sessions) per second
    arrival_seed: int = 42             # poisson
    source_type: str = "synthetic"     # one of SOURCE_TYPES
    turns_per_session: int = 1
    shared_prefix_ratio: float = 0.0
    num_prefix_groups: int = 0
    inter_turn_delay_ms: float = 0.0

    @property
    def sessions(self) -> int:
        return self.request_count

    @property
    def num_requests(self) -> int:
        return self.request_count * self.turns_per_session

    def arrivals_ms(self) -> np.ndarray:
        """float64[session]: when each session's first turn arrives."""
        n = self.sessions
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

    def token_block(self, engine_block_size: int) -> int:
        """Tokens per generated id: the engine's block, or 1 under a cached prefix."""
        return 1 if self.cached_prefix_tokens > 0 else engine_block_size

    def turn_block_ids(self, engine_block_size: int, sessions: int | None = None) -> np.ndarray:
        """uint32[session, turn, block]: every turn's new-token block ids, drawn as the
        reference draws them (the first ``sessions`` sessions)."""
        n = self.sessions if sessions is None else min(self.sessions, sessions)
        block = self.token_block(engine_block_size)
        n_blocks = -(-self.isl // block)
        cached = self.cached_prefix_tokens // block
        # Rust's f64::round: half away from zero
        grouped = min(math.floor(n_blocks * self.shared_prefix_ratio + 0.5), n_blocks)
        draw_groups = self.num_prefix_groups > 0 and self.shared_prefix_ratio > 0
        ids = np.empty((n, self.turns_per_session, n_blocks), np.int64)
        ids[:, :, :cached] = np.arange(cached)
        rng = StdRng(_GROUP_SEED)
        group_ids: dict[int, list[int]] = {}
        counter = cached
        for s in range(n):
            shared = []
            if draw_groups:
                shared = group_ids.setdefault(rng.random_range(self.num_prefix_groups), [])
            for t in range(self.turns_per_session):
                k = cached
                if draw_groups:
                    for j in range(max(0, grouped - cached)):
                        if j == len(shared):
                            shared.append(counter)
                            counter += 1
                        ids[s, t, k] = shared[j]
                        k += 1
                fresh = n_blocks - k
                ids[s, t, k:] = np.arange(counter, counter + fresh)
                counter += fresh
        if counter > (1 << 32):
            raise ValueError("the synthetic load has more unique block ids than u32 can represent")
        return ids.astype(np.uint32)


def synthetic_workload(load: SyntheticLoad, engine_block_size: int, emits=None, max_rows: int | None = None):
    """The load's requests (the first ``max_rows``) as a ``trace.workload.Workload``,
    session-major: turns of a session in order, each turn's prompt its session's
    history (a turn adding the output ``emits`` says it emits: ``session_history``).
    ``engine_block_size``:
    the block size of the rank that prefills (a generated id covers one block)."""
    from aisim_fast.trace.workload import Workload
    turns = load.turns_per_session
    n_sessions = load.sessions if max_rows is None else min(load.sessions, -(-max_rows // turns))
    ids = load.turn_block_ids(engine_block_size, n_sessions)
    n = n_sessions * turns if max_rows is None else min(n_sessions * turns, max_rows)
    n_blocks = ids.shape[2]
    session = np.repeat(np.arange(n_sessions, dtype=np.int32), turns)[:n]
    turn_index = np.tile(np.arange(turns, dtype=np.int32), n_sessions)[:n]
    first = turn_index == 0
    start_ms = np.full(n, np.nan)
    start_ms[first] = load.arrivals_ms()[:n_sessions][session[first]]
    names = np.empty(n, dtype=object)
    names[:] = [f"session_{s}" for s in session.tolist()]
    delta = Workload(
        path="traffic (synthetic)",
        trace_block_size=load.token_block(engine_block_size),
        line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names,
        session=session,
        turn_index=turn_index,
        start_ms=start_ms,
        delay_ms=np.where(first, 0.0, float(load.inter_turn_delay_ms)),
        input_len=np.full(n, load.isl, np.int64),
        output_len=np.full(n, load.osl, np.int64),
        hash_indptr=np.arange(n + 1, dtype=np.int64) * n_blocks,
        hash_ids=ids.reshape(-1)[:n * n_blocks],
        order=np.flatnonzero(first).astype(np.int64)[np.argsort(start_ms[first], kind="stable")],
    )
    if turns == 1:
        return delta  # a single turn's prompt is its new tokens
    return with_session_history(delta, emits)
