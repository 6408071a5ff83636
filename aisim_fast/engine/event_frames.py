"""The engine event log drained from kernel state, and the tables decoded from it: engine,
pressure, output and KV events."""

from __future__ import annotations

import numba
import numpy as np
import pandas as pd

from aisim_fast.engine.grow import KernelState
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.jit import compile_for, mark_compiled
from aisim_fast.kernels.kv.lease import kv_tokens_hashes
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.trace.output_plan import output_tokens_at
from aisim_fast.trace.workload import sequence_tokens


def compile_event_kernels(state: KernelState) -> None:
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


def event_rows(chunks: list) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.zeros((0, L.EV_NUM_COLUMNS), np.int64)


def engine_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
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
    worker, dp_rank = worker_and_rank(sim, rows[:, L.EV_WORKER] - w_first)
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
    if any_attention_dp(sim):
        frame.insert(1, "dp_rank", dp_rank)
    return frame


def worker_and_rank(sim: Simulation, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def any_attention_dp(sim: Simulation) -> bool:
    return max(sim.dp_size, sim.prefill_dp_size) > 1


def pressure_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
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
    worker, dp_rank = worker_and_rank(sim, head[:, L.EV_WORKER] - w_first)
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


def output_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
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
    worker, dp_rank = worker_and_rank(sim, rows[:, L.EV_WORKER] - w_first)
    frame = pd.DataFrame({
        "worker": worker,
        "time_ms": np.ascontiguousarray(rows[:, L.EV_TIME_BITS]).view(np.float64),
        "request_id": sim.workload.request_name[logical],
        "turn_index": sim.workload.turn_index[logical].astype(np.int64),
        "token_index": rows[:, L.EV_B],
        "token_id": token_id,
        "last": rows[:, L.EV_C] != 0,
    })
    if any_attention_dp(sim):
        frame.insert(1, "dp_rank", dp_rank)
    return frame


def kv_event_frame(sim: Simulation, rows: np.ndarray, w_first: int) -> pd.DataFrame:
    """One simulation's KV events as the reference emits them, one row per block, in
    the order they happened. ``event_id`` numbers a worker's events (rank-local, from
    0); the blocks of one event share it and ``position`` orders them. ``at_ms`` is
    when the event becomes visible (its pass's end). ``parent_hash`` is the event's
    (Stored: the block before its first one; <NA> at block 0 and for Removed) on each
    of its rows; ``tokens_hash`` the block's tokens-only hash (Stored). With the rank's
    ``emit_kv_token_ids``, ``token_ids`` lists each Stored block's tokens."""
    rows = kv_rows_as_reported(rows)
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
    logical, dp_rank = worker_and_rank(sim, worker)
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
        frame["token_ids"] = kv_block_tokens(sim, rows, worker, stored)
    return frame


def kv_rows_as_reported(rows: np.ndarray) -> np.ndarray:
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


def kv_block_tokens(sim: Simulation, rows: np.ndarray, worker: np.ndarray, stored: np.ndarray):
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
