"""Batch replay driver: lowers simulations (trace + rank config + topology) into the
kernels' structure-of-arrays state, advances the whole batch in compiled code, and
turns the state back into per-request and per-pass tables.

One ``run_batch`` call = one kernel call per flush of the pass log (usually one):
every simulation runs its complete event loop inside ``kernels.loop.event_loop``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

import numba
import numpy as np
import pandas as pd

from aisim_fast.engine import reused_buffers
from aisim_fast.config.payload import (PLACEMENTS, ConfigError, RankConfig, ReplaySetup,
                                       RouterConfig, check_attention_dp, check_disaggregated_pair,
                                       check_rank)
from aisim_fast.kernels.jit import compile_for, compile_notice, mark_compiled
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.sglang import radix as sglang_radix
from aisim_fast.kernels.stats import sketch
from aisim_fast.report.metrics import sketch_merge_rows
from aisim_fast.kernels.hashing.prompt_blocks import count_prompt_blocks, hash_prompt_blocks
from aisim_fast.kernels.loop.event_loop import replay_batch
from aisim_fast.kernels.features import features_of, union
from aisim_fast.kernels.kv.lease import kv_tokens_hashes
from aisim_fast.kernels.trace.output_plan import output_tokens_at
from aisim_fast.engine.grow import (KernelState, add_rows_many, append_workload_rows,
                                    kernel_output_plan)
from aisim_fast.trace.workload import (PIN_KEYS, Workload, concat_workloads, load_mooncake,
                                       select_rows, sequence_tokens)

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage

DEFAULT_PASS_LOG_ROWS = 65536
DEFAULT_EVENT_ROWS = 65536  # per simulation; drained whenever half full, doubled on overflow
PROGRESS_SLICE_S = 0.3      # wall seconds per kernel call of a run that reports progress
PASS_LOG_BUDGET_ROWS = 1 << 21  # pass-log rows of a whole batch (240 MB); drained when full
MIN_PASS_LOG_ROWS = 512


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


@dataclass
class BatchResult:
    """Results of a batch, indexed by simulation. ``status[s]`` is ``ok`` or a failure
    (STATUS_*) with ``error[s]`` saying why; the frames of a failed simulation raise
    SimulationError when read, the other simulations' results are intact."""
    requests: Sequence[pd.DataFrame]   # one frame per simulation, one row per request (built on access)
    passes: Sequence[pd.DataFrame]     # one frame per simulation, one row per forward pass
    token_stat: np.ndarray             # float64[s, TOKEN_STAT_WIDTH]
    token_hist: np.ndarray             # int64[s, TOKEN_HIST_WIDTH]
    kernel_calls: int
    end_ms: np.ndarray                 # float64[s] virtual clock when the simulation finished
    # one frame per simulation, one row per handoff lifecycle event (record_handoffs=True;
    # empty for aggregated simulations)
    handoffs: Sequence[pd.DataFrame] = ()
    # per simulation: what is still held when it finished (see ``_leftovers``)
    leftovers: Sequence[dict] = ()
    status: Sequence[str] = ()         # STATUS_* per simulation
    error: Sequence[str] = ()          # "" when ok, else what went wrong
    # one frame per simulation, one row per KV event (record_events=True)
    kv_events: Sequence[pd.DataFrame] = ()
    # one frame per simulation, one row per admission, preemption or finish (record_events=True)
    engine_events: Sequence[pd.DataFrame] = ()
    # one frame per simulation, one row per output token (record_outputs=True)
    output_events: Sequence[pd.DataFrame] = ()
    # one frame per simulation, one row per kv_router decision (empty for other placements)
    routing: Sequence[pd.DataFrame] = ()
    # one frame per simulation, one row per vLLM preemption or SGLang retraction
    # (record_pressure=True or record_events=True)
    pressure_events: Sequence[pd.DataFrame] = ()
    # pass_parts(s): simulation s's passes as consecutive Arrow tables, never joined -
    # the rows of ``passes[s]`` grouped by worker unit (a run split per worker: by
    # worker, each in time order) and in drain order within one; for writing big runs
    pass_parts: Callable[[int], Iterator] | None = None
    # per simulation: its CapFacts when it ran with a time cap, else None
    capped: Sequence = ()

    def check(self) -> "BatchResult":
        """Raise SimulationError for the first simulation that did not finish."""
        for message in self.error:
            if message:
                raise SimulationError(message)
        return self


def simulation_from_setup(setup: ReplaySetup, workload: Workload | None = None) -> Simulation:
    if workload is None:
        workload = load_mooncake(setup.trace_path, trace_block_size=setup.trace_block_size,
                                 arrival_speedup_ratio=setup.arrival_speedup_ratio)
    return Simulation(workload, setup.rank, setup.workers, setup.concurrency,
                      prefill_rank=setup.prefill_rank, prefill_workers=setup.prefill_workers,
                      handoff_latency_ms=setup.handoff_latency_ms, placement=setup.placement,
                      placement_seed=setup.placement_seed, router=setup.router, dp_size=setup.dp_size,
                      prefill_dp_size=setup.prefill_dp_size, max_sim_time_ms=setup.max_sim_time_ms)


def _router(sim: Simulation) -> RouterConfig:
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
    if not 0 <= sim.placement_seed < 2 ** 63:
        raise ConfigError(f"placement_seed: must be in [0, 2**63), got {sim.placement_seed!r}")
    if sim.placement == "kv_router":
        if sim.rank.backend == "sglang":
            raise ConfigError("placement: kv_router is not simulated over SGLang ranks yet "
                              "(its overlap reads the vLLM block pool); use round_robin or random")
        if _router(sim).pin_to_trace_worker:
            _check_pins(sim)
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


# slots of a KV-router active-block multiset to begin with (kernels.routing.kv_router grows it)
ROUTER_INITIAL_SLOTS = 1024


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


def _effective_max_output(sim: Simulation) -> np.ndarray:
    """The output budget of a request on the rank that generates it: TRT-LLM clamps it
    to the pool when the prompt fits in it; SGLang to ``max_model_len`` (sglang.md 2;
    a prompt at or past the limit is rejected by the pass instead)."""
    wl, rank = sim.workload, sim.rank
    out = wl.output_len.astype(np.int64)
    if rank.backend == "trtllm":
        pool_tokens = rank.num_gpu_blocks * rank.block_size
        fits = wl.input_len < pool_tokens
        out = np.where(fits, np.minimum(out, pool_tokens - wl.input_len), out)
    elif rank.backend == "sglang" and rank.max_model_len is not None:
        fits = wl.input_len < rank.max_model_len
        out = np.where(fits, np.minimum(out, rank.max_model_len - wl.input_len), out)
    return out


def _next_turns(wl: Workload) -> np.ndarray:
    nxt = np.full(len(wl.input_len), -1, np.int64)
    if not wl.turn_index.any():
        return nxt  # single-turn trace: no follow-up turns
    last_of_session: dict[int, int] = {}
    for q, sess in enumerate(wl.session.tolist()):
        prev = last_of_session.get(sess)
        if prev is not None:
            nxt[prev] = q
        last_of_session[sess] = q
    return nxt


@dataclass(frozen=True)
class _PoolTemplate:
    arena: int      # block arena slots per worker
    run_cap: int    # running-list capacity per worker
    wait_cap: int   # waiting-ring capacity per worker
    cfg_i: np.ndarray
    cfg_f: np.ndarray
    nodes: int = 0  # SGLang: radix-tree node slots per worker


class _Rows:
    """Rows of a state matrix (``layout.FieldTable``) as the columns that differ from a
    fresh row: written straight into the state, so a batch builds its request rows
    once, in memory that a previous run may have mapped already."""

    def __init__(self, table, n: int, columns: dict):
        self.table, self.n, self.columns = table, n, columns  # column -> values or scalar

    def __len__(self) -> int:
        return self.n

    def write(self, out: np.ndarray, lease_off: int = 0) -> None:
        """Into ``out`` (n rows), request leases starting at entry ``lease_off``."""
        out[:] = _fresh_row(self.table)
        for col, values in self.columns.items():
            out[:, col] = values
        if lease_off:
            out[:, L.RQ_LEASE_OFF] += lease_off

    def shifted(self, col: int, by: int) -> "_Rows":
        return _Rows(self.table, self.n, {**self.columns, col: self.columns[col] + by})


@functools.lru_cache(maxsize=None)
def _fresh_row(table) -> np.ndarray:
    return table.new(1)[0]


@dataclass(frozen=True)
class _SimTemplate:
    """What build_state writes for one simulation, relative to its offsets: a sweep
    packs many simulations of one trace and config, which share it."""
    rq_i: _Rows                 # logical rows (REQUEST_I); RQ_LEASE_OFF from 0
    rq_f: _Rows                 # logical rows (REQUEST_F)
    lease_entries: int          # blocks of all logical rows' leases
    prefill_rq_i: _Rows | None
    prefill_lease_entries: int
    max_lease_blocks: int
    next_turn: np.ndarray       # int64[n] row of the next turn of the session, -1 none
    firsts: np.ndarray          # rows released by the start order
    pools: tuple                # ((first worker, workers, _PoolTemplate), ...)


# what a simulation's kernel template depends on (a time cap and the requests left out
# of the token statistics are applied to the built state)
_SIM_SETTINGS = tuple(f for f in dataclasses.fields(Simulation)
                      if f.name not in ("workload", "max_sim_time_ms", "token_stats_excluded"))


def _table_key(wl: Workload, rank: RankConfig) -> tuple[int, int]:
    """The workload table of a pool: its prompt block hashes at the pool's block size.
    An SGLang pool keys its radix tree by page contents computed in the kernel, so it
    needs no hashes (block size 0: no table rows)."""
    return (id(wl), 0 if rank.backend == "sglang" else rank.block_size)


def _sim_template(sim: Simulation, table_rows: dict, distinct_prompt_blocks: dict,
                  memo: dict | None = None) -> _SimTemplate:
    """``memo``: a dict the caller keeps for one build; simulations of one workload
    (a sweep's points, a worker's shard under many configs) share what depends only
    on it, and equal pools their config rows."""
    memo = {} if memo is None else memo
    wl, rank = sim.workload, sim.rank
    n = len(wl.input_len)
    bs = rank.block_size
    out = _effective_max_output(sim)
    # the output budget depends on the rank only where it is clamped (TRT-LLM, SGLang)
    rows_key = ("rows", id(wl), table_rows[_table_key(wl, rank)], bs, rank.backend,
                rank.num_gpu_blocks if rank.backend == "trtllm" else 0,
                rank.max_model_len if rank.backend == "sglang" else 0)
    if rows_key not in memo:
        blocks = -(-(wl.input_len + out) // bs)
        memo[rows_key] = (blocks, _unplaced_rows(wl, table_rows[_table_key(wl, rank)], out, blocks),
                          _Rows(L.REQUEST_F, n, {L.RQF_DELAY_MS: wl.delay_ms, L.RQF_START_MS: wl.start_ms}))
    blocks, rq_i, rq_f = memo[rows_key]
    rq_i = _Rows(L.REQUEST_I, n, dict(rq_i.columns))  # its columns may be set below
    pinned = sim.placement == "kv_router" and wl.worker is not None
    if pinned:
        # a disaggregated request's logical row goes to the decode pool
        rq_i.columns[L.RQ_PIN_WORKER] = wl.worker[:, 2 if sim.disaggregated else 0]
    pools = [(sim.prefill_ranks, sim.ranks, rank, blocks, sim.dp_size)]
    prefill_rq_i = None
    pblocks = np.zeros(0, np.int64)
    if sim.disaggregated:
        prank = sim.prefill_rank
        pblocks = -(-(wl.input_len + 1) // prank.block_size)
        # the source computes the prompt and one hidden token
        prefill_rq_i = _unplaced_rows(wl, table_rows[_table_key(wl, prank)], 1, pblocks)
        prefill_rq_i.columns[L.RQ_NEXT_TURN] = -1
        if pinned:
            prefill_rq_i.columns[L.RQ_PIN_WORKER] = wl.worker[:, 1]
        pools.append((0, sim.prefill_ranks, prank, pblocks, sim.prefill_dp_size))
    pool_templates = []
    for first, n_workers, pool_rank, pool_blocks, pool_dp in pools:
        per_worker = -(-n // n_workers) + 1
        queued = (_default_queue_slots(n, n_workers, sim.placement) if sim.queue_slots is None
                  else sim.queue_slots) - 1
        if sim.arena_blocks is not None:
            worker_arena = sim.arena_blocks
        else:
            # resident copies rarely exceed the blocks of the requests a worker
            # serves; a run that does is rerun with the full pool (SIM_ARENA_FULL)
            # (the main pool's blocks are the build's, shared through the memo)
            sized_key = ("sized", rows_key, per_worker, pool_blocks is blocks)
            if pool_blocks is not blocks or sized_key not in memo:
                memo[sized_key] = (int(np.sort(pool_blocks)[::-1][:per_worker].sum()),
                                   int((pool_blocks - wl.input_len // pool_rank.block_size).sum()))
            largest, private = memo[sized_key]
            worker_arena = largest + 16
            if not sim.disaggregated and pool_rank.backend != "sglang":
                # an aggregated worker's resident copies are at most one per
                # distinct full prompt block plus every request's private blocks
                # (partial prompt block and output), give or take duplicates of
                # a prefix computed twice concurrently: an eighth more covers
                # every reference run by a wide margin
                resident = distinct_prompt_blocks[(id(wl), bs)] + private
                worker_arena = min(worker_arena, resident + resident // 8 + 64)
        cfg_key = ("cfg", pool_rank, sim.handoff_latency_ms, pool_dp)
        if cfg_key not in memo:
            cfg_i = np.zeros((1, L.CFG_I_FIELDS), np.int64)
            cfg_f = np.zeros((1, L.CFG_F_FIELDS), np.float64)
            _rank_config(cfg_i, cfg_f, slice(0, 1), pool_rank, sim.handoff_latency_ms, pool_dp)
            memo[cfg_key] = cfg_i, cfg_f
        cfg_i, cfg_f = memo[cfg_key]
        arena = min(pool_rank.num_gpu_blocks, worker_arena)
        # a request adds at most two tree nodes per insert (a split and a leaf) and
        # inserts a few times (chunks, first token, finish); a run that needs more is
        # rerun with a node per page (SIM_ARENA_FULL)
        nodes = arena if sim.arena_blocks is not None else min(arena, 8 * per_worker + 64)
        pool_templates.append((first, n_workers, _PoolTemplate(
            arena=arena, run_cap=min(pool_rank.max_num_seqs, queued) + 1, wait_cap=queued + 1,
            cfg_i=cfg_i[0], cfg_f=cfg_f[0], nodes=nodes)))
    firsts = wl.order if sim.concurrency == 0 else np.flatnonzero(wl.turn_index == 0)
    turns_key = ("next_turn", id(wl))
    if turns_key not in memo:
        memo[turns_key] = _next_turns(wl)
    return _SimTemplate(rq_i=rq_i, rq_f=rq_f, lease_entries=int(blocks.sum()),
                        prefill_rq_i=prefill_rq_i, prefill_lease_entries=int(pblocks.sum()),
                        max_lease_blocks=int(max(blocks.max(initial=1), pblocks.max(initial=1))),
                        next_turn=memo[turns_key], firsts=firsts, pools=tuple(pool_templates))


class StateTooLarge(SimulationError):
    """The kernel state of a batch would not fit in the memory available."""


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def state_bytes(sims: Sequence[Simulation], templates: Sequence[_SimTemplate], n_q: int,
                pass_log_rows: int, event_rows: int = 0) -> int:
    """Bytes of the kernel state ``build_state`` allocates for these simulations and
    their templates (the arrays the kernels touch; the workload tables aside)."""
    n_sims = len(sims)
    lease = sum(t.lease_entries + t.prefill_lease_entries for t in templates)
    n_w = arena = tab = queues = 0
    for t in templates:
        for _, n_workers, pool in t.pools:
            n_w += n_workers
            arena += n_workers * pool.arena
            tab += n_workers * _pow2_at_least(2 * pool.arena)
            queues += n_workers * (pool.run_cap + pool.wait_cap)
    per_worker = (L.CFG_I_FIELDS + L.CFG_F_FIELDS + L.WK_FIELDS + L.PW_FIELDS + 2) * 8
    return int(n_q * (L.RQ_I_FIELDS + L.RQ_F_FIELDS) * 8 + lease * 12
               + arena * (L.PB_FIELDS * 4 + 8) + tab * 4 + queues * 8 + n_w * per_worker
               + n_sims * (pass_log_rows * L.PL_NUM_COLUMNS * 8
                           + (sketch.TOKEN_STAT_WIDTH + sketch.TOKEN_HIST_WIDTH) * 8
                           + (1 + event_rows) * L.EV_NUM_COLUMNS * 8 + L.SM_FIELDS * 8)
               + 4 * n_q * 8)


def check_state_fits(sims, templates, n_q, pass_log_rows, event_rows=0) -> None:
    """Refuse a batch whose state would not fit in the available memory (with a
    quarter to spare for the driver and the outputs), before allocating any of it."""
    need = state_bytes(sims, templates, n_q, pass_log_rows, event_rows)
    have = available_memory_bytes()
    if have is not None and need > 0.75 * have:
        workers = sum(s.ranks + s.prefill_ranks for s in sims)
        raise StateTooLarge(
            f"the batch needs about {_size(need)} of simulator state ({len(sims)} kernel unit(s), "
            f"{workers} workers, {n_q} request rows), {_size(have)} is available: use fewer "
            "workers or requests, or a smaller --batch-size")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.0f} MiB"


def _default_queue_slots(n: int, n_workers: int, placement: str) -> int:
    """Running/waiting slots per worker for n requests: round robin gives a worker at
    most ceil(n / N) of them; another placement may give it more, and half as much
    again covers a random one nearly always (a run that overflows is rerun with room
    for all n, SIM_CAPACITY)."""
    per_worker = -(-n // n_workers) + 1
    if placement == "round_robin":
        return per_worker + 1
    return min(n, per_worker + per_worker // 2 + 8) + 1


def _unplaced_rows(wl: Workload, first_src_row: int, max_output, blocks: np.ndarray) -> _Rows:
    """Request rows of a trace before arrival: prompt, output budget, trace row, session,
    lease offsets from 0 (``blocks`` per row); nothing computed, no worker, no links
    (a fresh row's links are -1, its status not arrived, its counters 0)."""
    n = len(wl.input_len)
    columns = {L.RQ_PROMPT_LEN: wl.input_len, L.RQ_MAX_OUTPUT: max_output,
               L.RQ_SRC_ROW: first_src_row + np.arange(n), L.RQ_SESSION: wl.session,
               L.RQ_TURN: wl.turn_index, L.RQ_LEASE_OFF: np.cumsum(blocks) - blocks}
    if wl.session_row is not None:
        columns[L.RQ_SESSION_ROW] = wl.session_row
    return _Rows(L.REQUEST_I, n, columns)


def build_state(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
                record_handoffs: bool = False, event_rows: int = 0, log_outputs: bool = False,
                log_kv: bool = True, independent_workers: bool = False, features=None):
    """Allocate and initialise the kernel state of a batch (``event_rows`` > 0: an engine
    event log of that many rows per simulation; ``log_outputs``: every output token in
    it too; ``log_kv``: the KV Stored / Removed facts too, else engine facts only).
    ``independent_workers``: the simulations whose workers share nothing between
    releases (``_workers_independent``; the batch logs nothing and does not grow) run
    so (``SM_INDEPENDENT``), each worker folding its token gaps into a row of its own
    after the simulations' rows (``BatchRun`` merges them when the simulation ends).
    ``features`` (``layout.Features``): optional kernel code to compile in beyond what
    the batch reaches (one compiled set for every rank group, say)."""
    n_sims = len(sims)
    # workload tables: one block of rows per distinct (trace, engine block size)
    table_rows: dict[tuple[int, int], int] = {}
    tables = []
    n_rows = 0
    for sim in sims:
        for rank in [sim.rank] + ([sim.prefill_rank] if sim.disaggregated else []):
            key = _table_key(sim.workload, rank)
            if key not in table_rows:
                table_rows[key] = n_rows
                tables.append((sim.workload, key[1]))
                n_rows += len(sim.workload.input_len)
    hash_indptr_parts, hash_id_parts, tbs_parts, phash_indptr_parts, phash_parts = [], [], [], [], []
    plan_parts, authored_parts = [], []
    authored_base = 0
    distinct_prompt_blocks: dict[tuple[int, int], int] = {}
    hash_base = 0
    phash_base = 0
    for wl, bs in tables:
        if bs == 0:  # an SGLang pool's rows: no hashes
            indptr = np.zeros(len(wl.input_len) + 1, np.int64)
            phash = np.zeros(0, np.uint64)
        else:
            indptr = count_prompt_blocks(wl.input_len.astype(np.int64), bs)
            phash = np.empty(indptr[-1], np.uint64)
            hash_prompt_blocks(wl.hash_indptr, wl.hash_ids, wl.input_len.astype(np.int64),
                               wl.trace_block_size, bs, indptr, phash)
            distinct_prompt_blocks[(id(wl), bs)] = len(np.unique(phash))
        hash_indptr_parts.append(wl.hash_indptr[:-1] + hash_base)
        hash_id_parts.append(wl.hash_ids)
        tbs_parts.append(np.full(len(wl.input_len), wl.trace_block_size, np.int64))
        phash_indptr_parts.append(indptr[:-1] + phash_base)
        phash_parts.append(phash)
        hash_base += len(wl.hash_ids)
        phash_base += len(phash)
        plan, authored = kernel_output_plan(wl, authored_base)
        plan_parts.append(plan)
        authored_parts.append(authored)
        authored_base += len(authored)
    workload = L.Workload(
        hash_indptr=np.concatenate(hash_indptr_parts + [np.array([hash_base], np.int64)]),
        hash_ids=np.concatenate(hash_id_parts),
        trace_block_size=np.concatenate(tbs_parts),
        phash_indptr=np.concatenate(phash_indptr_parts + [np.array([phash_base], np.int64)]),
        phash=np.concatenate(phash_parts),
        out_plan=np.concatenate(plan_parts),
        out_authored=np.concatenate(authored_parts),
    )

    q_len = np.array([len(s.workload.input_len) for s in sims], np.int64)
    q_off = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int64)
    w_len = np.array([s.ranks + s.prefill_ranks for s in sims], np.int64)
    w_off = np.concatenate([[0], np.cumsum(w_len)[:-1]]).astype(np.int64)
    n_logical = int(q_len.sum())
    # the prefill rows of disaggregated simulations follow every logical row
    p_len = np.where([s.disaggregated for s in sims], q_len, 0).astype(np.int64)
    p_off = n_logical + np.concatenate([[0], np.cumsum(p_len)[:-1]]).astype(np.int64)
    n_q = n_logical + int(p_len.sum())
    n_w = int(w_len.sum())

    # every simulation's template first: the state's size is known before any of it
    # is allocated, and a batch that cannot fit is refused in one line
    templates: dict[tuple, _SimTemplate] = {}
    memo: dict = {}  # what templates of one workload or pool share
    sim_templates = []
    for sim in sims:
        key = (id(sim.workload),) + tuple(getattr(sim, f.name) for f in _SIM_SETTINGS)
        if key not in templates:
            templates[key] = _sim_template(sim, table_rows, distinct_prompt_blocks, memo)
        sim_templates.append(templates[key])
    check_state_fits(sims, sim_templates, n_q, pass_log_rows, event_rows)

    # per-request state, field-major (see kernels.schema.layout)
    # every row is written from its simulation's template below
    rq_i = reused_buffers.empty("request_fields", (n_q, L.RQ_I_FIELDS), np.int64)
    rq_f = reused_buffers.empty("request_times", (n_q, L.RQ_F_FIELDS), np.float64)
    n_k = 0  # lease entries so far: each row's lease follows the previous one
    start_order = np.zeros(n_logical, np.int64)
    cfg_i = np.zeros((n_w, L.CFG_I_FIELDS), np.int64)
    cfg_f = np.zeros((n_w, L.CFG_F_FIELDS), np.float64)
    sm_i = L.SIMULATION.new(n_sims)
    arena = np.empty(n_w, np.int64)
    nodes = np.zeros(n_w, np.int64)
    run_cap = np.empty(n_w, np.int64)
    wait_cap = np.empty(n_w, np.int64)
    lease_ranges = []  # (first, end) lease entries of each vLLM / TRT-LLM simulation
    for s, sim in enumerate(sims):
        tpl = sim_templates[s]
        a, n = int(q_off[s]), int(q_len[s])
        sl = slice(a, a + n)
        if sim.rank.backend != "sglang":
            lease_ranges.append((n_k, n_k + tpl.lease_entries + (tpl.prefill_lease_entries
                                                                  if sim.disaggregated else 0)))
        tpl.rq_i.write(rq_i[sl], lease_off=n_k)
        n_k += tpl.lease_entries
        tpl.rq_f.write(rq_f[sl])
        rq_i[sl, L.RQ_NEXT_TURN] = np.where(tpl.next_turn >= 0, tpl.next_turn + a, -1)
        start_order[a:a + len(tpl.firsts)] = tpl.firsts + a
        sm_i[s, L.SM_NUM_STARTS] = len(tpl.firsts)
        sm_i[s, L.SM_CONCURRENCY] = sim.concurrency
        if sim.disaggregated:
            pa = int(p_off[s])
            psl = slice(pa, pa + n)
            tpl.prefill_rq_i.write(rq_i[psl], lease_off=n_k)
            rq_f[psl] = _fresh_row(L.REQUEST_F)
            n_k += tpl.prefill_lease_entries
            rq_i[psl, L.RQ_PEER] = np.arange(a, a + n)
            rq_i[sl, L.RQ_PEER] = np.arange(pa, pa + n)
        for first, n_workers, pool in tpl.pools:
            ws = slice(int(w_off[s]) + first, int(w_off[s]) + first + n_workers)
            arena[ws], run_cap[ws], wait_cap[ws] = pool.arena, pool.run_cap, pool.wait_cap
            nodes[ws] = pool.nodes
            cfg_i[ws] = pool.cfg_i
            cfg_f[ws] = pool.cfg_f
            cfg_i[ws, L.CFG_DP_RANK] = np.arange(n_workers) % pool.cfg_i[L.CFG_DP_SIZE]
    cfg = _with_aic_tables(L.RankConfig(i64=cfg_i, f64=cfg_f), sims, w_off)

    # a block lease starts empty; an SGLang lease is written before it is read (a page
    # per position as the request takes it), and filling its tens of megabytes would
    # cost a 10k-request SGLang replay 5-10 ms of its ~100
    lease = reused_buffers.empty("lease", n_k, np.int32)
    for first, end in lease_ranges:
        lease[first:end] = L.NO_BLOCK
    # a key is written before it is read (RQ_NUM_HASHED counts the written ones)
    rq = L.Requests(i64=rq_i, f64=rq_f, lease=lease,
                    seq_hash=reused_buffers.empty("seq_hash", n_k, np.uint64))

    # SGLang workers keep their KV in a radix cache (kernels.sglang.radix), sized like
    # the block arena it replaces: a page slot per resident page, a node per page
    sglang = cfg_i[:, L.CFG_POLICY] == L.POLICY_SGLANG
    radix = {}
    if sglang.any():
        radix = dict(radix=sglang_radix.make_radix(
            np.where(sglang, cfg_i[:, L.CFG_NUM_GPU_BLOCKS], 0), np.where(sglang, nodes, 0),
            page_size=np.where(sglang, cfg_i[:, L.CFG_BLOCK_SIZE], 1), page_slots=np.where(sglang, arena, 0),
            empty=reused_buffers.empty))
        arena = np.where(sglang, 1, arena)
    tab_size = np.array([_pow2_at_least(2 * a) for a in arena], np.int64)
    pool_w = L.POOL_W.new(n_w)
    pool_w[:, L.PW_BLK_OFF] = np.concatenate([[0], np.cumsum(arena)[:-1]])
    pool_w[:, L.PW_BLK_LEN] = arena
    pool_w[:, L.PW_TAB_OFF] = np.concatenate([[0], np.cumsum(tab_size)[:-1]])
    pool_w[:, L.PW_TAB_MASK] = tab_size - 1
    n_b = int(arena.sum())
    # arena slots are initialized when first used (block_pool._take_slot)
    with _small_pages():
        b32 = reused_buffers.empty("block_fields", (n_b, L.PB_FIELDS), np.int32)
        blk_hash = reused_buffers.empty("block_hash", n_b, np.uint64)
    pool_w[:, L.PW_SIM] = np.repeat(np.arange(n_sims), w_len)
    # the workers whose prefix index a kv_router reads (aggregated and prefill pools): a
    # region of pool.evicted_hash each, as large as the arena (a pass evicts each copy
    # at most once); only its first PW_EVICTED_LEN slots are read
    overlap_aware = np.repeat([sim.placement == "kv_router" for sim in sims], w_len) \
        & (cfg_i[:, L.CFG_ROLE] != L.ROLE_DECODE)
    evicted_cap = np.where(overlap_aware, arena, 0)
    pool_w[:, L.PW_EVICTED_OFF] = np.concatenate([[0], np.cumsum(evicted_cap)[:-1]])
    pool_w[:, L.PW_EVICTED_CAP] = evicted_cap
    evicted_hash = np.zeros(0, np.uint64)
    if evicted_cap.any():
        with _small_pages():
            evicted_hash = reused_buffers.empty("router_evicted", int(evicted_cap.sum()), np.uint64)
    event_log = {}
    if event_rows > 0:  # row 0 of each simulation is its header (len, clock)
        event_log = dict(event_log=np.zeros((n_sims, 1 + event_rows, L.EV_NUM_COLUMNS), np.int64))
        event_log["event_log"][:, 0, L.EVH_OUTPUTS] = 1 if log_outputs else 0
        event_log["event_log"][:, 0, L.EVH_KV] = 1 if log_kv else 0
        if radix and log_kv:
            # the radix caches log their KV events into the same log, with the
            # sequence hash of every page slot for its Removed event
            rad = radix["radix"]
            rad.w64[:, L.RW_SIM] = np.repeat(np.arange(n_sims), w_len)
            radix["radix"] = rad._replace(pg_hash=np.empty(len(rad.pg_key), np.uint64),
                                          event_log=event_log["event_log"])
    pool = L.Pool(w64=pool_w, b32=b32, blk_hash=blk_hash,
                  tab=reused_buffers.empty("block_table", int(tab_size.sum()), np.int32),
                  evicted_hash=evicted_hash, **event_log, **radix)
    _reset_pools(pool)

    wk_i = L.WORKER.new(n_w)
    wk_i[:, L.WK_SIM] = np.repeat(np.arange(n_sims), w_len)
    wk_i[:, L.WK_STAT_ROW] = wk_i[:, L.WK_SIM]
    # an independent simulation logs nothing (the order of its rows would depend on how
    # its decode runs were cut)
    unlogged = independent_workers and not pass_log_rows and not event_rows and not log_outputs
    independent = [s for s, sim in enumerate(sims) if unlogged and _workers_independent(sim)]
    n_stat_rows = n_sims
    for s in independent:
        ws = slice(int(w_off[s]), int(w_off[s] + w_len[s]))
        wk_i[ws, L.WK_STAT_ROW] = np.arange(n_stat_rows, n_stat_rows + w_len[s])
        n_stat_rows += int(w_len[s])
    wk_i[:, L.WK_SIM_W0] = np.repeat(w_off, w_len)
    wk_i[:, L.WK_RUN_OFF] = np.concatenate([[0], np.cumsum(run_cap)[:-1]])
    wk_i[:, L.WK_WAIT_OFF] = np.concatenate([[0], np.cumsum(wait_cap)[:-1]])
    wk_i[:, L.WK_WAIT_CAP] = wait_cap
    wk_i[:, L.WK_RUN_CAP] = run_cap
    wk_i[sglang, L.WK_SG_RATIO_BITS] = cfg_f[sglang, L.CFGF_SG_INIT_RATIO].view(np.int64)
    routed = [s for s, sim in enumerate(sims) if sim.placement == "kv_router"]
    router_state = {}
    if routed:
        # per worker of a routed aggregated simulation, a multiset of its active prompt
        # blocks: room for every distinct complete prompt block of the trace, twice
        # over (a disaggregated pool's router counts blocks without the set)
        rt_slots = np.ones(n_w, np.int64)
        for s in routed:
            sim = sims[s]
            ws = slice(int(w_off[s]), int(w_off[s] + w_len[s]))
            if not sim.disaggregated:
                rt_slots[ws] = _pow2_at_least(
                    2 * distinct_prompt_blocks[(id(sim.workload), sim.rank.block_size)] + 16)
            router = _router(sim)
            cfg_f[ws, L.CFGF_ROUTER_CREDIT] = router.overlap_score_credit
            cfg_f[ws, L.CFGF_ROUTER_LOAD_SCALE] = router.prefill_load_scale
            cfg_f[ws, L.CFGF_ROUTER_TEMPERATURE] = router.router_temperature
            cfg_i[ws, L.CFG_ROUTER_PIN] = router.pin_to_trace_worker
        wk_i[:, L.WK_RT_OFF] = np.concatenate([[0], np.cumsum(rt_slots)[:-1]])
        wk_i[:, L.WK_RT_LIMIT] = rt_slots
        # each multiset starts in the first slots of its region and grows in the kernel
        # (kv_router._make_room): a worker holds a few hundred active blocks at once
        # where its region has room for every distinct block of the trace
        in_use = np.minimum(rt_slots, ROUTER_INITIAL_SLOTS)
        wk_i[:, L.WK_RT_MASK] = in_use - 1
        # a slot's key is read only once its count says it was taken, and the counts
        # only where the multiset is (a rebuild fills what it grows into): reused
        # buffers, whose pages a previous run has mapped already; small pages, as each
        # region is used from its start only (a huge page would zero 2 MiB for the
        # first 1,024 slots of a few workers)
        with _small_pages():
            rt_count = reused_buffers.empty("router_counts", int(rt_slots.sum()), np.int32)
            rt_key = reused_buffers.empty("router_keys", int(rt_slots.sum()), np.uint64)
        for w in np.flatnonzero(rt_slots > 1):
            rt_count[wk_i[w, L.WK_RT_OFF]:wk_i[w, L.WK_RT_OFF] + in_use[w]] = -1  # RT_NEVER_USED
        router_state = dict(rt_key=rt_key, rt_count=rt_count)
    wk = L.Workers(i64=wk_i, pass_end_ms=np.zeros(n_w),
                   run_q=np.zeros(int(run_cap.sum()), np.int64),
                   wait_q=np.zeros(int(wait_cap.sum()), np.int64),
                   busy_heap=np.zeros(n_w, np.int64), ready=np.ones(n_w, np.uint8), **router_state)
    sm_i[:, L.SM_Q_OFF] = q_off
    sm_i[:, L.SM_Q_LEN] = q_len
    sm_i[:, L.SM_W_OFF] = w_off
    sm_i[:, L.SM_W_LEN] = w_len
    sm_i[:, L.SM_PREFILL_LEN] = [sim.prefill_ranks for sim in sims]
    sm_i[:, L.SM_PLACEMENT] = [L.PLACEMENT_NAMES.index(sim.placement) for sim in sims]
    sm_i[:, L.SM_RNG_STATE] = [sim.placement_seed for sim in sims]
    sm_i[:, L.SM_PREFILL_Q_OFF] = np.where([s.disaggregated for s in sims], p_off, -1)
    # the handoff order is the backend's (spec/replay.md 5.2): SGLang reserves first
    sm_i[:, L.SM_DEST_FIRST] = [s.disaggregated and s.rank.backend == "sglang" for s in sims]
    sm_i[independent, L.SM_INDEPENDENT] = 1
    decisions = max([int(q_len[s]) * (2 if sims[s].disaggregated else 1) for s in routed], default=0)
    with _small_pages():
        token_stat, token_hist = sketch.token_stats_new(n_stat_rows)
    sim_state = L.Sims(
        i64=sm_i, now_ms=np.zeros(n_sims), start_order=start_order,
        heap_q=np.zeros(n_logical, np.int64), actq=np.zeros(n_logical, np.int64),
        xfer_heap=np.zeros(n_logical, np.int64),
        token_stat=token_stat, token_hist=token_hist,
        pass_log=np.zeros((n_sims, pass_log_rows, L.PL_NUM_COLUMNS)),
        hlog=np.zeros((n_sims, _handoff_log_rows(sims) if record_handoffs else 0, L.HL_NUM_COLUMNS)),
        # one decision per request of a routed simulation, two when disaggregated
        **(dict(rt_log=np.zeros((n_sims, decisions, L.RL_NUM_COLUMNS)),
                rt_costs=np.zeros((n_sims, decisions, int(w_len[routed].max()))))
           if routed else {}),
    )
    max_lease = max([t.max_lease_blocks for t in templates.values()], default=1)
    max_bs = int(cfg_i[:, L.CFG_BLOCK_SIZE].max())
    # the optional kernel code this batch reaches, and only that, compiles
    reached = features_of(cfg_i, sm_i)
    cfg = cfg._replace(features=reached if features is None else union(reached, features))
    return cfg, pool, rq, workload, wk, sim_state, max_lease, max_bs


@contextlib.contextmanager
def _small_pages():
    """Allocate arrays the kernels touch sparsely without transparent huge pages:
    numpy asks for them on every array of 4 MiB or more, and then the first touch
    anywhere in a 2 MiB page zeroes all of it. A run uses a part of each worker's
    block arena and a few hundred bins of each simulation's 301 KiB sketch row;
    with small pages only those are ever materialized."""
    previous = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(previous)


def _reset_pools(pool: L.Pool) -> None:
    """Every worker's pool empty, as ``kernels.kv.block_pool.pool_reset`` leaves it: no
    arena slot used yet (slots are initialized when first taken), empty prefix table
    and LRU."""
    pool.w64[:, [L.PW_FREE_TOP, L.PW_BUMP, L.PW_NUM_COPIES, L.PW_NUM_RESERVED, L.PW_LRU_LEN]] = 0
    pool.w64[:, [L.PW_LRU_HEAD, L.PW_LRU_TAIL]] = L.NO_BLOCK
    pool.tab[:] = L.NO_BLOCK


def _pools(sim: Simulation, first_worker: int):
    """(workers, rank) of each pool of a simulation whose first worker is given."""
    out = [(slice(first_worker + sim.prefill_ranks, first_worker + sim.prefill_ranks + sim.ranks),
            sim.rank)]
    if sim.disaggregated:
        out.append((slice(first_worker, first_worker + sim.prefill_ranks), sim.prefill_rank))
    return out


def _with_aic_tables(cfg: L.RankConfig, sims: Sequence[Simulation], w_off: np.ndarray) -> L.RankConfig:
    """Give the AIC-timed workers of a batch their tables (kernels.timing.aic_table): one
    shared table per timing config, filled with every key known so far, and one
    per simulation and config for the keys met in the run."""
    uses = [tuple(dict.fromkeys(rank.aic for _, rank in _pools(sim, 0) if rank.aic is not None))
            for sim in sims]
    if not any(uses):
        return cfg
    from aisim_fast.aic import timing as aic
    keys, vals, meta, slots = aic.batch_tables(uses)
    for s, sim in enumerate(sims):
        for ws, rank in _pools(sim, int(w_off[s])):
            if rank.aic is not None:
                cfg.i64[ws, L.CFG_AIC_SHARED], cfg.i64[ws, L.CFG_AIC_LOCAL] = slots[(s, rank.aic)]
    return cfg._replace(aic_key=keys, aic_ms=vals, aic_meta=meta)


def _rank_config(cfg_i: np.ndarray, cfg_f: np.ndarray, ws: slice, rank: RankConfig,
                 handoff_latency_ms: float, dp_size: int = 1) -> None:
    """Write one pool's rank configuration into the rows ``ws`` of the config matrices
    (``dp_size``: attention-DP ranks per worker; their rank numbers are set apart)."""
    cfg_i[ws, L.CFG_NUM_GPU_BLOCKS] = rank.num_gpu_blocks
    cfg_i[ws, L.CFG_BLOCK_SIZE] = rank.block_size
    cfg_i[ws, L.CFG_MAX_NUM_SEQS] = rank.max_num_seqs
    cfg_i[ws, L.CFG_MAX_NUM_BATCHED_TOKENS] = rank.max_num_batched_tokens
    cfg_i[ws, L.CFG_MAX_MODEL_LEN] = -1 if rank.max_model_len is None else rank.max_model_len
    cfg_i[ws, L.CFG_PREFIX_CACHING] = rank.enable_prefix_caching
    cfg_i[ws, L.CFG_CHUNKED_PREFILL] = rank.enable_chunked_prefill
    cfg_i[ws, L.CFG_PREEMPTION_FIFO] = rank.preemption_mode == "fifo"
    cfg_i[ws, L.CFG_POLICY] = {"trtllm": L.POLICY_TRTLLM, "sglang": L.POLICY_SGLANG}.get(
        rank.backend, L.POLICY_VLLM)
    cfg_i[ws, L.CFG_ROLE] = {"aggregated": L.ROLE_AGGREGATED, "prefill": L.ROLE_PREFILL,
                             "decode": L.ROLE_DECODE}[rank.worker_type]
    cfg_i[ws, L.CFG_TIMING] = {"fixed": L.TIMING_FIXED, "aic": L.TIMING_AIC}.get(
        rank.timing_model, L.TIMING_POLYNOMIAL)
    cfg_i[ws, L.CFG_AIC_SHARED] = -1  # build_state gives AIC workers their tables
    cfg_i[ws, L.CFG_AIC_LOCAL] = -1
    cfg_i[ws, L.CFG_TRANSFER_MODE] = (L.TRANSFER_DESTINATION_MISSING
                                      if rank.kv_transfer_timing_mode == "destination_missing"
                                      else L.TRANSFER_FULL_PROMPT)
    cfg_f[ws, L.CFGF_FIXED_PREFILL_MS] = rank.fixed_prefill_ms
    cfg_f[ws, L.CFGF_FIXED_DECODE_MS] = rank.fixed_decode_ms
    cfg_f[ws, L.CFGF_SPEEDUP_RATIO] = rank.speedup_ratio
    cfg_f[ws, L.CFGF_DECODE_SPEEDUP_RATIO] = rank.decode_speedup_ratio
    cfg_f[ws, L.CFGF_KV_BANDWIDTH_GBS] = (np.nan if rank.kv_transfer_bandwidth is None
                                          else rank.kv_transfer_bandwidth)
    cfg_f[ws, L.CFGF_KV_BYTES_PER_TOKEN] = (np.nan if rank.kv_transfer_bytes_per_token is None
                                            else rank.kv_transfer_bytes_per_token)
    cfg_f[ws, L.CFGF_HANDOFF_LATENCY_MS] = handoff_latency_ms
    cfg_i[ws, L.CFG_DP_SIZE] = dp_size
    # the cadence acts with attention DP only (engine.md 5.7); 1 = every pass
    cfg_i[ws, L.CFG_PREFILL_CADENCE] = rank.prefill_schedule_interval if dp_size > 1 else 1
    if rank.backend == "sglang":
        cfg_i[ws, L.CFG_SG_MAX_PREFILL_TOKENS] = rank.sglang_max_prefill_tokens
        # attention DP splits the chunk budget over the ranks (engine.md 7.9)
        cfg_i[ws, L.CFG_SG_CHUNK_SIZE] = rank.sglang_chunked_prefill_size // dp_size
        cfg_i[ws, L.CFG_SG_CLIP] = rank.sglang_clip_max_new_tokens
        cfg_i[ws, L.CFG_SG_LPM] = rank.sglang_schedule_policy == "lpm"
        cfg_i[ws, L.CFG_SG_PD_INTERVAL] = rank.prefill_decode_interval
        # the reference's f64 sequence: init, its floor, the decay step in this order
        # and makes admission more conservative (x0.3, engine.md 7.9)
        conservativeness = rank.sglang_schedule_conservativeness * (0.3 if dp_size > 1 else 1.0)
        init = 0.7 * conservativeness
        floor = init * 0.14
        cfg_f[ws, L.CFGF_SG_INIT_RATIO] = init
        cfg_f[ws, L.CFGF_SG_MIN_RATIO] = floor
        cfg_f[ws, L.CFGF_SG_DECAY_STEP] = (init - floor) / 600.0


ROUTING_COLUMNS = ("request_id", "turn_index", "pool", "worker", "dp_rank", "cost", "costs", "overlap_blocks",
                   "best_overlap_blocks", "tied", "time_ms")


def _routing_frame(sim: Simulation, log: np.ndarray, costs: np.ndarray) -> pd.DataFrame:
    """One row per kv_router decision: the request, the pool it was placed in
    (aggregated, or prefill / decode: a disaggregated request has one decision in
    each), the chosen worker (index in its pool) and its attention-DP rank, its cost
    and every rank's of the pool (worker-major: a worker's ``dp_size`` ranks in a
    row), its overlap and the best any rank offered, and how many ranks shared the
    lowest cost."""
    rows = log[:, L.RL_REQUEST].astype(np.int64)
    pool = log[:, L.RL_POOL].astype(np.int64)
    prefill = pool == L.ROUTE_PREFILL
    width = np.where(prefill, sim.prefill_ranks, sim.ranks)
    dp = np.where(prefill, sim.prefill_dp_size, sim.dp_size)
    rank = log[:, L.RL_WORKER].astype(np.int64)
    wl = sim.workload
    return pd.DataFrame({
        "request_id": wl.request_name[rows].astype(str) if len(rows) else np.zeros(0, str),
        "turn_index": wl.turn_index[rows].astype(np.int64),
        "pool": np.array(L.ROUTE_POOL_NAMES, dtype=object)[pool],
        "worker": rank // dp,
        "dp_rank": rank % dp,
        "cost": log[:, L.RL_COST],
        "costs": [list(r[:k]) for r, k in zip(costs, width.tolist())],
        "overlap_blocks": log[:, L.RL_OVERLAP].astype(np.int64),
        "best_overlap_blocks": log[:, L.RL_BEST_OVERLAP].astype(np.int64),
        "tied": log[:, L.RL_TIED].astype(np.int64),
        "time_ms": log[:, L.RL_TIME_MS],
    }, columns=list(ROUTING_COLUMNS))


def _optional(values: np.ndarray, present: np.ndarray) -> pd.arrays.IntegerArray:
    """Integers that are null where ``present`` is False (a worker never assigned),
    as the reference leaves those cells empty."""
    return pd.arrays.IntegerArray(np.where(present, values, 0).astype(np.int64), ~present)


def _request_frame(sim: Simulation, rq: L.Requests, a, w_first) -> pd.DataFrame:
    """Per-request record, columns named as in the reference's per-request CSVs.

    ``a``: the first kernel row of the simulation's requests, or the kernel row of each
    (a simulation run as per-worker units); ``w_first``: its first worker, or per row
    the number to subtract from a row's worker to get the simulation's.

    Disaggregated: the logical row carries arrival, decode tokens and the handoff
    timestamps, its prefill row (RQ_PEER) the prefill side; latencies count decode
    tokens only (the prefill's one token is hidden), admissions both sides."""
    n = len(sim.workload.input_len)
    rows = slice(a, a + n) if np.isscalar(a) else a
    ri = rq.i64[rows]
    rf = rq.f64[rows]
    first = rf[:, L.RQF_FIRST_TOKEN_MS]
    last = rf[:, L.RQF_LAST_TOKEN_MS]
    arrival = rf[:, L.RQF_ARRIVAL_MS]
    n_out = ri[:, L.RQ_GENERATED]
    with np.errstate(invalid="ignore"):
        tpot = np.where(n_out >= 2, (last - first) / np.maximum(n_out - 1, 1), np.nan)
    if sim.disaggregated:
        pi, pf = rq.i64[ri[:, L.RQ_PEER]], rq.f64[ri[:, L.RQ_PEER]]
        prefill_rank = pi[:, L.RQ_WORKER] - w_first
        prefill_placed = pi[:, L.RQ_WORKER] >= 0
        prefill_worker = _optional(prefill_rank // sim.prefill_dp_size, prefill_placed)
        first_decode_worker = w_first + sim.prefill_ranks
    else:
        pi, pf = ri, rf  # one row serves both sides
        first_decode_worker = w_first
    rank = ri[:, L.RQ_WORKER] - first_decode_worker
    placed = ri[:, L.RQ_WORKER] >= 0
    worker = _optional(rank // sim.dp_size, placed)
    cols = {
        "request_id": sim.workload.request_name,
        "trace_line": sim.workload.line_no,
        "turn_index": sim.workload.turn_index.astype(np.int64),
        "worker": worker,
    }
    if sim.dp_size > 1:
        cols["dp_rank"] = _optional(rank % sim.dp_size, placed)  # the attention-DP rank of its worker
    if sim.prefill_dp_size > 1:
        cols["prefill_dp_rank"] = _optional(prefill_rank % sim.prefill_dp_size, prefill_placed)
    if not sim.disaggregated:
        cols["decode_worker"] = worker  # as the reference records it
    cols.update({
        "arrival_ms": arrival,
        "first_admit_ms": pf[:, L.RQF_FIRST_ADMIT_MS],
        "first_token_ms": first,
        "second_token_ms": rf[:, L.RQF_SECOND_TOKEN_MS],
        "last_token_ms": last,
        "completion_ms": rf[:, L.RQF_TERMINAL_MS],
        "ttft_ms": first - arrival,
        "tpot_ms": tpot,
        "e2e_ms": last - arrival,
        "input_tokens": ri[:, L.RQ_PROMPT_LEN],
        "output_tokens": n_out,
        "requested_output_tokens": sim.workload.output_len.astype(np.int64),
    })
    if sim.disaggregated:
        cols.update({
            "prefill_output_tokens": pi[:, L.RQ_GENERATED],  # hidden from the latency metrics
            "decode_republished_prompt_blocks": ri[:, L.RQ_REPUBLISHED],
        })
    cols.update({
        "cached_tokens": pi[:, L.RQ_MAX_CACHED],
        "first_admission_cached_tokens": np.maximum(pi[:, L.RQ_FIRST_CACHED], 0),
    })
    admissions = ri[:, L.RQ_ADMISSIONS]
    readmissions = np.maximum(admissions - 1, 0)
    preemptions = ri[:, L.RQ_PREEMPTIONS]
    committed = ri[:, L.RQ_COMMITTED_PREFILL]
    if sim.disaggregated:
        cols.update({
            "prefill_worker": prefill_worker,
            "decode_worker": worker,
            "prefill_admit_ms": pf[:, L.RQF_FIRST_ADMIT_MS],
            "source_held_ms": rf[:, L.RQF_SOURCE_HELD_MS],
            "destination_reserved_ms": rf[:, L.RQF_DEST_RESERVED_MS],
            "destination_activated_ms": rf[:, L.RQF_DEST_ACTIVATED_MS],
            "decode_admit_ms": rf[:, L.RQF_FIRST_ADMIT_MS],
            "source_released_ms": rf[:, L.RQF_SOURCE_RELEASED_MS],
            "transfer_done_ms": rf[:, L.RQF_TRANSFER_DONE_MS],
            "transferable_prompt_tokens": np.where(
                np.isfinite(rf[:, L.RQF_DEST_RESERVED_MS]),
                ri[:, L.RQ_RESERVED_FRESH] * sim.rank.block_size, -1),
            # no destination, or (SGLang reserves it first) one never admitted because the
            # prefill side rejected the prompt: no decode-side reuse either
            "decode_cached_tokens": _optional(
                np.maximum(ri[:, L.RQ_MAX_CACHED], 0),
                (ri[:, L.RQ_WORKER] >= 0) & ~((ri[:, L.RQ_ADMISSIONS] == 0)
                                              & (ri[:, L.RQ_TERMINAL] == L.TERM_REJECTED))),
        })
        readmissions = readmissions + np.maximum(pi[:, L.RQ_ADMISSIONS] - 1, 0)
        admissions = admissions + pi[:, L.RQ_ADMISSIONS]
        preemptions = preemptions + pi[:, L.RQ_PREEMPTIONS]
        committed = committed + pi[:, L.RQ_COMMITTED_PREFILL]
    cols.update({
        "admission_count": admissions,
        "readmission_count": readmissions,
        "preemptions": preemptions,
        "committed_prefill_tokens": committed,
        "terminal_status": np.array(L.TERMINAL_STATUS_NAMES, dtype=object)[ri[:, L.RQ_TERMINAL]],
    })
    frame = pd.DataFrame(cols)
    sent = ri[:, L.RQ_TERMINAL] != L.TERM_NOT_SENT
    if not sent.all():  # turns after a failed one: never sent, so no record (as the reference)
        frame = frame[sent].reset_index(drop=True)
    return frame


def run_batch(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
              record_passes: bool = True, record_handoffs: bool = False,
              record_events: bool = False, record_outputs: bool = False,
              progress=None, record_pressure: bool = False, spill_passes: bool = False) -> BatchResult:
    """Run every simulation to completion; ``status[s]`` / ``error[s]`` of the result say
    how each ended (a failed one does not affect the others). Raises only for
    programming errors.

    A simulation whose config is invalid is not run (``rejected_config``). One that
    outgrows its block arena estimate or its placement's queue sizing is rerun alone
    with room for everything, transparently. An open-loop, single-turn, round-robin
    aggregated simulation is split into one unit per worker: round-robin placement
    sends arrival i to worker i mod N whatever the state, and aggregated workers share
    nothing else, so the workers are independent simulations and run on separate
    threads. Results are merged back per simulation (token-gap statistics with Chan's
    merge). ``record_events``: every KV Stored / Removed fact of every worker in
    ``result.kv_events[s]``, every admission, preemption and finish in
    ``result.engine_events[s]``, every vLLM preemption and SGLang retraction in
    ``result.pressure_events[s]``; ``record_pressure``: the engine facts without the KV
    facts (admissions, preemptions, finishes, pressure events; SGLang too);
    ``record_outputs`` (with or without them): every output token in
    ``result.output_events[s]``. ``progress``: called as ``progress(sim_ms,
    done, total)`` (the least virtual clock of the live simulations, requests finished,
    requests) after each slice of about ``PROGRESS_SLICE_S`` wall seconds: the batch
    then advances in virtual-time slices (``BatchRun.advance`` to growing horizons,
    exactly as one call), so the driver regains control, and Ctrl-C works, within
    about a second even in a long run. ``spill_passes``: the drained pass log waits in
    a temporary file, not in memory, until ``passes`` / ``pass_parts`` read it."""
    n_sims = len(sims)
    status = [STATUS_OK] * n_sims
    error = [""] * n_sims
    units: list[Simulation] = []
    owner: list[tuple[int, int, np.ndarray | None]] = []  # (simulation, worker, rows)
    for s, sim in enumerate(sims):
        try:
            check_simulation(sim)
        except ConfigError as exc:
            status[s] = STATUS_REJECTED_CONFIG
            error[s] = f"simulation {s}: invalid config: {exc}"
            continue
        # a worker unit numbers its requests from 1, so the hashes of generated blocks
        # (the reference's synthetic tokens use the request's number) would differ
        # from the whole run's: KV events are recorded on whole runs only
        logged = record_events or record_outputs or record_pressure
        shards = None if logged else _worker_shards(sim)
        if shards is None:
            units.append(sim)
            owner.append((s, -1, None))
        else:
            for w, (rows, unit) in enumerate(shards):
                units.append(unit)
                owner.append((s, w, rows))
    logged = record_events or record_outputs or record_pressure
    # a capped simulation's committed prefill and last instant come from its passes
    any_capped = any(sim.max_sim_time_ms is not None for sim in sims)
    res = _run_units_resized(units, pass_log_rows, record_passes or any_capped, [s for s, _, _ in owner],
                             record_handoffs, DEFAULT_EVENT_ROWS if logged else 0,
                             record_outputs, progress, log_kv=record_events, spill_passes=spill_passes)
    parts: list[list[int]] = [[] for _ in sims]
    for u, (s, _, _) in enumerate(owner):
        parts[s].append(u)
        if res.status[u] != STATUS_OK and status[s] == STATUS_OK:
            status[s], error[s] = res.status[u], res.error[u]
    # A worker unit that stops stops alone, at its own time and with its own requests;
    # the reference stops the whole run, with every worker's requests in flight: rerun
    # such a simulation whole for its stop (rare, and it has no results to merge).
    for s in range(n_sims):
        if len(parts[s]) > 1 and status[s] != STATUS_OK:
            whole = _run_units_resized([sims[s]], 0, False, [s], False)
            status[s], error[s] = whole.status[0], whole.error[0]
    capped = _end_at_caps(sims, parts, status, res)
    aic_configs = {rank.aic for sim in sims for _, rank in _pools(sim, 0) if rank.aic is not None}
    if aic_configs:
        from aisim_fast.aic import timing as aic
        aic.save_all()  # the values met in this batch, for the next run
        failed_timing = aic.take_failures(aic_configs)
        for s, sim in enumerate(sims):
            bad = [failed_timing[r.aic] for _, r in _pools(sim, 0) if r.aic in failed_timing]
            if bad and status[s] == STATUS_OK:
                status[s], error[s] = STATUS_REJECTED_CONFIG, f"simulation {s}: timing: {bad[0]}"

    with _small_pages():
        stat, hist = sketch.token_stats_new(n_sims)
    for s in range(n_sims):
        if len(parts[s]) == 1:  # not split: keep the row bit for bit
            stat[s] = res.token_stat[parts[s][0]]
        elif parts[s]:
            stat[s] = sketch_merge_rows(res.token_stat[parts[s]])
    if units:
        sketch.add_hist_rows(hist, np.array([s for s, _, _ in owner], np.int64), res.token_stat,
                             res.token_hist)

    def failed(s):
        if status[s] != STATUS_OK:
            raise SimulationError(error[s])

    def requests(s):
        failed(s)
        if len(parts[s]) == 1 and owner[parts[s][0]][1] < 0:
            return res.requests[parts[s][0]]
        runs = {id(res.sources[u][0]) for u in parts[s]}
        if len(runs) == 1:
            # every worker unit in one kernel state: one frame over their rows
            run = res.sources[parts[s][0]][0]
            n = len(sims[s].workload.input_len)
            q_rows = np.empty(n, np.int64)
            w_base = np.empty(n, np.int64)
            for u in parts[s]:
                _, w, rows = owner[u]
                q0, w0 = run.offsets(res.sources[u][1])
                q_rows[rows] = q0 + np.arange(len(rows))
                w_base[rows] = w0 - w * sims[s].dp_size  # a unit's ranks are its worker's
            return _request_frame(sims[s], run.state.rq, q_rows, w_base)
        frames = []
        for u in parts[s]:
            _, w, rows = owner[u]
            frame = res.requests[u].copy()
            frame.index = rows
            frame["worker"] = frame["worker"].where(frame["worker"].isna(), w)
            frame["decode_worker"] = frame["worker"]
            frames.append(frame)
        return pd.concat(frames).sort_index().reset_index(drop=True)

    def passes(s):
        failed(s)
        if len(parts[s]) == 1 and owner[parts[s][0]][1] < 0:
            return res.passes[parts[s][0]]
        frames = []
        for u in parts[s]:
            frame = res.passes[u].copy()
            frame["worker"] = owner[u][1]
            frames.append(frame)
        merged = pd.concat(frames, ignore_index=True)
        return merged.sort_values(["start_ms", "worker"], kind="stable", ignore_index=True)

    def pass_parts(s):
        # raw drained chunks gathered into parts of about PASS_PART_ROWS rows: a frame
        # per drained chunk would cost more in pandas than the rows themselves
        failed(s)
        worker_col = L.PASS_LOG_COLUMNS.index("worker")
        buffered, n_rows = [], 0
        for u in parts[s]:
            run, i = res.sources[u]
            w = owner[u][1]
            for chunk in run.pass_chunks(i):
                if w >= 0:  # a worker unit of a split run: its worker in the simulation
                    chunk = chunk.copy()
                    chunk[:, worker_col] = w
                buffered.append(chunk)
                n_rows += len(chunk)
                if n_rows >= PASS_PART_ROWS:
                    yield _pass_table(buffered)
                    buffered, n_rows = [], 0
        if buffered or not parts[s]:
            yield _pass_table(buffered)

    def handoffs(s):
        failed(s)
        if len(parts[s]) == 1 and owner[parts[s][0]][1] < 0:
            return res.handoffs[parts[s][0]]
        # only aggregated simulations are split: they have no handoffs
        return _handoff_frame(sims[s], np.zeros((0, L.HL_NUM_COLUMNS)))

    def kv_events(s):
        failed(s)
        return res.kv_events[parts[s][0]]  # recorded runs are never split

    def engine_events(s):
        failed(s)
        return res.engine_events[parts[s][0]]

    def pressure_events(s):
        failed(s)
        return res.pressure_events[parts[s][0]]

    def output_events(s):
        failed(s)
        return res.output_events[parts[s][0]]

    def routing(s):
        failed(s)
        return res.routing[parts[s][0]]  # routed simulations are never split

    end_ms = np.array([res.end_ms[parts[s]].max() if parts[s] else np.nan for s in range(n_sims)])
    for s, facts in enumerate(capped):
        if facts is not None:
            end_ms[s] = facts.last_instant_ms
    leftovers = [_merge_leftovers([res.leftovers[u] for u in parts[s]]) if parts[s] else {}
                 for s in range(n_sims)]

    def by_cap(table):
        # a capped simulation keeps what happened by its cap (spec replay.md 12.11)
        def read(s):
            frame = table(s)
            return frame if capped[s] is None else _until_cap(frame, capped[s].cap_ms)
        return _LazyFrames(n_sims, read)

    def capped_pass_parts(s):
        for part in pass_parts(s):
            yield part if capped[s] is None else _until_cap(part, capped[s].cap_ms)

    return BatchResult(by_cap(requests), by_cap(passes),
                       stat, hist, res.kernel_calls, end_ms, by_cap(handoffs),
                       leftovers, status, error, by_cap(kv_events),
                       by_cap(engine_events), by_cap(output_events),
                       by_cap(routing), by_cap(pressure_events), capped_pass_parts, capped)


@dataclass(frozen=True)
class CapFacts:
    """What a simulation with a time cap reports besides its records (spec replay.md
    12.11): every arrival by the cap counts, worker-seconds run to its last instant at
    or before the cap, and only passes that end by the cap commit prefill tokens."""
    cap_ms: float
    num_requests: int            # arrivals at or before the cap
    last_instant_ms: float       # the last arrival, pass end or transfer at or before the cap
    committed_prefill_tokens: int


def _until_cap(table, cap_ms: float):
    """The rows of a result table (a frame, or an Arrow table of passes) that happened
    by the cap: requests terminal by then, passes that end by then, events and
    decisions at or before it. A pass that ends after the cap is dropped whole."""
    columns = table.columns if isinstance(table, pd.DataFrame) else table.column_names
    column = next(c for c in ("completion_ms", "end_ms", "time_ms", "at_ms") if c in columns)
    if isinstance(table, pd.DataFrame):
        kept = table[table[column].to_numpy(np.float64) <= cap_ms]
        # requests keep their trace rows as the index (``requests_in_uuid_order``)
        return kept if column == "completion_ms" else kept.reset_index(drop=True)
    import pyarrow.compute as pc
    return table.filter(pc.less_equal(table[column], cap_ms))


def _end_at_caps(sims, parts, status, res) -> list:
    """For each capped simulation that ran (unsplit, its passes recorded) to its cap:
    its CapFacts, and token statistics over the requests completed by the cap. Token
    gaps are folded as they are emitted, so a second run with the others' gaps left
    out gives them (the reference folds a request's gaps when it completes). None for
    the others."""
    facts: list = [None] * len(sims)
    reruns, where = [], []
    for s, sim in enumerate(sims):
        if sim.max_sim_time_ms is None or status[s] != STATUS_OK:
            continue
        cap_ms = float(sim.max_sim_time_ms)
        (u,) = parts[s]
        requests, passes = res.requests[u], res.passes[u]
        arrival_ms = requests["arrival_ms"].to_numpy(np.float64)
        arrived = arrival_ms <= cap_ms
        start_ms, end_ms = passes["start_ms"].to_numpy(np.float64), passes["end_ms"].to_numpy(np.float64)
        ended = end_ms <= cap_ms
        straddling = (start_ms <= cap_ms) & ~ended  # at most one per rank: its work never commits
        committed = int(requests["committed_prefill_tokens"].sum()) \
            - int(passes["sum_prefill_tokens"].to_numpy(np.int64)[straddling].sum())
        # the instants the run drained by the cap: arrivals, pass ends, KV transfers done
        last_ms = max(float(arrival_ms[arrived].max(initial=0.0)), float(end_ms[ended].max(initial=0.0)))
        if "transfer_done_ms" in requests:
            done_ms = requests["transfer_done_ms"].to_numpy(np.float64)
            last_ms = max(last_ms, float(done_ms[done_ms <= cap_ms].max(initial=0.0)))
        facts[s] = CapFacts(cap_ms, int(arrived.sum()), last_ms, committed)
        unfinished = np.flatnonzero(~(requests["completion_ms"].to_numpy(np.float64) <= cap_ms))
        # (no rerun when none of them emitted a token gap yet)
        if (requests["output_tokens"].to_numpy(np.int64)[unfinished] > 1).any():
            reruns.append(dataclasses.replace(sim, token_stats_excluded=unfinished))
            where.append(u)
    if reruns:
        again = _run_units_resized(reruns, 0, False, where, False)
        for i, u in enumerate(where):
            res.token_stat[u] = again.token_stat[i]
            res.token_hist[u] = again.token_hist[i]
    return facts


def _workers_apart_between_releases(sim: Simulation) -> bool:
    """Whether a simulation's workers share nothing between two of its releases: an
    uncapped open-loop single-turn aggregated run of several workers (no terminal
    releases a turn or frees a session slot, no handoff)."""
    return (not sim.disaggregated and sim.workers > 1 and not sim.concurrency
            and sim.max_sim_time_ms is None and not np.any(sim.workload.turn_index != 0))


def _workers_independent(sim: Simulation) -> bool:
    """Whether a simulation runs whole with independent workers (``SM_INDEPENDENT``):
    a routed (kv_router or random) run whose workers are apart between releases, of
    vLLM / TRT-LLM workers, one rank each, fixed timing. Between two releases a worker
    sees no other worker's pass end, so its decode runs need not end there
    (kernels.vllm.decode_run); at a release the router reads every worker as the whole
    loop leaves it. Round robin splits such a run into worker units instead."""
    return (sim.placement in ("kv_router", "random") and sim.rank.backend != "sglang"
            and sim.dp_size == 1 and sim.rank.aic is None and _workers_apart_between_releases(sim))


def _worker_shards(sim: Simulation):
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
    return [(sub.line_no_rows, Simulation(sub.workload, sim.rank, 1, 0, sim.arena_blocks,
                                          queue_slots=sim.queue_slots, dp_size=sim.dp_size))
            for sub in cached[1]]


_SHARD_CACHE: dict = {}


@dataclass(frozen=True)
class _Shard:
    workload: Workload
    line_no_rows: np.ndarray  # rows of the parent workload, in the shard's order


def _sub_workload(wl: Workload, rows: np.ndarray) -> _Shard:
    """The trace restricted to ``rows`` (already in arrival order)."""
    return _Shard(select_rows(wl, rows), rows)


@dataclass
class _UnitResults:
    """Results of independent units (whole simulations or worker shards), by unit."""
    status: list          # STATUS_* per unit, or the kernel's "arena_full" / "capacity"
    error: list
    requests: Sequence
    passes: Sequence
    handoffs: Sequence
    kv_events: Sequence
    engine_events: Sequence
    pressure_events: Sequence
    output_events: Sequence
    routing: Sequence
    sources: list         # per unit: (the BatchRun that ran it, its index there)
    leftovers: list
    token_stat: np.ndarray
    token_hist: np.ndarray
    end_ms: np.ndarray
    kernel_calls: int


def _run_units_resized(units: Sequence[Simulation], pass_log_rows: int, record_passes: bool,
                       sim_names: list[int], record_handoffs: bool,
                       event_rows: int = 0, log_outputs: bool = False, progress=None,
                       log_kv: bool = True, spill_passes: bool = False) -> _UnitResults:
    """``_run_units``, then the units that outgrew their block arena estimate or their
    queue sizing rerun alone with room for everything; their results replace the
    failed ones. A unit with a fixed ``queue_slots`` that overflowed keeps the
    ``capacity`` status."""
    res = _run_units(units, pass_log_rows, record_passes, sim_names, record_handoffs, event_rows,
                     log_outputs, progress, log_kv, spill_passes)
    redo: list[int] = []
    more_event_rows = False
    fixed: list[Simulation] = []
    for u, (unit, status) in enumerate(zip(units, res.status)):
        if status == "arena_full":
            fixed.append(dataclasses.replace(unit, arena_blocks=max(
                unit.rank.num_gpu_blocks, unit.prefill_rank.num_gpu_blocks if unit.disaggregated else 0)))
        elif status == STATUS_CAPACITY and unit.queue_slots is None:
            fixed.append(dataclasses.replace(unit, queue_slots=len(unit.workload.input_len) + 1))
        elif status == "events_full":
            fixed.append(unit)
            more_event_rows = True
        else:
            continue
        redo.append(u)
    if not redo:
        return res
    # a rerun can need more room still (an arena, then more events): resize again
    again = _run_units_resized(fixed, pass_log_rows, record_passes, [sim_names[u] for u in redo],
                               record_handoffs, 4 * event_rows if more_event_rows else event_rows,
                               log_outputs, progress, log_kv, spill_passes)
    where = {u: i for i, u in enumerate(redo)}
    for u, i in where.items():
        res.status[u] = again.status[i] if again.status[i] != "arena_full" else STATUS_CAPACITY
        res.error[u] = again.error[i]
        res.token_stat[u] = again.token_stat[i]
        res.token_hist[u] = again.token_hist[i]
        res.end_ms[u] = again.end_ms[i]
        res.leftovers[u] = again.leftovers[i]
        res.sources[u] = again.sources[i]

    def pick(first, second):
        return _LazyFrames(len(units), lambda u: second[where[u]] if u in where else first[u])

    return dataclasses.replace(
        res, requests=pick(res.requests, again.requests), passes=pick(res.passes, again.passes),
        handoffs=pick(res.handoffs, again.handoffs), kv_events=pick(res.kv_events, again.kv_events),
        engine_events=pick(res.engine_events, again.engine_events),
        pressure_events=pick(res.pressure_events, again.pressure_events),
        output_events=pick(res.output_events, again.output_events),
        routing=pick(res.routing, again.routing),
        kernel_calls=res.kernel_calls + again.kernel_calls)


def _run_units(sims: Sequence[Simulation], pass_log_rows: int, record_passes: bool,
               sim_names: list[int], record_handoffs: bool = False,
               event_rows: int = 0, log_outputs: bool = False, progress=None,
               log_kv: bool = True, spill_passes: bool = False) -> _UnitResults:
    """Run independent units in one batch, each until it ends (done or failed)."""
    if not sims:
        with _small_pages():
            stat, hist = sketch.token_stats_new(0)
        return _UnitResults([], [], [], [], [], [], [], [], [], [], [], [], stat, hist, np.zeros(0), 0)
    run = BatchRun(sims, pass_log_rows, record_passes, record_handoffs, event_rows, log_outputs,
                   sim_names=sim_names, log_kv=log_kv, spill_passes=spill_passes)
    if progress is None:
        run.advance()
    else:
        run.advance_in_slices(progress)
    n = len(sims)
    status = [STATUS_OK if x == "done" else x for x in run.status]
    st = run.state.st
    return _UnitResults(status, list(run.error), _LazyFrames(n, run.requests),
                        _LazyFrames(n, run.passes), _LazyFrames(n, run.handoffs),
                        _LazyFrames(n, run.kv_events), _LazyFrames(n, run.engine_events),
                        _LazyFrames(n, run.pressure_events),
                        _LazyFrames(n, run.output_events), _LazyFrames(n, run.routing),
                        [(run, s) for s in range(n)],
                        [run.leftovers(s) for s in range(n)], st.token_stat[:n], st.token_hist[:n],
                        st.now_ms.copy(), run.kernel_calls)


_RUNNABLE = (L.SIM_RUNNING, L.SIM_PAUSED, L.SIM_NEED_FLUSH)


class BatchRun:
    """A batch held in kernel state between calls.

    ``advance(horizon_ms)`` takes every live simulation through every instant up to
    the horizon (inf: until it ends) and returns the statuses; ``add_requests(s,
    workload)`` gives a simulation more requests between steps (the state grows by
    reallocation, ``aisim_fast.engine.grow``); ``requests(s)``, ``passes(s)``,
    ``kv_events(s)``, ... read the tables so far. ``run_batch`` is one of these
    advanced to infinity, for every unit of its batch.

    ``status[s]`` is the kernel's word for where simulation s stands: ``running``
    (not advanced yet), ``paused`` (at a horizon), ``done``, or a failure (``dead_end``,
    ``capacity``, ``arena_full``, ``events_full``) with ``error[s]`` saying why.

    ``growable=True`` sizes every simulation for requests not known yet: its block
    arenas are its whole KV pools (an estimate from the known requests could be
    outgrown) and its queues hold every request it has, growing with it (unless
    ``queue_slots`` fixes them). ``add_requests`` needs it.
    """

    def __init__(self, sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
                 record_passes: bool = True, record_handoffs: bool = False, event_rows: int = 0,
                 log_outputs: bool = False, growable: bool = False, sim_names=None, log_kv: bool = True,
                 spill_passes: bool = False, kernel_parts=None, features=None):
        self.growable = growable
        self._workload_buffers: dict = {}  # simulation -> growing_arrays buffers of its workload
        self._fixed_queues = [sim.queue_slots is not None for sim in sims]
        if growable:
            sims = [dataclasses.replace(
                sim, arena_blocks=sim.arena_blocks if sim.arena_blocks is not None else max(
                    sim.rank.num_gpu_blocks, sim.prefill_rank.num_gpu_blocks if sim.disaggregated else 0),
                queue_slots=sim.queue_slots if sim.queue_slots is not None else sim.workload.num_requests + 1)
                for sim in sims]
        checked: dict = {}  # a sweep's units share a few configs: check each once
        for sim in sims:
            key = tuple(id(getattr(sim, f.name)) for f in dataclasses.fields(sim) if f.name != "workload")
            if key not in checked:
                check_simulation(sim, allow_empty=True)
                checked[key] = True
        self.sims = list(sims)
        self.sim_names = list(range(len(sims))) if sim_names is None else list(sim_names)
        self.event_rows = event_rows
        # before build_state, whose prompt hashing compiles too (``kernel_parts``: the
        # kernel sets the caller will run instead of the event loop's; those are
        # announced by ``replay_batch``, which knows the batch's features)
        compile_notice(list(kernel_parts or []) + (["events"] if event_rows else []))
        # the pass log is a buffer the driver drains whenever it fills: a batch of many
        # simulations (or worker units) shares one budget instead of 64k rows each
        rows = min(pass_log_rows, max(MIN_PASS_LOG_ROWS, PASS_LOG_BUDGET_ROWS // max(1, len(sims))))
        self.state = KernelState(*build_state(self.sims, rows if record_passes else 0,
                                              record_handoffs, event_rows, log_outputs, log_kv,
                                              independent_workers=not growable, features=features))
        self._stats_merged: set[int] = set()  # independent simulations merged (_merge_worker_stats)
        if event_rows:
            _compile_event_kernels(self.state)
        # a simulation's time cap ends it at its last instant at or before the cap
        self._cap_ms = np.array([np.inf if sim.max_sim_time_ms is None else float(sim.max_sim_time_ms)
                                 for sim in self.sims])
        st = self.state.st
        for s, sim in enumerate(self.sims):
            if sim.token_stats_excluded is not None and len(sim.token_stats_excluded):
                rows = np.asarray(sim.token_stats_excluded, np.int64)
                self.state.rq.i64[st.i64[s, L.SM_Q_OFF] + rows, L.RQ_NO_TOKEN_STATS] = 1
                if st.i64[s, L.SM_PREFILL_Q_OFF] >= 0:
                    self.state.rq.i64[st.i64[s, L.SM_PREFILL_Q_OFF] + rows, L.RQ_NO_TOKEN_STATS] = 1
        self._pass_chunks: list[list[np.ndarray]] = [[] for _ in sims]
        # spill_passes: drained pass-log rows go to an unnamed temporary file (removed
        # with it) instead of memory, indexed by (byte offset, rows) per simulation: a
        # million-request run drains gigabytes of them
        self._spill = tempfile.TemporaryFile() if spill_passes else None
        self._spill_index: list[list[tuple[int, int]]] = [[] for _ in sims]
        self._event_chunks: list[list[np.ndarray]] = [[] for _ in sims]
        self._advanced = np.zeros(len(sims), bool)
        self.kernel_calls = 0

    # -- stepping ------------------------------------------------------------------
    def advance(self, horizon_ms: float = np.inf) -> list[str]:
        """Advance every live simulation through every instant up to ``horizon_ms``."""
        st = self.state.st
        live = np.flatnonzero(np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE))
        self._advanced[live] = True
        # a capped simulation stops at its cap: one kernel call per distinct stop (a
        # batch's simulations share the horizon, and almost always their cap)
        stop_ms = np.minimum(float(horizon_ms), self._cap_ms[live])
        for stop in np.unique(stop_ms):
            ids = live[stop_ms == stop]
            while len(ids):
                s_ = self.state
                replay_batch(s_.cfg, s_.pool, s_.rq, s_.wl, s_.wk, s_.st, ids, s_.max_lease, s_.max_bs,
                             stop)
                self.kernel_calls += 1
                self._drain()
                ids = ids[st.i64[ids, L.SM_STATUS] == L.SIM_NEED_FLUSH]
        # every instant up to its cap drained: the simulation has ended
        ended = live[(self._cap_ms[live] <= horizon_ms) & (st.i64[live, L.SM_STATUS] == L.SIM_PAUSED)]
        st.i64[ended, L.SM_STATUS] = L.SIM_DONE
        self._merge_worker_stats()
        return self.status

    def _merge_worker_stats(self) -> None:
        """An independent simulation (``build_state``) that has ended gets its workers'
        token-gap rows merged into its own, once: Chan's merge of the moments in worker
        order, as the round-robin split's units are merged, so the result does not
        depend on how its calls were sliced."""
        st, wk = self.state.st, self.state.wk
        for s in np.flatnonzero(st.i64[:, L.SM_INDEPENDENT]):
            if s in self._stats_merged or np.isin(st.i64[s, L.SM_STATUS], _RUNNABLE):
                continue
            self._stats_merged.add(s)
            w0 = st.i64[s, L.SM_W_OFF]
            rows = wk.i64[w0:w0 + st.i64[s, L.SM_W_LEN], L.WK_STAT_ROW]
            st.token_stat[s] = sketch_merge_rows(st.token_stat[rows])
            sketch.add_hist_rows(st.token_hist, np.full(len(rows), s, np.int64), st.token_stat[rows],
                                 st.token_hist[rows])

    def advance_in_slices(self, progress, slice_s: float | None = None) -> list[str]:
        """``advance()`` in virtual-time slices sized to take about ``slice_s`` wall
        seconds each (``PROGRESS_SLICE_S``), calling ``progress(sim_ms, done, total)``
        after each: the same end state as one call (stepping is exact)."""
        slice_s = PROGRESS_SLICE_S if slice_s is None else slice_s
        st = self.state.st
        step_ms = 1000.0
        horizon_ms = 0.0
        while True:
            live = np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE)
            if not live.any():
                return self.status
            horizon_ms = max(horizon_ms, float(st.now_ms[live].min())) + step_ms
            start_s = time.perf_counter()
            self.advance(horizon_ms)
            took_s = time.perf_counter() - start_s
            live = np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE)
            sim_ms = float(st.now_ms[live].min()) if live.any() else float(st.now_ms.max(initial=0.0))
            progress(sim_ms, int(st.i64[:, L.SM_NUM_TERMINAL].sum()), int(st.i64[:, L.SM_Q_LEN].sum()))
            # next slice: scaled toward the wall-time target, at most 4x either way, and at
            # least a virtual millisecond so that every call moves the clock
            step_ms = max(1.0, step_ms * min(4.0, max(0.25, slice_s / max(took_s, 1e-6))))

    def _drain(self) -> None:
        """Move the pass logs and engine event logs out of the kernel state. A request
        in an event is kept as its simulation's logical row (the one ``requests(s)``
        numbers): kernel rows move when the batch grows."""
        st, pool = self.state.st, self.state.pool
        log_len = st.i64[:, L.SM_PASS_LOG_LEN]
        for s in np.flatnonzero(log_len):
            if self._spill is None:
                self._pass_chunks[s].append(st.pass_log[s, :log_len[s]].copy())
            else:
                self._spill.seek(0, os.SEEK_END)
                self._spill_index[s].append((self._spill.tell(), int(log_len[s])))
                self._spill.write(np.ascontiguousarray(st.pass_log[s, :log_len[s]]).tobytes())
            log_len[s] = 0
        if not self.event_rows:
            return
        event_len = pool.event_log[:, 0, L.EVH_LEN]
        for s in np.flatnonzero((event_len > 0) & (event_len <= self.event_rows)):
            self._event_chunks[s].append(drained_event_rows(self.state, s, event_len[s]))
            event_len[s] = 0

    def add_requests(self, s: int, workload: Workload) -> None:
        """Give simulation ``s`` the requests of ``workload`` (whole sessions; hash ids
        in the id space of its trace, e.g. ``workload.select_rows`` of the same file).
        Open loop: each session starts at its ``start_ms``, which must lie after the
        simulation's clock once it has been advanced. Closed loop: the new sessions
        queue behind the old ones for a concurrency slot. A finished simulation
        becomes live again."""
        self.add_requests_many([(s, workload)])

    def add_requests_many(self, items) -> None:
        """``add_requests`` for several simulations in one growth of the state (each
        simulation at most once in ``items``, a list of (s, workload)): every check
        passes before anything changes."""
        if not self.growable:
            raise ValueError("add_requests needs a BatchRun made with growable=True")
        plans = []
        for s, workload in items:
            sim = self.sims[s]
            if sim.placement == "kv_router":
                raise ValueError("add_requests does not grow a kv_router simulation yet (its router "
                                 "state is sized for the trace it started with)")
            code = int(self.state.st.i64[s, L.SM_STATUS])
            if code not in (L.SIM_RUNNING, L.SIM_PAUSED, L.SIM_DONE):
                raise SimulationError(f"simulation {self.sim_names[s]} is {L.SIM_STATUS_NAMES[code]}: "
                                      "it takes no more requests")
            if workload.num_requests == 0:
                continue
            # checks the trace block size; the simulation's token arrays grow in place
            merged = concat_workloads(sim.workload, workload, self._workload_buffers.setdefault(s, {}))
            now_ms = float(self.state.st.now_ms[s])
            if sim.concurrency == 0 and self._advanced[s]:
                starts = workload.start_ms[workload.order]
                if starts[0] <= now_ms:
                    raise ValueError(
                        f"simulation {self.sim_names[s]}: an added request starts at t={starts[0]:.6f} ms, "
                        f"not after the simulation's clock t={now_ms:.6f} ms")
            plans.append((s, workload, merged, code))
        if len({s for s, *_ in plans}) != len(plans):
            raise ValueError("add_requests_many: a simulation appears twice")
        state = self.state
        rows = []
        for s, workload, merged, code in plans:
            sim = self.sims[s]
            sizes = [_table_key(workload, r)[1]
                     for r in [sim.rank] + ([sim.prefill_rank] if sim.disaggregated else [])]
            table_rows = append_workload_rows(state, workload, sizes)
            tpl = _sim_template(dataclasses.replace(sim, workload=workload), table_rows, {})
            # the new sessions follow the old ones (release ties go by session)
            n_sessions = int(sim.workload.session.max(initial=-1)) + 1
            tpl = dataclasses.replace(
                tpl, rq_i=tpl.rq_i.shifted(L.RQ_SESSION, n_sessions),
                prefill_rq_i=None if tpl.prefill_rq_i is None
                else tpl.prefill_rq_i.shifted(L.RQ_SESSION, n_sessions))
            n_total = merged.num_requests
            grow = not self._fixed_queues[s]
            rows.append((s, tpl, n_total + 1 if grow else None, n_total + 1 if grow else None))
            self.sims[s] = dataclasses.replace(sim, workload=merged,
                                               queue_slots=n_total + 1 if grow else sim.queue_slots)
        if rows:
            add_rows_many(state, rows)
        for s, _, _, code in plans:
            if code == L.SIM_DONE:
                state.st.i64[s, L.SM_STATUS] = L.SIM_PAUSED

    # -- where each simulation stands ------------------------------------------------
    @property
    def status(self) -> list[str]:
        return [L.SIM_STATUS_NAMES[c] for c in self.state.st.i64[:, L.SM_STATUS]]

    @property
    def error(self) -> list[str]:
        return [self._error(s) for s in range(len(self.sims))]

    def _error(self, s: int) -> str:
        st = self.state.st
        code = int(st.i64[s, L.SM_STATUS])
        name = self.sim_names[s]
        if code == L.SIM_DEAD_END:
            in_flight = int(st.i64[s, L.SM_NUM_ARRIVED] - st.i64[s, L.SM_NUM_TERMINAL]
                            + st.i64[s, L.SM_NUM_NOT_SENT])
            if st.i64[s, L.SM_DEAD_IN_FLIGHT] >= 0:  # the reference counts one worker's
                in_flight = int(st.i64[s, L.SM_DEAD_IN_FLIGHT])
            return (f"simulation {name}: dead end at t={st.now_ms[s]:.6f} ms, an effect-free "
                    f"zero-duration pass with {in_flight} in-flight requests remaining, as the "
                    "reference reports it: they can never be scheduled (a request outgrows its KV "
                    "pool, or a preempted decode request blocks activated ones)")
        if code == L.SIM_ARENA_FULL:
            return f"simulation {name}: the block arena of a worker is full"
        if code == L.SIM_EVENTS_FULL:
            return f"simulation {name}: more engine events in one instant than {self.event_rows} log rows"
        if code == L.SIM_CAPACITY:
            sim = self.sims[s]
            return (f"simulation {name}: a worker's queue overflowed its {sim.queue_slots} slots at "
                    f"t={st.now_ms[s]:.6f} ms (placement {sim.placement}); raise queue_slots "
                    "or leave it unset to size the queues from the trace")
        return ""

    def offsets(self, s: int) -> tuple[int, int]:
        """The first kernel row and first worker of simulation s (they move as it grows)."""
        st = self.state.st
        return int(st.i64[s, L.SM_Q_OFF]), int(st.i64[s, L.SM_W_OFF])

    def now_ms(self, s: int) -> float:
        """The simulation's clock: the last instant it drained."""
        return float(self.state.st.now_ms[s])

    # -- tables so far ---------------------------------------------------------------
    def requests(self, s: int) -> pd.DataFrame:
        st = self.state.st
        return _request_frame(self.sims[s], self.state.rq, int(st.i64[s, L.SM_Q_OFF]),
                              int(st.i64[s, L.SM_W_OFF]))

    def passes(self, s: int) -> pd.DataFrame:
        return _pass_frame(list(self.pass_chunks(s)))

    def pass_chunks(self, s: int) -> Iterator[np.ndarray]:
        """Simulation s's drained pass-log rows (raw PL_* columns), in drain order (read
        back one by one when they were spilled)."""
        for chunk in self._raw_pass_chunks(s):
            if _any_attention_dp(self.sims[s]):
                # the kernel logs a pass under its rank: name the rank's worker and number
                chunk = chunk.copy()
                chunk[:, L.PL_WORKER], chunk[:, L.PL_DP_RANK] = _worker_and_rank(
                    self.sims[s], chunk[:, L.PL_WORKER].astype(np.int64))
            yield chunk

    def _raw_pass_chunks(self, s: int) -> Iterator[np.ndarray]:
        if self._spill is None:
            yield from self._pass_chunks[s]
            return
        dtype = self.state.st.pass_log.dtype
        width = self.state.st.pass_log.shape[2]
        for offset, rows in self._spill_index[s]:
            self._spill.seek(offset)
            data = self._spill.read(rows * width * dtype.itemsize)
            yield np.frombuffer(data, dtype).reshape(rows, width)

    def handoffs(self, s: int) -> pd.DataFrame:
        st = self.state.st
        return _handoff_frame(self.sims[s], st.hlog[s, :st.i64[s, L.SM_HLOG_LEN]])

    def routing(self, s: int) -> pd.DataFrame:
        """The kv_router decisions of simulation s so far, in decision order."""
        st = self.state.st
        n = int(st.i64[s, L.SM_RT_LOG_LEN])
        return _routing_frame(self.sims[s], st.rt_log[s, :n] if n else np.zeros((0, L.RL_NUM_COLUMNS)),
                              st.rt_costs[s, :n] if n else np.zeros((0, 0)))

    def kv_events(self, s: int) -> pd.DataFrame:
        return _kv_event_frame(self.sims[s], _event_rows(self._event_chunks[s]),
                               int(self.state.st.i64[s, L.SM_W_OFF]))

    def engine_events(self, s: int) -> pd.DataFrame:
        return _engine_event_frame(self.sims[s], _event_rows(self._event_chunks[s]),
                                   int(self.state.st.i64[s, L.SM_W_OFF]))

    def pressure_events(self, s: int) -> pd.DataFrame:
        return _pressure_event_frame(self.sims[s], _event_rows(self._event_chunks[s]),
                                     int(self.state.st.i64[s, L.SM_W_OFF]))

    def output_events(self, s: int) -> pd.DataFrame:
        return _output_event_frame(self.sims[s], _event_rows(self._event_chunks[s]),
                                   int(self.state.st.i64[s, L.SM_W_OFF]))

    def leftovers(self, s: int) -> dict:
        return _leftovers(self.state.pool, self.state.wk, self.state.st, s)


def _compile_event_kernels(state: KernelState) -> None:
    """Compile (or load) the kernels that turn event logs into tables before the run,
    under the cache lock, so that their first compile is announced (kernel set
    "events") rather than a silent pause when the tables are built."""
    uint32_1d = numba.typeof(np.zeros(1, np.uint32))
    int64_1d = numba.typeof(np.zeros(1, np.int64))
    compile_for(kv_tokens_hashes, (numba.typeof(state.cfg), numba.typeof(state.rq), numba.typeof(state.wl),
                                   numba.typeof(np.zeros((1, L.EV_NUM_COLUMNS), np.int64)), uint32_1d))
    compile_for(output_tokens_at, (int64_1d, uint32_1d, int64_1d, int64_1d, uint32_1d))
    mark_compiled("events")


def drained_event_rows(state: KernelState, s: int, n: int) -> np.ndarray:
    """The first ``n`` rows of simulation s's engine event log, copied out as the
    frames read them: a request is its simulation's logical row (the one
    ``requests(s)`` numbers; kernel rows move when the batch grows), and a KV Stored
    row gets its block's tokens-only hash."""
    st, rq = state.st, state.rq
    rows = state.pool.event_log[s, 1:1 + n].copy()
    q_off, n_q = st.i64[s, L.SM_Q_OFF], st.i64[s, L.SM_Q_LEN]

    def logical(q):
        return np.where((q >= q_off) & (q < q_off + n_q), q, rq.i64[q, L.RQ_PEER]) - q_off

    # the kinds whose EV_A is a request row (not the pressure detail rows)
    about_request = (rows[:, L.EV_KIND] >= L.EV_ADMITTED) & (rows[:, L.EV_KIND] <= L.EV_OUTPUT)
    rows[about_request, L.EV_A] = logical(rows[about_request, L.EV_A])
    stored = rows[:, L.EV_KIND] == L.EV_KV_STORED
    if stored.any():
        kv_tokens_hashes(state.cfg, rq, state.wl, rows, np.empty(max(1, state.max_bs), np.uint32))
        rows[stored, L.EV_REQUEST] = logical(rows[stored, L.EV_REQUEST])
    return rows


def _event_rows(chunks: list) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.zeros((0, L.EV_NUM_COLUMNS), np.int64)


def _engine_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
    """One simulation's admissions, preemptions and finishes in the order the engines
    decided them (at pass start): ``request_id`` / ``turn_index`` of the logical
    request (a disaggregated prefill row names its request), ``worker`` as in the pass
    log; ``cached_tokens`` (admitted), ``running_before`` / ``active_blocks_before``
    (preempted), ``terminal_status`` (finished: completed, rejected, or held for a
    prefill source) and ``output_tokens``."""
    kind = rows[:, L.EV_KIND]
    rows = rows[(kind >= L.EV_ADMITTED) & (kind <= L.EV_FINISHED)]
    kind = rows[:, L.EV_KIND]
    logical = rows[:, L.EV_A]  # logical rows of the simulation (BatchRun._drain)
    admitted, preempted, finished = (kind == L.EV_ADMITTED), (kind == L.EV_PREEMPTED), (kind == L.EV_FINISHED)
    status = np.array(("held",) + L.TERMINAL_STATUS_NAMES[1:], dtype=object)[
        np.where(finished, rows[:, L.EV_B], 0)]

    def only(values, mask):  # the value where the kind has it, else <NA>
        out = pd.array(values, dtype="Int64")
        out[~mask] = pd.NA
        return out

    status = status.copy()
    status[~finished] = None
    worker, dp_rank = _worker_and_rank(sim, rows[:, L.EV_WORKER] - w_first)
    frame = pd.DataFrame({
        "worker": worker,
        "time_ms": np.ascontiguousarray(rows[:, L.EV_TIME_BITS]).view(np.float64),
        "kind": np.array(L.EV_KIND_NAMES, dtype=object)[kind],
        "request_id": sim.workload.request_name[logical],
        "turn_index": sim.workload.turn_index[logical].astype(np.int64),
        "cached_tokens": only(rows[:, L.EV_B], admitted),
        "running_before": only(rows[:, L.EV_B], preempted),
        "active_blocks_before": only(rows[:, L.EV_C], preempted),
        "terminal_status": status,
        "output_tokens": only(rows[:, L.EV_C], finished),
    })
    if _any_attention_dp(sim):
        frame.insert(1, "dp_rank", dp_rank)
    return frame


def _worker_and_rank(sim: Simulation, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(worker, attention-DP rank) of kernel workers numbered from the simulation's
    first (a worker's ranks are consecutive; disaggregated: the prefill pool's ranks
    first, its workers numbered before the decode pool's, as without attention DP)."""
    rank = np.asarray(rank)
    if not sim.disaggregated:
        return rank // sim.dp_size, rank % sim.dp_size
    prefill = rank < sim.prefill_ranks
    decode_rank = rank - sim.prefill_ranks
    worker = np.where(prefill, rank // sim.prefill_dp_size, sim.prefill_workers + decode_rank // sim.dp_size)
    dp_rank = np.where(prefill, rank % sim.prefill_dp_size, decode_rank % sim.dp_size)
    return worker, dp_rank


def _any_attention_dp(sim: Simulation) -> bool:
    return max(sim.dp_size, sim.prefill_dp_size) > 1


def _pressure_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
    """One simulation's pressure events (the seed's PressureEvent), in the order the
    engines took them: ``at_ms`` (the pass start), ``kind`` ``vllm_preemption`` /
    ``sglang_retraction``, ``worker`` and ``rank`` (its attention-DP rank), the
    request, the worker's running / waiting requests and active blocks before and
    after, the request's active blocks before, and for SGLang the logically available
    and the required blocks of the decision (null for vLLM; waiting counts null for
    SGLang, whose scheduler exposes none). Built from each event's consecutive
    PREEMPTED, PRESSURE (and PRESSURE_SGLANG) rows."""
    kind = rows[:, L.EV_KIND]
    at = np.flatnonzero(kind == L.EV_PREEMPTED)
    if len(at) and (at[-1] + 1 >= len(rows) or np.any(kind[at + 1] != L.EV_PRESSURE)):
        raise AssertionError("a PREEMPTED event row without its PRESSURE row")
    head, detail = rows[at], rows[at + 1]
    retraction = np.zeros(len(at), bool)
    if len(at):
        nxt = np.minimum(at + 2, len(rows) - 1)
        retraction = (at + 2 < len(rows)) & (kind[nxt] == L.EV_PRESSURE_SGLANG)
    sglang = rows[np.where(retraction, at + 2, at)]
    logical = head[:, L.EV_A]
    running_before = head[:, L.EV_B]
    waiting_before = detail[:, L.EV_C]

    def optional(values, present):
        out = pd.array(values, dtype="Int64")
        out[~present] = pd.NA
        return out

    has_waiting = waiting_before >= 0
    worker, dp_rank = _worker_and_rank(sim, head[:, L.EV_WORKER] - w_first)
    return pd.DataFrame({
        "at_ms": np.ascontiguousarray(head[:, L.EV_TIME_BITS]).view(np.float64),
        "kind": np.where(retraction, "sglang_retraction", "vllm_preemption").astype(object),
        "worker": worker,
        "rank": dp_rank,
        "request_id": sim.workload.request_name[logical],
        "turn_index": sim.workload.turn_index[logical].astype(np.int64),
        "running_before": running_before,
        "running_after": running_before - 1,
        "waiting_before": optional(waiting_before, has_waiting),
        "waiting_after": optional(waiting_before + 1, has_waiting),
        "active_blocks_before": head[:, L.EV_C],
        "active_blocks_after": detail[:, L.EV_B],
        "request_active_blocks_before": detail[:, L.EV_A],
        "logical_available_blocks_before": optional(sglang[:, L.EV_A], retraction),
        "required_blocks_before": optional(sglang[:, L.EV_B], retraction),
    })


def _output_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
    """One simulation's output tokens (``record_outputs``), one row per token, in the
    order each worker emitted them: ``time_ms`` the pass end that emitted it,
    ``token_index`` from 1, ``token_id`` the token (the trace's authored id, else the
    output plan's, as the reference emits), ``last`` its request's final token. A
    disaggregated request's hidden prefill token is a row of its prefill worker."""
    rows = rows[rows[:, L.EV_KIND] == L.EV_OUTPUT]
    logical = rows[:, L.EV_A]
    out_plan, authored = sim.workload.output_plan()
    token_id = np.empty(len(rows), np.uint32)
    output_tokens_at(out_plan, authored, np.ascontiguousarray(logical),
                     np.ascontiguousarray(rows[:, L.EV_B] - 1), token_id)
    worker, dp_rank = _worker_and_rank(sim, rows[:, L.EV_WORKER] - w_first)
    frame = pd.DataFrame({
        "worker": worker,
        "time_ms": np.ascontiguousarray(rows[:, L.EV_TIME_BITS]).view(np.float64),
        "request_id": sim.workload.request_name[logical],
        "turn_index": sim.workload.turn_index[logical].astype(np.int64),
        "token_index": rows[:, L.EV_B],
        "token_id": token_id,
        "last": rows[:, L.EV_C] != 0,
    })
    if _any_attention_dp(sim):
        frame.insert(1, "dp_rank", dp_rank)
    return frame


def _kv_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
    """One simulation's KV events as the reference emits them, one row per block, in
    the order they happened. ``event_id`` numbers a worker's events (rank-local, from
    0); the blocks of one event share it and ``position`` orders them. ``at_ms`` is
    when the event becomes visible (its pass's end). ``parent_hash`` is the event's
    (Stored: the block before its first one; <NA> at block 0 and for Removed) on each
    of its rows; ``tokens_hash`` the block's tokens-only hash (Stored). With the rank's
    ``emit_kv_token_ids``, ``token_ids`` lists each Stored block's tokens."""
    rows = _kv_rows_as_reported(rows)
    rows = rows[rows[:, L.EV_KIND] <= L.EV_KV_REMOVED]
    worker = rows[:, L.EV_WORKER] - w_first
    group = rows[:, L.EV_C]
    first = group != L.KV_NEXT
    # an event's rows follow its first one in its worker's stream (other workers' rows
    # may come between them in the log)
    by_worker = np.argsort(worker, kind="stable")
    index = np.arange(len(rows))
    head_sorted = np.maximum.accumulate(np.where(first[by_worker], index, 0)) if len(rows) else index
    head = np.empty(len(rows), np.int64)
    head[by_worker] = by_worker[head_sorted]
    position = np.empty(len(rows), np.int64)
    position[by_worker] = index - head_sorted
    stored = rows[:, L.EV_KIND] == L.EV_KV_STORED
    parent = pd.array(rows[head, L.EV_B].view(np.uint64), dtype="UInt64")
    parent[group[head] != L.KV_FIRST_WITH_PARENT] = pd.NA
    tokens_hash = pd.array(rows[:, L.EV_TOKENS_HASH].view(np.uint64), dtype="UInt64")
    tokens_hash[~stored] = pd.NA
    event_id = pd.Series(first.astype(np.int64)).groupby(worker).cumsum().to_numpy() - 1
    logical, dp_rank = _worker_and_rank(sim, worker)
    frame = pd.DataFrame({
        "worker": logical,
        "dp_rank": dp_rank,  # event ids count per rank
        "event_id": event_id,
        "at_ms": np.ascontiguousarray(rows[:, L.EV_TIME_BITS]).view(np.float64),
        "kind": np.array(L.EV_KIND_NAMES, dtype=object)[rows[:, L.EV_KIND]],
        "position": position,
        "block_hash": rows[:, L.EV_A].view(np.uint64),
        "parent_hash": parent,
        "tokens_hash": tokens_hash,
    })
    if _kv_token_ids_wanted(sim):
        frame["token_ids"] = _kv_block_tokens(sim, rows, worker, stored)
    return frame


def _kv_rows_as_reported(rows: np.ndarray) -> np.ndarray:
    """KV rows at the time their worker reports them: a worker that reports at some
    passes only (SGLang: ``EV_KV_REPORTED`` rows, ``sglang_radix.report_kv``) gives
    each of its KV rows the time of its next report row; a row no report follows keeps
    the end of the pass that caused it. Other workers' rows are as logged."""
    kind = rows[:, L.EV_KIND]
    reports = np.flatnonzero(kind == L.EV_KV_REPORTED)
    if len(reports) == 0:
        return rows
    rows = rows.copy()
    worker = rows[:, L.EV_WORKER]
    kv = np.flatnonzero(kind <= L.EV_KV_REMOVED)
    for w in np.unique(worker[reports]):
        at = reports[worker[reports] == w]
        mine = kv[worker[kv] == w]
        nxt = np.searchsorted(at, mine)
        reported = nxt < len(at)
        rows[mine[reported], L.EV_TIME_BITS] = rows[at[nxt[reported]], L.EV_TIME_BITS]
    return rows


def _kv_token_ids_wanted(sim: Simulation) -> bool:
    ranks = [sim.rank] + ([sim.prefill_rank] if sim.disaggregated else [])
    return any(r.emit_kv_token_ids for r in ranks)


def _kv_block_tokens(sim: Simulation, rows: np.ndarray, worker: np.ndarray, stored: np.ndarray):
    """The tokens of each Stored row's block (None for Removed rows and for workers
    whose rank does not emit token ids)."""
    n_prefill = sim.prefill_ranks
    out = [None] * len(rows)
    for r in np.flatnonzero(stored):
        rank = sim.prefill_rank if worker[r] < n_prefill else sim.rank
        if rank.emit_kv_token_ids:
            bs = rank.block_size
            out[r] = sequence_tokens(sim.workload, int(rows[r, L.EV_REQUEST]),
                                     int(rows[r, L.EV_BLOCK]) * bs, bs)
    column = np.empty(len(rows), dtype=object)  # uint32 arrays: Parquet list<uint32>
    column[:] = out
    return column


class _LazyFrames(Sequence):
    """Per-simulation tables built on first access: a sweep that reads a few
    summary columns of thousands of points should not pay for every DataFrame."""

    def __init__(self, n: int, build):
        self._built: list = [None] * n
        self._build = build

    def __len__(self) -> int:
        return len(self._built)

    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        if self._built[s] is None:
            self._built[s] = self._build(s)
        return self._built[s]


PASS_PART_ROWS = 1 << 19  # rows of a pass_parts table at least (but the last)


PASS_TIME_COLUMNS = ("start_ms", "end_ms")  # the pass log's float columns; the rest count


def _pass_columns(chunks: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The pass-log rows as contiguous columns: every count column cast in one pass
    over the transposed rows (a strided cast per column costs several times more)."""
    rows = np.concatenate(chunks) if chunks else np.zeros((0, L.PL_NUM_COLUMNS))
    counts = rows.T.astype(np.int64)
    return {col: np.ascontiguousarray(rows[:, i]) if col in PASS_TIME_COLUMNS else counts[i]
            for i, col in enumerate(L.PASS_LOG_COLUMNS)}


def _pass_frame(chunks: list[np.ndarray]) -> pd.DataFrame:
    return pd.DataFrame(_pass_columns(chunks))


def _pass_table(chunks: list[np.ndarray]):
    """The pass-log rows as an Arrow table (the columns are not copied again)."""
    import pyarrow as pa
    return pa.table(_pass_columns(chunks))


def _handoff_log_rows(sims: Sequence[Simulation]) -> int:
    """Journal rows per simulation: six lifecycle events per disaggregated request."""
    return max([len(sim.workload.input_len) * len(L.HANDOFF_EVENT_NAMES)
                for sim in sims if sim.disaggregated], default=0)


def _handoff_frame(sim: Simulation, rows: np.ndarray) -> pd.DataFrame:
    """The handoff journal of one simulation, in event order. ``blocks``: fresh blocks
    reserved (DestinationReserved) or prompt blocks published on the decode rank
    (DestinationActivated); ``blocks_visible_before``: fresh prompt blocks whose hash
    the decode rank already showed before the activation."""
    q = rows[:, L.HL_REQUEST].astype(np.int64)
    return pd.DataFrame({
        "event": np.array(L.HANDOFF_EVENT_NAMES, dtype=object)[rows[:, L.HL_EVENT].astype(np.int64)],
        "request_id": sim.workload.request_name[q],
        "turn_index": sim.workload.turn_index[q].astype(np.int64),
        "time_ms": rows[:, L.HL_TIME_MS],
        "blocks": rows[:, L.HL_VALUE_A].astype(np.int64),
        "blocks_visible_before": rows[:, L.HL_VALUE_B].astype(np.int64),
    })


def _leftovers(pool: L.Pool, wk: L.Workers, st: L.Sims, s: int) -> dict:
    """State a finished simulation still holds: per worker (prefill pool first) the
    blocks counted active (referenced, pinned or reserved), queued requests and
    pending destinations, plus the driver's open handoffs, queued actions and
    transfers in flight. All zero when the run drained."""
    ws = slice(int(st.i64[s, L.SM_W_OFF]), int(st.i64[s, L.SM_W_OFF] + st.i64[s, L.SM_W_LEN]))
    pw = pool.w64[ws]
    wi = wk.i64[ws]
    active = pw[:, L.PW_NUM_COPIES] - pw[:, L.PW_LRU_LEN] + pw[:, L.PW_NUM_RESERVED]
    if pool.radix.w64.shape[0] > ws.start:
        # an SGLang worker's are the pages of its radix tree that some lease locks
        rw = pool.radix.w64[ws]
        active = active + rw[:, L.RW_PROTECTED] // np.maximum(rw[:, L.RW_PAGE_SIZE], 1)
    return {
        "active_blocks": active,
        "queued_requests": wi[:, L.WK_RUN_LEN] + wi[:, L.WK_WAIT_LEN] + wi[:, L.WK_SG_READY_LEN],
        "pending_destinations": wi[:, L.WK_PEND_LEN].copy(),
        "open_handoffs": int(st.i64[s, L.SM_OPEN_HANDOFFS]),
        "queued_actions": int(st.i64[s, L.SM_ACTQ_LEN]),
        "transfers_in_flight": int(st.i64[s, L.SM_XFER_LEN]),
    }


def _merge_leftovers(parts: list[dict]) -> dict:
    """Leftovers of a simulation run as per-worker units, workers in order."""
    return {key: (np.concatenate([p[key] for p in parts]) if isinstance(parts[0][key], np.ndarray)
                  else sum(p[key] for p in parts)) for key in parts[0]}


def warm_kernels(topologies=("aggregated", "disaggregated", "sglang", "sglang_disaggregated")) -> dict:
    """Compile (or load from the cache) the kernel sets given (kernels.COMPILE_PARTS): a
    tiny batch of the bundled trace with every backend of the set ("rank": the rank
    protocol's kernels). Returns seconds per set."""
    from aisim_fast.config.payload import SIMULATED_BACKENDS, parse_rank
    from aisim_fast.trace.workload import default_trace_path

    compile_notice(["trace"] + (["rank"] if "rank" in topologies else []))  # replay_batch: the rest
    workload = load_mooncake(default_trace_path(), max_rows=8)
    seconds = {}
    for topology in topologies:
        start_s = time.perf_counter()
        if topology == "rank":  # the rank protocol's kernels (aisim_fast.protocol.rank)
            from aisim_fast.protocol.rank import _kernels
            _kernels()
            seconds[topology] = time.perf_counter() - start_s
            continue
        for backend in SIMULATED_BACKENDS:
            if (backend == "sglang") != topology.startswith("sglang"):
                continue  # SGLang runs in loops of its own
            # an SGLang pool counts tokens: the default 16384 holds fewer than some
            # prompts of the trace (which would never be admitted)
            extra = {"num_gpu_blocks": 1 << 20} if backend == "sglang" else {}
            # one batch per backend: TRT-LLM's policy is an optional feature (its own
            # kernel set), and a plain vLLM run must find the plain set warm
            if topology in ("aggregated", "sglang"):
                sim = Simulation(workload, parse_rank({"backend": backend, **extra}), workers=2)
            else:
                sim = Simulation(
                    workload, parse_rank({"backend": backend, "worker_type": "decode", **extra}), workers=1,
                    prefill_rank=parse_rank({"backend": backend, "worker_type": "prefill", **extra}),
                    prefill_workers=1)
            run_batch([sim], record_passes=True).check()
        seconds[topology] = time.perf_counter() - start_s
    return seconds
