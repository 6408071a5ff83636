"""Batch replay driver: lowers simulations (trace + rank config + topology) into the
kernels' structure-of-arrays state, advances the whole batch in compiled code, and
turns the state back into per-request and per-pass tables.

One ``run_batch`` call = one kernel call per flush of the pass log (usually one):
every simulation runs its complete event loop inside ``kernels.replay_loop``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from aisim_fast.config import RankConfig, ReplaySetup
from aisim_fast.kernels import layout as L
from aisim_fast.kernels import sketch
from aisim_fast.kernels.block_pool import pool_reset
from aisim_fast.kernels.prompt_blocks import count_prompt_blocks, hash_prompt_blocks
from aisim_fast.kernels.replay_loop import replay_batch
from aisim_fast.workload import Workload, load_mooncake

DEFAULT_PASS_LOG_ROWS = 65536


class SimulationError(RuntimeError):
    """A simulation that cannot finish (the reference aborts on the same condition)."""


@dataclass(frozen=True)
class Simulation:
    """One point of a batch: a loaded trace, the rank config and the topology."""
    workload: Workload
    rank: RankConfig
    workers: int
    concurrency: int = 0  # closed-loop session cap; 0 = open loop by timestamps
    arena_blocks: int | None = None  # per-worker block arena; None = sized from the workload


@dataclass
class BatchResult:
    requests: list[pd.DataFrame]       # one frame per simulation, one row per request
    passes: list[pd.DataFrame]         # one frame per simulation, one row per forward pass
    token_stat: np.ndarray             # float64[s, TOKEN_STAT_WIDTH]
    token_hist: np.ndarray             # int64[s, TOKEN_HIST_WIDTH]
    kernel_calls: int


def simulation_from_setup(setup: ReplaySetup, workload: Workload | None = None) -> Simulation:
    if workload is None:
        workload = load_mooncake(setup.trace_path, trace_block_size=setup.trace_block_size,
                                 arrival_speedup_ratio=setup.arrival_speedup_ratio)
    return Simulation(workload, setup.rank, setup.workers, setup.concurrency)


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


def _effective_max_output(sim: Simulation) -> np.ndarray:
    """TRT-LLM clamps the output budget to the pool when the prompt fits in it."""
    wl, rank = sim.workload, sim.rank
    out = wl.output_len.astype(np.int64)
    if rank.backend == "trtllm":
        pool_tokens = rank.num_gpu_blocks * rank.block_size
        fits = wl.input_len < pool_tokens
        out = np.where(fits, np.minimum(out, pool_tokens - wl.input_len), out)
    return out


def _next_turns(wl: Workload) -> np.ndarray:
    nxt = np.full(len(wl.input_len), -1, np.int64)
    last_of_session: dict[int, int] = {}
    for q, sess in enumerate(wl.session.tolist()):
        prev = last_of_session.get(sess)
        if prev is not None:
            nxt[prev] = q
        last_of_session[sess] = q
    return nxt


def build_state(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS):
    """Allocate and initialise the kernel state of a batch."""
    n_sims = len(sims)
    # workload tables: one block of rows per distinct (trace, engine block size)
    table_rows: dict[tuple[int, int], int] = {}
    tables = []
    n_rows = 0
    for sim in sims:
        key = (id(sim.workload), sim.rank.block_size)
        if key not in table_rows:
            table_rows[key] = n_rows
            tables.append((sim.workload, sim.rank.block_size))
            n_rows += len(sim.workload.input_len)
    hash_indptr_parts, hash_id_parts, tbs_parts, phash_indptr_parts, phash_parts = [], [], [], [], []
    hash_base = 0
    phash_base = 0
    for wl, bs in tables:
        indptr = count_prompt_blocks(wl.input_len.astype(np.int64), bs)
        phash = np.empty(indptr[-1], np.uint64)
        hash_prompt_blocks(wl.hash_indptr, wl.hash_ids, wl.input_len.astype(np.int64),
                           wl.trace_block_size, bs, indptr, phash)
        hash_indptr_parts.append(wl.hash_indptr[:-1] + hash_base)
        hash_id_parts.append(wl.hash_ids)
        tbs_parts.append(np.full(len(wl.input_len), wl.trace_block_size, np.int64))
        phash_indptr_parts.append(indptr[:-1] + phash_base)
        phash_parts.append(phash)
        hash_base += len(wl.hash_ids)
        phash_base += len(phash)
    workload = L.Workload(
        hash_indptr=np.concatenate(hash_indptr_parts + [np.array([hash_base], np.int64)]),
        hash_ids=np.concatenate(hash_id_parts),
        trace_block_size=np.concatenate(tbs_parts),
        phash_indptr=np.concatenate(phash_indptr_parts + [np.array([phash_base], np.int64)]),
        phash=np.concatenate(phash_parts),
    )

    q_len = np.array([len(s.workload.input_len) for s in sims], np.int64)
    q_off = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int64)
    w_len = np.array([s.workers for s in sims], np.int64)
    w_off = np.concatenate([[0], np.cumsum(w_len)[:-1]]).astype(np.int64)
    n_q = int(q_len.sum())
    n_w = int(w_len.sum())

    # per-request static arrays
    prompt_len = np.empty(n_q, np.int64)
    max_output = np.empty(n_q, np.int64)
    src_row = np.empty(n_q, np.int64)
    session = np.empty(n_q, np.int64)
    turn = np.empty(n_q, np.int64)
    next_turn = np.empty(n_q, np.int64)
    delay_ms = np.empty(n_q, np.float64)
    start_ms = np.full(n_q, np.nan)
    start_order = np.zeros(n_q, np.int64)
    num_starts = np.zeros(n_sims, np.int64)
    lease_blocks = np.empty(n_q, np.int64)
    # per-worker sizes
    arena = np.empty(n_w, np.int64)
    run_cap = np.empty(n_w, np.int64)
    wait_cap = np.empty(n_w, np.int64)
    cfg_cols = {name: np.empty(n_w, dt) for name, dt in (
        ("num_gpu_blocks", np.int64), ("block_size", np.int64), ("max_num_seqs", np.int64),
        ("max_num_batched_tokens", np.int64), ("max_model_len", np.int64),
        ("enable_prefix_caching", np.bool_), ("enable_chunked_prefill", np.bool_),
        ("preemption_fifo", np.bool_), ("policy", np.int8), ("role", np.int8),
        ("timing", np.int8), ("fixed_prefill_ms", np.float64), ("fixed_decode_ms", np.float64),
        ("speedup_ratio", np.float64), ("decode_speedup_ratio", np.float64))}
    concurrency = np.zeros(n_sims, np.int64)
    for s, sim in enumerate(sims):
        wl, rank = sim.workload, sim.rank
        a, n = q_off[s], q_len[s]
        sl = slice(a, a + n)
        bs = rank.block_size
        prompt_len[sl] = wl.input_len
        out = _effective_max_output(sim)
        max_output[sl] = out
        src_row[sl] = table_rows[(id(wl), bs)] + np.arange(n)
        session[sl] = wl.session
        turn[sl] = wl.turn_index
        nxt = _next_turns(wl)
        next_turn[sl] = np.where(nxt >= 0, nxt + a, -1)
        delay_ms[sl] = wl.delay_ms
        start_ms[sl] = wl.start_ms
        firsts = wl.order if sim.concurrency == 0 else np.flatnonzero(wl.turn_index == 0)
        start_order[a:a + len(firsts)] = firsts + a
        num_starts[s] = len(firsts)
        concurrency[s] = sim.concurrency
        blocks = -(-(wl.input_len + out) // bs)
        lease_blocks[sl] = blocks
        per_worker = -(-n // sim.workers) + 1
        if sim.arena_blocks is not None:
            worker_arena = sim.arena_blocks
        else:
            # resident copies never exceed the blocks of the requests a worker serves
            largest = np.sort(blocks)[::-1][:per_worker]
            worker_arena = int(largest.sum()) + 16
        for w in range(w_off[s], w_off[s] + sim.workers):
            arena[w] = min(rank.num_gpu_blocks, worker_arena)
            run_cap[w] = min(rank.max_num_seqs, per_worker) + 1
            wait_cap[w] = per_worker + 1
            cfg_cols["num_gpu_blocks"][w] = rank.num_gpu_blocks
            cfg_cols["block_size"][w] = bs
            cfg_cols["max_num_seqs"][w] = rank.max_num_seqs
            cfg_cols["max_num_batched_tokens"][w] = rank.max_num_batched_tokens
            cfg_cols["max_model_len"][w] = -1 if rank.max_model_len is None else rank.max_model_len
            cfg_cols["enable_prefix_caching"][w] = rank.enable_prefix_caching
            cfg_cols["enable_chunked_prefill"][w] = rank.enable_chunked_prefill
            cfg_cols["preemption_fifo"][w] = rank.preemption_mode == "fifo"
            cfg_cols["policy"][w] = L.POLICY_TRTLLM if rank.backend == "trtllm" else L.POLICY_VLLM
            cfg_cols["role"][w] = {"aggregated": L.ROLE_AGGREGATED, "prefill": L.ROLE_PREFILL,
                                   "decode": L.ROLE_DECODE}[rank.worker_type]
            cfg_cols["timing"][w] = L.TIMING_FIXED if rank.timing_model == "fixed" else L.TIMING_POLYNOMIAL
            cfg_cols["fixed_prefill_ms"][w] = rank.fixed_prefill_ms
            cfg_cols["fixed_decode_ms"][w] = rank.fixed_decode_ms
            cfg_cols["speedup_ratio"][w] = rank.speedup_ratio
            cfg_cols["decode_speedup_ratio"][w] = rank.decode_speedup_ratio
    cfg = L.RankConfig(**cfg_cols)

    lease_off = np.concatenate([[0], np.cumsum(lease_blocks)[:-1]]).astype(np.int64)
    n_k = int(lease_blocks.sum())
    rq = L.Requests(
        prompt_len=prompt_len, max_output=max_output, src_row=src_row,
        uuid_lo=np.zeros(n_q, np.uint64), session=session, turn=turn, next_turn=next_turn,
        delay_ms=delay_ms, lease_off=lease_off,
        status=np.full(n_q, L.RS_NOT_ARRIVED, np.int8), worker=np.full(n_q, -1, np.int64),
        generated=np.zeros(n_q, np.int64), num_computed=np.zeros(n_q, np.int64),
        allocated=np.zeros(n_q, np.int64), num_hashed=np.zeros(n_q, np.int64),
        preemptions=np.zeros(n_q, np.int64), admissions=np.zeros(n_q, np.int64),
        first_cached=np.full(n_q, -1, np.int64), max_cached=np.zeros(n_q, np.int64),
        sched_stamp=np.zeros(n_q, np.int64), sched_tokens=np.zeros(n_q, np.int64),
        sched_prompt=np.zeros(n_q, np.int64), sched_prefix=np.zeros(n_q, np.int64),
        sched_terminal=np.zeros(n_q, np.bool_), term_next=np.full(n_q, -1, np.int64),
        arrival_ms=np.full(n_q, np.nan), first_admit_ms=np.full(n_q, np.nan),
        first_token_ms=np.full(n_q, np.nan), second_token_ms=np.full(n_q, np.nan),
        last_token_ms=np.full(n_q, np.nan), terminal_ms=np.full(n_q, np.nan),
        terminal=np.zeros(n_q, np.int8), committed_prefill=np.zeros(n_q, np.int64),
        lease=np.full(n_k, L.NO_BLOCK, np.int32), seq_hash=np.zeros(n_k, np.uint64),
    )

    blk_off = np.concatenate([[0], np.cumsum(arena)[:-1]]).astype(np.int64)
    tab_size = np.array([_pow2_at_least(2 * a) for a in arena], np.int64)
    tab_off = np.concatenate([[0], np.cumsum(tab_size)[:-1]]).astype(np.int64)
    n_b = int(arena.sum())
    pool = L.Pool(
        blk_off=blk_off, blk_len=arena.copy(), tab_off=tab_off, tab_mask=tab_size - 1,
        free_top=np.zeros(n_w, np.int64), num_copies=np.zeros(n_w, np.int64),
        num_reserved=np.zeros(n_w, np.int64), lru_head=np.full(n_w, L.NO_BLOCK, np.int32),
        lru_tail=np.full(n_w, L.NO_BLOCK, np.int32), lru_len=np.zeros(n_w, np.int64),
        free_stack=np.empty(n_b, np.int32), blk_hash=np.zeros(n_b, np.uint64),
        blk_ref=np.zeros(n_b, np.int32), blk_pin=np.zeros(n_b, np.int32),
        blk_cached=np.zeros(n_b, np.bool_), blk_prev=np.empty(n_b, np.int32),
        blk_next=np.empty(n_b, np.int32), blk_dup=np.empty(n_b, np.int32),
        tab=np.empty(int(tab_size.sum()), np.int32),
    )
    for w in range(n_w):
        pool_reset(pool, w)

    run_off = np.concatenate([[0], np.cumsum(run_cap)[:-1]]).astype(np.int64)
    wait_off = np.concatenate([[0], np.cumsum(wait_cap)[:-1]]).astype(np.int64)
    wk = L.Workers(
        sim=np.repeat(np.arange(n_sims), w_len).astype(np.int64),
        run_off=run_off, run_len=np.zeros(n_w, np.int64), wait_off=wait_off, wait_cap=wait_cap,
        wait_head=np.zeros(n_w, np.int64), wait_len=np.zeros(n_w, np.int64),
        busy=np.zeros(n_w, np.bool_), pass_end_ms=np.zeros(n_w), term_head=np.full(n_w, -1, np.int64),
        stalled=np.zeros(n_w, np.bool_), pass_stamp=np.zeros(n_w, np.int64),
        preemptions_total=np.zeros(n_w, np.int64),
        run_q=np.zeros(int(run_cap.sum()), np.int64), wait_q=np.zeros(int(wait_cap.sum()), np.int64),
    )
    token_stat, token_hist = sketch.token_stats_new(n_sims)
    sim_state = L.Sims(
        q_off=q_off, q_len=q_len, w_off=w_off, w_len=w_len, concurrency=concurrency,
        now_ms=np.zeros(n_sims), status=np.full(n_sims, L.SIM_RUNNING, np.int8),
        start_order=start_order, start_ms=start_ms, num_starts=num_starts,
        start_ptr=np.zeros(n_sims, np.int64), heap_q=np.zeros(n_q, np.int64),
        heap_len=np.zeros(n_sims, np.int64), ready_ms=np.full(n_q, np.nan),
        active_sessions=np.zeros(n_sims, np.int64), rr_cursor=np.zeros(n_sims, np.int64),
        num_arrived=np.zeros(n_sims, np.int64), num_terminal=np.zeros(n_sims, np.int64),
        uuid_next=np.ones(n_sims, np.int64), token_stat=token_stat, token_hist=token_hist,
        pass_log=np.zeros((n_sims, pass_log_rows, L.PL_NUM_COLUMNS)),
        pass_log_len=np.zeros(n_sims, np.int64),
    )
    max_lease = int(lease_blocks.max()) if n_q else 1
    max_bs = int(cfg.block_size.max())
    return cfg, pool, rq, workload, wk, sim_state, max_lease, max_bs


def _request_frame(sim: Simulation, rq: L.Requests, a: int, w_first: int) -> pd.DataFrame:
    n = len(sim.workload.input_len)
    sl = slice(a, a + n)
    first = rq.first_token_ms[sl]
    last = rq.last_token_ms[sl]
    n_out = rq.generated[sl]
    arrival = rq.arrival_ms[sl]
    with np.errstate(invalid="ignore"):
        tpot = np.where(n_out >= 2, (last - first) / np.maximum(n_out - 1, 1), np.nan)
    terminal = rq.terminal[sl]
    status = np.array(L.TERMINAL_STATUS_NAMES, dtype=object)[terminal]
    worker = rq.worker[sl] - w_first
    return pd.DataFrame({
        "request_id": sim.workload.request_name,
        "trace_line": sim.workload.line_no,
        "turn_index": sim.workload.turn_index.astype(np.int64),
        "worker": np.where(rq.worker[sl] >= 0, worker, -1),
        "arrival_ms": arrival,
        "first_admit_ms": rq.first_admit_ms[sl],
        "first_token_ms": first,
        "second_token_ms": rq.second_token_ms[sl],
        "last_token_ms": last,
        "completion_ms": rq.terminal_ms[sl],
        "ttft_ms": first - arrival,
        "tpot_ms": tpot,
        "e2e_ms": last - arrival,
        "input_tokens": rq.prompt_len[sl],
        "output_tokens": n_out,
        "requested_output_tokens": sim.workload.output_len.astype(np.int64),
        "cached_tokens": rq.max_cached[sl],
        "first_admission_cached_tokens": np.maximum(rq.first_cached[sl], 0),
        "admission_count": rq.admissions[sl],
        "readmission_count": np.maximum(rq.admissions[sl] - 1, 0),
        "preemptions": rq.preemptions[sl],
        "committed_prefill_tokens": rq.committed_prefill[sl],
        "terminal_status": status,
    })


def run_batch(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
              record_passes: bool = True) -> BatchResult:
    """Run every simulation to completion. Raises SimulationError for a dead end."""
    rows = pass_log_rows if record_passes else 0
    cfg, pool, rq, wl, wk, st, max_lease, max_bs = build_state(sims, rows)
    sim_ids = np.arange(len(sims), dtype=np.int64)
    pass_chunks: list[list[np.ndarray]] = [[] for _ in sims]
    calls = 0
    while True:
        replay_batch(cfg, pool, rq, wl, wk, st, sim_ids, max_lease, max_bs)
        calls += 1
        for s in range(len(sims)):
            if st.pass_log_len[s]:
                pass_chunks[s].append(st.pass_log[s, :st.pass_log_len[s]].copy())
                st.pass_log_len[s] = 0
        status = st.status
        if np.any(status == L.SIM_ARENA_FULL):
            # a duplicate-heavy run outgrew the arena estimate: rerun those with the full pool
            redo = np.flatnonzero(status == L.SIM_ARENA_FULL)
            fixed = list(sims)
            for s in redo:
                sim = sims[s]
                fixed[s] = Simulation(sim.workload, sim.rank, sim.workers, sim.concurrency,
                                      arena_blocks=sim.rank.num_gpu_blocks)
            return run_batch(fixed, pass_log_rows, record_passes)
        dead = np.flatnonzero(status == L.SIM_DEAD_END)
        if len(dead):
            s = int(dead[0])
            in_flight = int(st.num_arrived[s] - st.num_terminal[s])
            raise SimulationError(
                f"simulation {s}: dead end at t={st.now_ms[s]:.6f} ms with {in_flight} in-flight "
                "requests that can never be scheduled (a request outgrows the KV pool; the "
                "reference aborts on the same condition)")
        if np.all(status == L.SIM_DONE):
            break
    requests, passes = [], []
    for s, sim in enumerate(sims):
        requests.append(_request_frame(sim, rq, int(st.q_off[s]), int(st.w_off[s])))
        chunk = np.concatenate(pass_chunks[s]) if pass_chunks[s] else np.zeros((0, L.PL_NUM_COLUMNS))
        frame = pd.DataFrame(chunk, columns=list(L.PASS_LOG_COLUMNS))
        for col in L.PASS_LOG_COLUMNS:
            if col not in ("start_ms", "end_ms"):
                frame[col] = frame[col].astype(np.int64)
        passes.append(frame)
    return BatchResult(requests, passes, st.token_stat, st.token_hist, calls)
