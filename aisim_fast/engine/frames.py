"""Result tables of a simulation from kernel state: requests, passes, handoffs, routing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.schema import layout as L
from aisim_fast.report import agentic as agentic_report

ROUTING_COLUMNS = ("request_id", "turn_index", "pool", "worker", "dp_rank", "cost", "costs", "overlap_blocks",
                   "best_overlap_blocks", "tied", "time_ms")


def routing_frame(sim: Simulation, log: np.ndarray, costs: np.ndarray) -> pd.DataFrame:
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


def nullable_ints(values: np.ndarray, present: np.ndarray) -> pd.arrays.IntegerArray:
    """Integers that are null where ``present`` is False (a worker never assigned),
    as the reference leaves those cells empty."""
    return pd.arrays.IntegerArray(np.where(present, values, 0).astype(np.int64), ~present)


def request_frame(sim: Simulation, rq: L.Requests, a, w_first, agentic=None) -> pd.DataFrame:
    """Per-request record, columns named as in the reference's per-request CSVs.

    ``a``: the first kernel row of the simulation's requests, or the kernel row of each
    (a simulation run as per-worker units); ``w_first``: its first worker, or per row
    the number to subtract from a row's worker to get the simulation's. ``agentic``: an
    agentic simulation's (lane of each play, send order, feedback batch of each
    request), as its run decided them (``report.agentic.request_columns``).

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
        prefill_worker = nullable_ints(prefill_rank // sim.prefill_dp_size, prefill_placed)
        first_decode_worker = w_first + sim.prefill_ranks
    else:
        pi, pf = ri, rf  # one row serves both sides
        first_decode_worker = w_first
    rank = ri[:, L.RQ_WORKER] - first_decode_worker
    placed = ri[:, L.RQ_WORKER] >= 0
    worker = nullable_ints(rank // sim.dp_size, placed)
    cols = {
        "request_id": sim.workload.request_name,
        "trace_line": sim.workload.line_no,
        # an agentic request is a node of its graph, no turn of a session (the reference
        # leaves it null)
        "turn_index": (nullable_ints(np.zeros(n, np.int64), np.zeros(n, bool)) if sim.workload.agentic is not None
                       else sim.workload.turn_index.astype(np.int64)),
        "worker": worker,
    }
    if sim.dp_size > 1:
        cols["dp_rank"] = nullable_ints(rank % sim.dp_size, placed)  # the attention-DP rank of its worker
    if sim.prefill_dp_size > 1:
        cols["prefill_dp_rank"] = nullable_ints(prefill_rank % sim.prefill_dp_size, prefill_placed)
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
    if sim.tokenization is not None:
        # when its prompt left the tokenization pool of its (prefill) worker
        # (kernels.loop.tokenization)
        cols["tokenized_ms"] = pf[:, L.RQF_TOKENIZED_MS]
    if sim.rank.sglang_host_loop:
        # the host loop's milestones (kernels.sglang.host_loop): the iteration that took it
        # in, the one that selected it, and its prefill's forward end, when its first
        # token is observed
        if sim.rank.frontend is not None:  # it left the frontend stages (kernels.sglang.frontend)
            cols["frontend_ready_ms"] = rf[:, L.RQF_FRONTEND_READY_MS]
        cols["scheduler_received_ms"] = rf[:, L.RQF_RECEIVED_MS]
        cols["selected_ms"] = rf[:, L.RQF_FIRST_ADMIT_MS]
        cols["prefill_complete_ms"] = first
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
            "decode_cached_tokens": nullable_ints(
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
    if sim.workload.agentic is not None:  # its place in the graph (report.agentic)
        cols.update(agentic_report.request_columns(sim.workload.agentic, arrival, *(agentic or (None, None, None))))
    frame = pd.DataFrame(cols)
    sent = ri[:, L.RQ_TERMINAL] != L.TERM_NOT_SENT
    if not sent.all():  # turns after a failed one: never sent, so no record (as the reference)
        frame = frame[sent].reset_index(drop=True)
    return frame


class LazyFrames(Sequence):
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


PASS_TIME_COLUMNS = ("start_ms", "end_ms")  # the pass log's float columns; the rest count


def _pass_columns(chunks: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The pass-log rows as contiguous columns: every count column cast in one pass
    over the transposed rows (a strided cast per column costs several times more)."""
    rows = np.concatenate(chunks) if chunks else np.zeros((0, L.PL_NUM_COLUMNS))
    counts = rows.T.astype(np.int64)
    return {col: np.ascontiguousarray(rows[:, i]) if col in PASS_TIME_COLUMNS else counts[i]
            for i, col in enumerate(L.PASS_LOG_COLUMNS)}


def pass_frame(chunks: list[np.ndarray]) -> pd.DataFrame:
    return pd.DataFrame(_pass_columns(chunks))


def pass_table(chunks: list[np.ndarray]):
    """The pass-log rows as an Arrow table (the columns are not copied again)."""
    import pyarrow as pa
    return pa.table(_pass_columns(chunks))


def handoff_log_rows(sims: Sequence[Simulation]) -> int:
    """Journal rows per simulation: six lifecycle events per disaggregated request."""
    return max([len(sim.workload.input_len) * len(L.HANDOFF_EVENT_NAMES)
                for sim in sims if sim.disaggregated], default=0)


def handoff_frame(sim: Simulation, rows: np.ndarray) -> pd.DataFrame:
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
