"""Workers run apart: a simulation cut into one unit per worker where that is exact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aisim_fast.engine.simulation import Simulation
from aisim_fast.trace.workload import Workload, select_rows


def _workers_apart_between_releases(sim: Simulation) -> bool:
    """Whether a simulation's workers share nothing between two of its releases: an
    uncapped open-loop single-turn aggregated run of several workers (no terminal
    releases a turn or frees a session slot, no handoff, no agentic graph)."""
    return (sim.workload.agentic is None and not sim.disaggregated and sim.workers > 1 and not sim.concurrency
            and sim.max_sim_time_ms is None and not np.any(sim.workload.turn_index != 0))


def workers_independent(sim: Simulation) -> bool:
    """Whether a simulation runs whole with independent workers (``SM_INDEPENDENT``):
    a routed (kv_router or random) run whose workers are apart between releases, of
    vLLM / TRT-LLM workers, one rank each, fixed timing. Between two releases a worker
    sees no other worker's pass end, so its decode runs need not end there
    (kernels.vllm.decode_run); at a release the router reads every worker as the whole
    loop leaves it. Round robin splits such a run into worker units instead."""
    return (sim.placement in ("kv_router", "random") and sim.rank.backend != "sglang"
            and sim.dp_size == 1 and sim.rank.aic is None and _workers_apart_between_releases(sim))


def worker_shards(sim: Simulation):
    """Per-worker sub-simulations of an open-loop single-turn aggregated run, or
    None when its workers interact (closed loop, sessions) or there is one."""
    wl = sim.workload
    if sim.placement != "round_robin" or not _workers_apart_between_releases(sim):
        return None
    key = (id(wl), sim.workers)
    cached = _SHARD_CACHE.get(key)
    if cached is None or cached[0] is not wl:
        # worker w serves arrivals w, w + N, ...: the workers past the last arrival
        # get nothing and need no unit (their pools stay empty)
        cached = (wl, [_sub_workload(wl, wl.order[w::sim.workers])
                       for w in range(min(sim.workers, len(wl.order)))])
        if len(_SHARD_CACHE) >= 16:  # a sweep over worker counts of one trace fits; keep memory flat
            _SHARD_CACHE.pop(next(iter(_SHARD_CACHE)))
        _SHARD_CACHE[key] = cached
    return [(sub.line_no_rows, Simulation(sub.workload, sim.rank.for_worker(w, sim.dp_size), 1, 0, sim.arena_blocks,
                                          queue_slots=sim.queue_slots, dp_size=sim.dp_size,
                                          tokenization=sim.tokenization))
            for w, sub in enumerate(cached[1])]


_SHARD_CACHE: dict = {}


@dataclass(frozen=True)
class _Shard:
    workload: Workload
    line_no_rows: np.ndarray  # rows of the parent workload, in the shard's order


def _sub_workload(wl: Workload, rows: np.ndarray) -> _Shard:
    """The trace restricted to ``rows`` (already in arrival order)."""
    return _Shard(select_rows(wl, rows), rows)
