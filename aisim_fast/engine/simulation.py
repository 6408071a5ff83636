"""A simulation (one point of a batch: a trace, rank configs, a topology), its checks and its
per-simulation statuses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from aisim_fast.config.payload import (PLACEMENTS, ConfigError, RankConfig, ReplaySetup, RouterConfig,
                                       TokenizationConfig, check_attention_dp, check_disaggregated_pair,
                                       check_agentic_trace, check_placement_seed, check_rank, check_tokenization)
from aisim_fast.engine.output_budget import emitted_outright
from aisim_fast.trace.inline_requests import inline_workload
from aisim_fast.trace.synthetic import synthetic_workload
from aisim_fast.trace.formats import load_trace
from aisim_fast.trace.session_history import warn_unfit_turns
from aisim_fast.trace.workload import PIN_KEYS, Workload


class SimulationError(RuntimeError):
    """A simulation that could not finish (dead end: the reference aborts on the same
    condition; an invalid config; a capacity limit). ``run_batch`` does not raise it:
    it reports a status per simulation, and reading a failed simulation's results
    (or ``BatchResult.check()``) raises it with the simulation's message."""


# Per-simulation outcome of run_batch (``BatchResult.status[s]``)
STATUS_OK = "ok"
STATUS_DEAD_END = "dead_end"              # requests in flight that can never be scheduled
STATUS_REJECTED_CONFIG = "rejected_config"  # the simulation's config is invalid; not run
STATUS_CAPACITY = "capacity"              # a fixed-size queue (queue_slots) overflowed


@dataclass(frozen=True)
class Simulation:
    """One point of a batch: a loaded trace, the rank config and the topology."""
    workload: Workload
    rank: RankConfig
    workers: int
    concurrency: int = 0  # closed-loop session cap; 0 = open loop by timestamps
    arena_blocks: int | None = None  # per-worker block arena; None = sized from the workload
    # Disaggregated: ``rank``/``workers`` are the decode pool, these the prefill pool.
    prefill_rank: RankConfig | None = None
    prefill_workers: int = 0
    handoff_latency_ms: float = 0.0
    placement: str = "round_robin"   # config.PLACEMENTS (kernels.routing.placement, kernels.routing.kv_router)
    placement_seed: int = 0
    router: RouterConfig | None = None  # kv_router knobs (None: the defaults)
    # per-worker running/waiting queue slots; None = sized for the placement (a run
    # that overflows them is rerun with room for every request)
    queue_slots: int | None = None
    # attention-DP ranks per worker of the aggregated or decode pool: a worker is a
    # group of this many ranks behind one pass barrier (kernels.dp.attention_dp), each a
    # kernel worker; ``prefill_dp_size`` the same for the prefill pool
    dp_size: int = 1
    prefill_dp_size: int = 1
    # simulated-time cap (spec replay.md 12.11): the simulation ends after its last
    # instant at or before it (``run_batch`` then keeps what the reference reports)
    max_sim_time_ms: float | None = None
    # requests (logical rows) whose token gaps stay out of the token statistics
    token_stats_excluded: np.ndarray | None = None
    # a tokenization pool ahead of every worker (kernels.loop.tokenization); None = none
    tokenization: TokenizationConfig | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    @property
    def ranks(self) -> int:
        """Kernel workers of the aggregated or decode pool (ranks)."""
        return self.workers * self.dp_size

    @property
    def prefill_ranks(self) -> int:
        """Kernel workers of the prefill pool (0 when aggregated)."""
        return self.prefill_workers * self.prefill_dp_size


def setup_workload(setup: ReplaySetup, max_rows: int | None = None, closed_loop: bool = False) -> Workload:
    """The requests a parsed setup replays: its inline requests, its synthetic load, or
    its trace loaded."""
    if setup.requests is not None:
        return inline_workload(setup.requests, max_rows)
    if setup.synthetic is not None:
        # a generated id covers a block of the rank that prefills
        prefill = setup.prefill_rank if setup.disaggregated else setup.rank
        workload = synthetic_workload(setup.synthetic, prefill.block_size, turn_outcome(setup), max_rows)
    else:
        workload = load_trace(setup.trace_path, setup.trace_format, trace_block_size=setup.trace_block_size,
                              arrival_speedup_ratio=setup.arrival_speedup_ratio, max_rows=max_rows,
                              closed_loop=closed_loop, emits=turn_outcome(setup),
                              more_paths=setup.more_trace_paths, agentic_lanes=setup.agentic_lanes,
                              agentic_snapshot_seed=setup.agentic_snapshot_seed, weka_basis=setup.weka_basis)
        if workload.agentic is not None:
            check_agentic_trace(setup)
    if setup.disaggregated and (setup.trace_format == "mooncake-delta" or setup.synthetic is not None):
        warn_unfit_turns(workload, setup.rank.num_gpu_blocks * setup.rank.block_size)
    return workload


def turn_outcome_key(setup: ReplaySetup) -> tuple:
    """What ``turn_outcome`` depends on where it shapes the requests (a delta trace,
    synthetic sessions; else nothing): setups equal in it load the same requests."""
    sessions = setup.synthetic is not None and setup.synthetic.turns_per_session > 1
    if not (sessions or (setup.from_trace_file and setup.trace_format == "mooncake-delta")):
        return ()
    rank = setup.rank
    return (setup.disaggregated, rank.backend, rank.max_model_len, rank.block_size, rank.num_gpu_blocks)


def turn_outcome(setup: ReplaySetup):
    """What a turn of the setup's sessions emits, as the rank decides it before the run
    (``output_budget.emitted_outright``: rejections, clamps, ``max_model_len``): the
    aggregated rank's rule; a disaggregated pair's ``max_model_len`` only (its pools'
    rejections are left to the run and warned of: ``warn_unfit_turns``)."""
    rank = setup.rank
    if setup.disaggregated:
        limit = rank.max_model_len
        if limit is None:
            return None
        return lambda prompt, out: np.where(prompt >= limit, 0, np.clip(np.minimum(out, limit - prompt), 0, None))
    return lambda prompt, out: emitted_outright(rank, prompt, out)


def simulation_from_setup(setup: ReplaySetup, workload: Workload | None = None) -> Simulation:
    """The simulation a parsed setup describes (its requests loaded unless ``workload`` is
    given): every setting the two share, by name."""
    if workload is None:
        workload = setup_workload(setup)
    shared = {f.name: getattr(setup, f.name) for f in dataclasses.fields(Simulation)
              if f.name != "workload" and hasattr(setup, f.name)}
    return Simulation(workload=workload, **shared)


def router_config(sim: Simulation) -> RouterConfig:
    return sim.router if sim.router is not None else RouterConfig()


def check_simulation(sim: Simulation, allow_empty: bool = False) -> None:
    """Validate a simulation built in code; raises ConfigError naming the field
    (``allow_empty``: a trace without requests is valid, e.g. one to be added to)."""
    if not isinstance(sim.workers, (int, np.integer)) or sim.workers < 1:
        raise ConfigError(f"workers: must be an integer >= 1, got {sim.workers!r}")
    if sim.concurrency < 0:
        raise ConfigError(f"concurrency: must be >= 0 (0 = open loop), got {sim.concurrency!r}")
    check_rank(sim.rank, "rank")
    for name in ("dp_size", "prefill_dp_size"):
        value = getattr(sim, name)
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
    check_attention_dp(sim.rank, sim.dp_size, "rank", "decode" if sim.disaggregated else "aggregated")
    if sim.prefill_dp_size > 1 and not sim.disaggregated:
        raise ConfigError("prefill_dp_size: only for a disaggregated simulation (prefill_workers > 0)")
    if sim.disaggregated:
        if sim.prefill_rank is None:
            raise ConfigError("prefill_rank: required with prefill_workers > 0")
        check_rank(sim.prefill_rank, "prefill_rank")
        check_attention_dp(sim.prefill_rank, sim.prefill_dp_size, "prefill_rank", "prefill")
        check_disaggregated_pair(sim.prefill_rank, sim.rank, "rank")
    elif sim.prefill_workers < 0:
        raise ConfigError(f"prefill_workers: must be >= 0, got {sim.prefill_workers!r}")
    if sim.placement not in PLACEMENTS:
        raise ConfigError(f"placement: must be one of {', '.join(PLACEMENTS)}; got {sim.placement!r}")
    check_placement_seed("placement_seed", sim.placement_seed)
    if sim.placement == "kv_router":
        if sim.rank.backend == "sglang":
            raise ConfigError("placement: kv_router is not simulated over SGLang ranks yet "
                              "(its overlap reads the vLLM block pool); use round_robin or random")
        if router_config(sim).pin_to_trace_worker:
            _check_pins(sim)
    if sim.tokenization is not None:
        check_tokenization(sim.tokenization, "tokenization", placement=sim.placement)
    if sim.queue_slots is not None and sim.queue_slots < 1:
        raise ConfigError(f"queue_slots: must be >= 1 or None, got {sim.queue_slots!r}")
    if sim.arena_blocks is not None and sim.arena_blocks < 1:
        raise ConfigError(f"arena_blocks: must be >= 1 or None, got {sim.arena_blocks!r}")
    if len(sim.workload.input_len) == 0 and not allow_empty:
        raise ConfigError("workload: the trace has no requests")


def _check_pins(sim: Simulation) -> None:
    """pin_to_trace_worker: every row names its worker in each pool (``worker``, or
    ``prefill_worker`` and ``decode_worker``), inside the pool, and no other. With
    attention DP a pin names a rank: ``worker * dp_size + dp_rank`` (the scheduler id
    of Dynamo's records)."""
    wl = sim.workload
    pins = wl.worker if wl.worker is not None else np.full((wl.num_requests, len(PIN_KEYS)), -1, np.int64)
    pools = ((1, sim.prefill_ranks), (2, sim.ranks)) if sim.disaggregated else ((0, sim.ranks),)
    used = [k for k, _ in pools]
    for k in range(len(PIN_KEYS)):
        if k not in used and np.any(pins[:, k] >= 0):
            row = int(np.argmax(pins[:, k]))
            topology = "disaggregated" if sim.disaggregated else "aggregated"
            wanted = " and ".join(f'"{PIN_KEYS[j]}"' for j in used)
            raise ConfigError(f"{wl.path}, line {int(wl.line_no[row])}: \"{PIN_KEYS[k]}\" does not pin "
                              f"a worker of this {topology} topology (give {wanted})")
    for k, n_workers in pools:
        pin = pins[:, k]
        missing = np.flatnonzero(pin < 0)
        if len(missing):
            raise ConfigError(f"{wl.path}, line {int(wl.line_no[missing[0]])}: "
                              f"pin_to_trace_worker needs an integer \"{PIN_KEYS[k]}\" on every row")
        if pin.max() >= n_workers:
            row = int(np.argmax(pin))
            dp = sim.prefill_dp_size if k == 1 else sim.dp_size
            pool = f"{n_workers} workers" if dp == 1 else f"{n_workers} ranks (workers x dp_size {dp})"
            raise ConfigError(f"{wl.path}, line {int(wl.line_no[row])}: {PIN_KEYS[k]} {int(pin[row])} "
                              f"is not in the pool of {pool}")
