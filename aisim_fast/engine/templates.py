"""Per-simulation templates of the kernel state: each pool's worker rows and the workload rows,
built once per (trace, rank config) and copied into a batch's arrays."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from aisim_fast.config.payload import RankConfig
from aisim_fast.engine.lowering import rank_config_rows
from aisim_fast.engine.output_budget import output_budget
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.schema import layout as L
from aisim_fast.trace.workload import Workload


def pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


def _effective_max_output(sim: Simulation) -> np.ndarray:
    return output_budget(sim.rank, sim.workload.input_len, sim.workload.output_len)


def next_turns(wl: Workload) -> np.ndarray:
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
        out[:] = fresh_row(self.table)
        for col, values in self.columns.items():
            out[:, col] = values
        if lease_off:
            out[:, L.RQ_LEASE_OFF] += lease_off

    def shifted(self, col: int, by: int) -> "_Rows":
        return _Rows(self.table, self.n, {**self.columns, col: self.columns[col] + by})


@functools.lru_cache(maxsize=None)
def fresh_row(table) -> np.ndarray:
    return table.new(1)[0]


@dataclass(frozen=True)
class SimTemplate:
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
SIM_SETTINGS = tuple(f for f in dataclasses.fields(Simulation)
                      if f.name not in ("workload", "max_sim_time_ms", "token_stats_excluded"))


def table_key(wl: Workload, rank: RankConfig) -> tuple[int, int]:
    """The workload table of a pool: its prompt block hashes at the pool's block size.
    An SGLang pool keys its radix tree by page contents computed in the kernel, so it
    needs no hashes (block size 0: no table rows)."""
    return (id(wl), 0 if rank.backend == "sglang" else rank.block_size)


def sim_template(sim: Simulation, table_rows: dict, distinct_prompt_blocks: dict,
                  memo: dict | None = None) -> SimTemplate:
    """``memo``: a dict the caller keeps for one build; simulations of one workload
    (a sweep's points, a worker's shard under many configs) share what depends only
    on it, and equal pools their config rows."""
    memo = {} if memo is None else memo
    wl, rank = sim.workload, sim.rank
    n = len(wl.input_len)
    bs = rank.block_size
    out = _effective_max_output(sim)
    # the output budget depends on the rank only where it is clamped (TRT-LLM, SGLang)
    rows_key = ("rows", id(wl), table_rows[table_key(wl, rank)], bs, rank.backend,
                rank.num_gpu_blocks if rank.backend == "trtllm" else 0,
                rank.max_model_len if rank.backend == "sglang" else 0)
    if rows_key not in memo:
        blocks = -(-(wl.input_len + out) // bs)
        memo[rows_key] = (blocks, _unplaced_rows(wl, table_rows[table_key(wl, rank)], out, blocks),
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
        prefill_rq_i = _unplaced_rows(wl, table_rows[table_key(wl, prank)], 1, pblocks)
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
            rank_config_rows(cfg_i, cfg_f, slice(0, 1), pool_rank, sim.handoff_latency_ms, pool_dp)
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
        memo[turns_key] = next_turns(wl)
    return SimTemplate(rq_i=rq_i, rq_f=rq_f, lease_entries=int(blocks.sum()),
                        prefill_rq_i=prefill_rq_i, prefill_lease_entries=int(pblocks.sum()),
                        max_lease_blocks=int(max(blocks.max(initial=1), pblocks.max(initial=1))),
                        next_turn=memo[turns_key], firsts=firsts, pools=tuple(pool_templates))


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
