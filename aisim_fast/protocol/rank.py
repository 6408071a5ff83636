"""The rank protocol as a library: drive one scheduler rank (or thousands) command by
command, as routers and schedulers do, and read its effects and KV events.

A rank is one engine rank of the reference (vLLM, TRT-LLM or SGLang): aggregated,
prefill or decode (``worker_type``). The caller owns the clock::

    rank = Rank({"backend": "vllm", "block_size": 4, "num_gpu_blocks": 64})
    rank.apply(Submit(Request("r1", tokens=list(range(8)), max_output_tokens=3)), now_ms=0.0)
    start = rank.start_pass(now_ms=0.0)          # admissions, pressure events
    done = rank.complete_pass()                  # at start.end_ms: outputs, KV events

Everything runs on the replay's kernels (``kernels.protocol.rank_step`` over the scheduler
cores), so a rank behaves exactly as a worker of a replay does. Types and field
names are the seed protocol's (``Submit``, ``CommandEffects``, ``PassStartEffects``,
``PassCompletionEffects``, ``Output``, ``KvEvent``, ...); all are frozen dataclasses.

``RankGroup`` is the batch form: many ranks in one kernel state, each command or pass
step applied to a list of ranks in one kernel call.

Prefill ranks take ``SubmitHandoffPrefill``, hold each completed prefill's KV (a
``SourceHeld`` lifecycle event with its transfer timing) and release it on
``ReleaseSource`` / ``CancelSource``. Decode ranks take ``ReserveDestination``
(``DestinationAccepted``; the reservation, a ``DestinationReserved`` lifecycle event,
comes at once on an idle rank or at a later retry), ``ActivateDestination`` once the
transfer is done, and ``CancelDestination``.
``aisim_fast.protocol.rank_replay`` drives prefill and decode ranks with the handoff
coordinator. Not simulated yet: attention DP (one dp_rank 0 per rank), and the
variance and queued-work fields of ``ForwardPassMetrics``.
"""

from __future__ import annotations

import uuid
from typing import Iterable, Sequence

import numpy as np

from aisim_fast.config.payload import ConfigError, RankConfig, check_rank, parse_rank
from aisim_fast.engine.batch_run import BatchRun
from aisim_fast.engine.event_frames import drained_event_rows, kv_block_tokens
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.hashing.xxh3 import synthetic_output_tokens as tokens
from aisim_fast.kernels.jit import compile_for, compile_notice, mark_compiled
from aisim_fast.kernels.protocol import rank_step
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.trace.output_plan import output_tokens_at
from aisim_fast.protocol.handoff.timing import HandoffTransferTiming, TransferTimingMode
from aisim_fast.protocol.types import (APPLIED, NOOP, ActivateDestination, Admission, CancelDestination,
                                       CancelRequest, CancelSource, CommandEffects, DestinationAccepted,
                                       DestinationReserved, ForwardPassMetrics, KvBlock, KvEvent, Metrics,
                                       Output, PassCompletionEffects, PassStartEffects, PressureEvent,
                                       PressureState, RankError, ReleaseSource, Removed, Request, RequestId,
                                       ReserveDestination, SourceHeld, Stored, Submit, SubmitHandoffPrefill,
                                       Submitted)
from aisim_fast.trace.workload import Workload


# ---------------------------------------------------------------------------------
# synthetic output tokens
# ---------------------------------------------------------------------------------
def _uuid_bytes(request_id: RequestId) -> bytes:
    """The request's 16 UUID bytes (RFC order): a UUID, an int, or a string that is a
    UUID; another string is hashed into one (uuid5) so any id has tokens."""
    if isinstance(request_id, uuid.UUID):
        return request_id.bytes
    if isinstance(request_id, (int, np.integer)):
        return int(request_id).to_bytes(16, "big")
    try:
        return uuid.UUID(str(request_id)).bytes
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_OID, str(request_id)).bytes


def synthetic_output_tokens(request_id: RequestId, n: int) -> np.ndarray:
    """The reference core's token for each output ordinal 0 .. n - 1 of a request with
    no planned tokens: the low 32 bits of XXH3-64 (seed 0) over its 16 UUID bytes and
    the little-endian u64 ordinal (engine.md 4.1; an integer id is the UUID of that
    value)."""
    raw = _uuid_bytes(request_id)
    return tokens(np.uint64(int.from_bytes(raw[:8], "big")), np.uint64(int.from_bytes(raw[8:], "big")),
                  int(n))


# ---------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------
_TOKEN_TRACE = "<rank requests>"
# every rank group compiles the same kernels: a rank is one worker (no router, no
# attention DP) of any backend and timing model
RANK_FEATURES = L.Features(trtllm=True, aic=True)


def _request_rows(requests: Sequence[Request], now_ms: float) -> Workload:
    """The requests as workload rows: each prompt token its own trace block (a trace
    block size of 1 with the token ids as hash ids, so the kernels see exactly these
    tokens), the output token ids authored (given, or synthetic)."""
    n = len(requests)
    lengths = np.array([len(r.tokens) for r in requests], np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(r.tokens, np.int64) for r in requests]) if n else np.zeros(0, np.int64)
    outputs = [np.asarray(r.output_token_ids, np.int64) if r.output_token_ids is not None
               else synthetic_output_tokens(r.request_id, int(r.max_output_tokens)).astype(np.int64)
               for r in requests]
    output_len = np.array([len(o) for o in outputs], np.int64)
    authored_start = (np.cumsum(output_len) - output_len).astype(np.int64)
    names = np.empty(n, dtype=object)
    names[:] = [str(r.request_id) for r in requests]
    session = np.arange(n, dtype=np.int32)
    return Workload(
        path=_TOKEN_TRACE, trace_block_size=1, line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names, session=session, turn_index=np.zeros(n, np.int32),
        start_ms=np.full(n, float(now_ms)), delay_ms=np.zeros(n), input_len=lengths, output_len=output_len,
        hash_indptr=indptr, hash_ids=tokens.astype(np.uint32), order=np.arange(n, dtype=np.int64),
        out_plan=-1 - authored_start,  # every row's tokens are authored (Workload.output_plan)
        authored_tokens=np.concatenate(outputs).astype(np.uint32) if n else np.zeros(0, np.uint32))


def _check_request(request: Request) -> None:
    if not isinstance(request, Request):
        raise RankError(f"Submit: expected a Request, got {type(request).__name__}")
    if len(request.tokens) == 0:
        raise RankError(f"Submit {request.request_id}: tokens: the prompt is empty")
    tokens = np.asarray(request.tokens)
    if tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= 2 ** 32:
        raise RankError(f"Submit {request.request_id}: tokens: must be token ids in [0, 2**32)")
    if request.output_token_ids is not None:
        ids = np.asarray(request.output_token_ids)
        if len(ids) and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= 2 ** 32):
            raise RankError(f"Submit {request.request_id}: output_token_ids: must be token ids in [0, 2**32)")
    elif not isinstance(request.max_output_tokens, (int, np.integer)) or request.max_output_tokens < 0:
        raise RankError(f"Submit {request.request_id}: max_output_tokens: must be an integer >= 0, "
                        f"got {request.max_output_tokens!r}")


def _empty_workload() -> Workload:
    return _request_rows([], 0.0)


def _rank_config(config) -> RankConfig:
    if isinstance(config, RankConfig):
        check_rank(config)
        rank = config
    elif isinstance(config, dict):
        rank = parse_rank(config)
        check_rank(rank)
    else:
        raise ConfigError(f"rank: expected a rank config (dict or RankConfig), got {type(config).__name__}")
    return rank


def _event_rows_for(rank: RankConfig) -> int:
    """Engine-log rows one pass (or one command) can write: per request an admission,
    an output, a finish and a preemption's three rows; per block a Stored and a
    Removed row."""
    blocks = rank.max_num_batched_tokens // max(1, rank.block_size) + 2 * rank.max_num_seqs
    return 8 * rank.max_num_seqs + 4 * blocks + 1024


class _PendingPass:
    """A pass in flight: what its completion releases."""

    def __init__(self, start_ms, end_ms, rows):
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.rows = rows          # its engine-log rows (outputs, finishes, KV events)
        self.late_kv_rows = []    # KV rows of commands applied while it was in flight
        self.pass_row = None      # its pass-log row (None: the pass logged none)
        self.fpm = None
        self.lifecycle = []       # SourceHeld events of its completions


class _RankBook:
    """What the driver keeps per rank beside the kernel state."""

    def __init__(self):
        self.row_of: dict = {}        # request id -> logical row (active requests)
        self.ids: list = []           # logical row -> request id
        self.first_output_done: set = set()
        self.next_event_id = 0
        self.pending: _PendingPass | None = None
        self.pass_had_effect = False
        self.broken: str | None = None
        # prefill ranks: handoff id <-> request id of sources pending or held
        self.handoff_req: dict = {}
        self.req_handoff: dict = {}
        self.held: set = set()
        self.release_on_hold: set = set()  # released while pending: an ordinary finish
        # decode ranks: handoff id <-> request id of destinations (pending, reserved, active)
        self.dest_req: dict = {}
        self.req_dest: dict = {}
        self.reserved: set = set()    # destinations reserved and not yet activated or given back
        self.kv_unreported: list = []  # SGLang: KV rows logged since the rank last reported


class RankGroup:
    """Many ranks in one kernel state, stepped together: ``submit``, ``cancel``,
    ``start_passes`` and ``complete_passes`` take lists of ranks and run one kernel
    call for all of them (``Rank`` is a group of one). Ranks are numbered from 0 in
    the order of ``configs``; each has its own clock, queues, KV cache and event ids.

    KV Stored / Removed events are recorded (``kv_events=None``, the default, or
    True); ``kv_events=False`` skips them (faster). An SGLang rank reports its radix
    cache's facts at the completion of a pass that runs a prefill batch, of every 40th
    pass without one and of a pass after which nothing runs, as the reference does
    (``sglang_core.run_pass``); facts of commands wait for the next such pass."""

    def __init__(self, configs: Iterable, *, kv_events: bool | None = None):

        self.configs = [_rank_config(c) for c in configs]
        if not self.configs:
            raise ConfigError("ranks: at least one rank config is needed")
        kv_events = kv_events is not False
        sims = [Simulation(workload=_empty_workload(), rank=rank, workers=1) for rank in self.configs]
        self._event_rows = max(_event_rows_for(rank) for rank in self.configs)
        self._run = BatchRun(sims, event_rows=self._event_rows, log_outputs=True, growable=True,
                             log_kv=kv_events, kernel_parts=["rank"],
                             features=RANK_FEATURES)
        self._books = [_RankBook() for _ in sims]
        self.kv_events = kv_events

    def __len__(self) -> int:
        return len(self.configs)

    # -- commands ----------------------------------------------------------------
    def submit(self, ranks: Sequence[int], requests: Sequence[Request],
               now_ms: Sequence[float] | float, handoff_ids: Sequence | None = None) -> list[CommandEffects]:
        """``Submit(requests[i])`` on rank ``ranks[i]`` at ``now_ms[i]``, in order
        (with ``handoff_ids``: ``SubmitHandoffPrefill``, the only submit a prefill rank
        takes). A refused command (duplicate request or handoff id, bad request)
        raises RankError before anything is applied."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        q_rows = self._new_rows(ranks, requests, handoff_ids, "prefill" if handoff_ids is not None else None)
        st = self._state
        ok = rank_kernels().submit_requests(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st,
                                        np.asarray(ranks, np.int64), q_rows, now)
        if not ok.all():
            raise AssertionError("a rank's waiting queue had no room for a submitted request")
        self._register(ranks, requests, handoff_ids, "prefill" if handoff_ids is not None else None)
        return [self._command_effects(r, Submitted(req.request_id), now[i])
                for i, (r, req) in enumerate(zip(ranks, requests))]

    def reserve_destinations(self, ranks: Sequence[int], handoff_ids: Sequence, requests: Sequence[Request],
                             now_ms: Sequence[float] | float) -> list[CommandEffects]:
        """``ReserveDestination(handoff_ids[i], requests[i])`` on decode rank
        ``ranks[i]``: ``DestinationAccepted``; the destination joins the rank's pending
        FIFO and, when no pass is in flight, the FIFO head is tried at once (a
        ``DestinationReserved`` lifecycle event in the effects when it fits). A
        refused command (duplicate id, not a decode rank, a prompt the rank could never
        hold) raises RankError before anything is applied."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        q_rows = self._new_rows(ranks, requests, handoff_ids, "decode")
        st = self._state
        ids = np.asarray(ranks, np.int64)
        impossible = rank_kernels().destinations_impossible(st.cfg, st.pool, st.rq, st.st, ids, q_rows)
        if impossible.any():
            i = int(np.flatnonzero(impossible)[0])
            raise RankError(f"ReserveDestination {handoff_ids[i]}: the prompt of {len(requests[i].tokens)} "
                            f"tokens needs more KV blocks than rank {ranks[i]} has "
                            f"({self.configs[ranks[i]].num_gpu_blocks})")
        in_flight = np.array([self._books[r].pending is not None for r in ranks])
        _, reserved = rank_kernels().reserve_destinations(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, q_rows,
                                                      now, in_flight, st.max_lease, st.max_bs)
        self._register(ranks, requests, handoff_ids, "decode")
        return [self._command_effects(r, DestinationAccepted(req.request_id), now[i],
                                      lifecycle=self._reserved_events(r, reserved[i]))
                for i, (r, req) in enumerate(zip(ranks, requests))]

    def activate_destinations(self, ranks: Sequence[int], handoff_ids: Sequence,
                              now_ms: Sequence[float] | float, cancel: bool = False) -> list[CommandEffects]:
        """``ActivateDestination`` (``cancel``: ``CancelDestination``) of a handoff on each
        decode rank. Activate applies only to a reserved destination: it becomes a
        waiting request at its arrival position, its prompt KV committed (Stored events
        for blocks that become visible). Cancel gives back a pending or reserved
        destination or drops an activated one (the request retired). Either, applied
        with no pass in flight, retries the rank's pending head. Otherwise Noop."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        st = self._state
        effects = []
        for i, (r, h) in enumerate(zip(ranks, handoff_ids)):
            book = self._books[r]
            rid = book.dest_req.get(h)
            if rid is None:
                effects.append(self._command_effects(r, NOOP, now[i]))
                continue
            q = np.array([self._q(r, book.row_of[rid])], np.int64)
            in_flight = np.array([book.pending is not None])
            step = rank_kernels().cancel_destinations if cancel else rank_kernels().activate_destinations
            applied, reserved = step(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, np.array([r], np.int64), q,
                                     now[i:i + 1], in_flight, st.max_lease, st.max_bs)
            if not applied[0]:
                effects.append(self._command_effects(r, NOOP, now[i]))
                continue
            retired, suppressed = (), False
            book.reserved.discard(rid)  # activated or given back
            if cancel:
                del book.dest_req[h]
                del book.req_dest[rid]
                del book.row_of[rid]
                retired = (rid,)
                suppressed = self._suppress_pending(r, rid, True)
            effects.append(self._command_effects(r, APPLIED, now[i], retired, suppressed,
                                                 lifecycle=self._reserved_events(r, reserved[0])))
        return effects

    def release_sources(self, ranks: Sequence[int], handoff_ids: Sequence, now_ms: Sequence[float] | float,
                        cancel: bool = False) -> list[CommandEffects]:
        """``ReleaseSource`` (``cancel``: ``CancelSource``) of a handoff on each prefill
        rank. A held source's KV is released as a finish releases it (Applied, the
        request retired). A pending source (its prefill not done): Release unregisters
        the handoff and the request finishes as an ordinary one; Cancel drops it like
        CancelRequest, suppressing its in-flight output. An unknown handoff: Noop."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        effects = []
        st = self._state
        for i, (r, h) in enumerate(zip(ranks, handoff_ids)):
            book = self._books[r]
            rid = book.handoff_req.get(h)
            if rid is None:
                effects.append(self._command_effects(r, NOOP, now[i]))
                continue
            del book.handoff_req[h]
            del book.req_handoff[rid]
            retired = ()
            if rid in book.held:
                book.held.discard(rid)
                q = np.array([self._q(r, book.row_of.pop(rid))], np.int64)
                held = rank_kernels().release_sources(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st,
                                                  np.array([r], np.int64), q, now[i:i + 1], st.max_lease,
                                                  st.max_bs)
                assert held[0], "a held source the kernel does not hold"
                retired = (rid,)
            elif cancel:
                effects.append(self.cancel([r], [CancelRequest(rid)], now[i])[0])
                continue
            else:
                book.release_on_hold.add(rid)
            effects.append(self._command_effects(r, APPLIED, now[i], retired))
        return effects

    def cancel(self, ranks: Sequence[int], commands: Sequence[CancelRequest],
               now_ms: Sequence[float] | float) -> list[CommandEffects]:
        """``CancelRequest`` on each rank: Applied when the rank's queues owned the
        request (dropped, its KV released), else Noop. While a pass is in flight its
        pending outputs for the request are suppressed (Applied, or Noop with
        ``discard_pending_output``)."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        q_rows = np.full(len(ranks), -1, np.int64)
        st = self._state
        destination = np.zeros(len(ranks), bool)
        for i, (r, cmd) in enumerate(zip(ranks, commands)):
            row = self._books[r].row_of.get(cmd.request_id)
            if row is not None:
                q_rows[i] = self._q(r, row)
                # a decode rank's request: dropped as CancelDestination drops an active
                # one (then its pending head is retried); pending or reserved: Noop
                destination[i] = cmd.request_id in self._books[r].req_dest
        known = (q_rows >= 0) & ~destination
        result = np.zeros(len(ranks), np.int64)
        reserved = np.full(len(ranks), -1, np.int64)
        if known.any():
            result[known] = rank_kernels().cancel_requests(
                st.cfg, st.pool, st.rq, st.wk, st.st, np.asarray(ranks, np.int64)[known], q_rows[known],
                now[known])
        for i in np.flatnonzero(destination):
            if st.rq.i64[q_rows[i], L.RQ_STATUS] in (L.RS_ACTIVATED, L.RS_WAITING, L.RS_RUNNING, L.RS_PREEMPTED):
                r = ranks[i]
                applied, retried = rank_kernels().cancel_destinations(
                    st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, np.array([r], np.int64), q_rows[i:i + 1],
                    now[i:i + 1], np.array([self._books[r].pending is not None]), st.max_lease, st.max_bs)
                result[i], reserved[i] = int(applied[0]), retried[0]
        effects = []
        for i, (r, cmd) in enumerate(zip(ranks, commands)):
            book = self._books[r]
            applied = result[i] == 1
            retired = []
            if applied:
                del book.row_of[cmd.request_id]
                retired.append(cmd.request_id)
                for fwd, back in ((book.handoff_req, book.req_handoff), (book.dest_req, book.req_dest)):
                    h = back.pop(cmd.request_id, None)
                    if h is not None:
                        del fwd[h]
            suppressed = self._suppress_pending(r, cmd.request_id, applied, cmd.discard_pending_output)
            if suppressed and cmd.request_id not in retired:
                retired.append(cmd.request_id)
            effects.append(self._command_effects(r, APPLIED if applied else NOOP, now[i], tuple(retired),
                                                 suppressed, lifecycle=self._reserved_events(r, reserved[i])))
        return effects

    # -- passes --------------------------------------------------------------------
    def start_passes(self, ranks: Sequence[int], now_ms: Sequence[float] | float) -> list[PassStartEffects | None]:
        """Start a pass on each rank at ``now_ms``. A rank with nothing to run (no
        running or waiting request) starts none: None. The pass's scheduling happens
        now; complete it (``complete_passes``) at its ``end_ms``."""
        ranks = self._rank_list(ranks)
        now = self._times(now_ms, len(ranks))
        st = self._state
        wk_i = st.wk.i64
        w = st.st.i64[np.asarray(ranks, np.int64), L.SM_W_OFF]
        for r in ranks:
            if self._books[r].pending is not None:
                raise RankError(f"rank {r}: a pass is in flight (started at "
                                f"{self._books[r].pending.start_ms} ms); complete it first")
            self._check_alive(r)
        has_work = (wk_i[w, L.WK_RUN_LEN] > 0) | (wk_i[w, L.WK_WAIT_LEN] > 0) | (wk_i[w, L.WK_SG_READY_LEN] > 0)
        out: list[PassStartEffects | None] = [None] * len(ranks)
        run = np.flatnonzero(has_work)
        if len(run) == 0:
            return out
        ids = np.asarray(ranks, np.int64)[run]
        end_ms, had_effect = rank_kernels().start_passes(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, now[run],
                                                     st.max_lease, st.max_bs)
        for k, i in enumerate(run):
            self._books[ranks[i]].pass_had_effect = bool(had_effect[k])
        for k, i in enumerate(run):
            r = ranks[i]
            if not np.isfinite(end_ms[k]):
                self._books[r].broken = L.SIM_STATUS_NAMES[int(st.st.i64[r, L.SM_STATUS])]
                raise RankError(f"rank {r}: the pass outgrew the rank's kernel state "
                                f"({self._books[r].broken}); the rank cannot go on")
            out[i] = self._pass_started(r, float(now[i]), float(end_ms[k]))
        return out

    def complete_passes(self, ranks: Sequence[int]) -> list[PassCompletionEffects]:
        """Complete the pass in flight on each rank (at the end its start returned):
        its outputs, KV events (and those of commands applied meanwhile), metrics."""
        ranks = self._rank_list(ranks)
        for r in ranks:
            if self._books[r].pending is None:
                raise RankError(f"rank {r}: no pass in flight")
        st = self._state
        ids = np.asarray(ranks, np.int64)
        rank_kernels().complete_passes(st.cfg, st.rq, st.wk, st.st, ids)
        # decode ranks retry their pending head at every completion (engine.md 3.5)
        decode = np.array([self.configs[r].worker_type == "decode" for r in ranks], bool)
        reserved = np.full(len(ranks), -1, np.int64)
        if decode.any():
            reserved[decode] = rank_kernels().retry_destinations(st.cfg, st.pool, st.rq, st.wl, st.wk, st.st,
                                                             ids[decode], st.max_lease, st.max_bs)
        out = []
        for i, r in enumerate(ranks):
            book = self._books[r]
            book.pending.lifecycle.extend(self._reserved_events(r, reserved[i]))
            pending, book.pending = book.pending, None
            late = self._drain_rows(r)  # the retry's evictions (commands drained their own)
            outputs = tuple(row[1] for row in pending.rows if row[0] == "output")
            kv_rows = [row for row in pending.rows if row[0] in ("kv", "kv_report")] \
                + pending.late_kv_rows + late
            out.append(PassCompletionEffects(
                outputs=outputs, lifecycle_events=tuple(pending.lifecycle),
                kv_events=self._kv_events(r, self._reported(r, kv_rows)),
                metrics=self._metrics(r, pending.pass_row), forward_pass_metrics=pending.fpm))
        return out

    def _new_rows(self, ranks: list[int], requests: Sequence[Request], handoff_ids, role) -> np.ndarray:
        """Validate new requests (Submit; ``role`` "prefill": SubmitHandoffPrefill,
        "decode": ReserveDestination) and add their kernel rows, unregistered until
        ``_register``: a refused command leaves only rows nothing refers to. Returns the
        kernel rows."""
        command = {"prefill": "SubmitHandoffPrefill", "decode": "ReserveDestination"}.get(role, "Submit")
        if len(requests) != len(ranks) or (handoff_ids is not None and len(handoff_ids) != len(ranks)):
            raise ValueError(f"{command}: one request (and handoff id) per rank entry")
        seen: dict = {}
        for i, (r, request) in enumerate(zip(ranks, requests)):
            _check_request(request)
            book = self._books[r]
            key = (r, request.request_id)
            if request.request_id in book.row_of or key in seen:
                raise RankError(f"{command} {request.request_id}: request {request.request_id} is already "
                                f"active on rank {r}")
            seen[key] = True
            worker_type = self.configs[r].worker_type
            if role is None and worker_type != "aggregated":
                takes = "SubmitHandoffPrefill" if worker_type == "prefill" else "ReserveDestination"
                raise RankError(f"Submit {request.request_id}: rank {r} is a {worker_type} rank: it takes "
                                f"{takes}")
            if role is not None:
                if worker_type != role:
                    raise RankError(f"{command} {handoff_ids[i]}: rank {r} is not a {role} rank")
                hkey = (r, "handoff", handoff_ids[i])
                if handoff_ids[i] in book.handoff_req or handoff_ids[i] in book.dest_req or hkey in seen:
                    raise RankError(f"{command} {handoff_ids[i]}: handoff {handoff_ids[i]} is "
                                    f"already active on rank {r}")
                seen[hkey] = True
        by_rank: dict[int, list[int]] = {}
        for i, r in enumerate(ranks):
            by_rank.setdefault(r, []).append(i)
        first_row = {}
        # every rank's new rows in one growth of the state
        self._run.add_requests_many([(r, _request_rows([requests[i] for i in idx], 0.0))
                                     for r, idx in by_rank.items()])
        for r, idx in by_rank.items():
            book = self._books[r]
            first_row[r] = len(book.ids)
            book.ids.extend(requests[i].request_id for i in idx)
        q_rows = np.empty(len(ranks), np.int64)
        for r, idx in by_rank.items():  # kernel rows after every rank grew (rows move)
            for k, i in enumerate(idx):
                q_rows[i] = self._q(r, first_row[r] + k)
        self._staged = {(r, requests[i].request_id): first_row[r] + k
                        for r, idx in by_rank.items() for k, i in enumerate(idx)}
        return q_rows

    def _register(self, ranks: list[int], requests: Sequence[Request], handoff_ids, role) -> None:
        """The rows ``_new_rows`` added are the ranks' requests now (and handoffs: a
        pending source or a destination)."""
        staged, self._staged = self._staged, {}
        for i, (r, req) in enumerate(zip(ranks, requests)):
            book = self._books[r]
            book.row_of[req.request_id] = staged[(r, req.request_id)]
            if role == "prefill":
                book.handoff_req[handoff_ids[i]] = req.request_id
                book.req_handoff[req.request_id] = handoff_ids[i]
            elif role == "decode":
                book.dest_req[handoff_ids[i]] = req.request_id
                book.req_dest[req.request_id] = handoff_ids[i]

    def _reserved_events(self, r: int, q: int) -> tuple:
        """The DestinationReserved event of kernel row ``q`` a destination retry
        reserved (none for RETRY_NONE)."""
        if q == _RETRY_ARENA_FULL:
            self._books[r].broken = "arena_full"
            raise RankError(f"rank {r}: a destination reservation outgrew the rank's block arena; "
                            "the rank cannot go on")
        if q < 0:
            return ()
        book = self._books[r]
        rid = book.ids[q - int(self._state.st.i64[r, L.SM_Q_OFF])]
        book.reserved.add(rid)
        fresh = int(self._state.rq.i64[q, L.RQ_RESERVED_FRESH])
        return (DestinationReserved(book.req_dest[rid], rid, fresh * self.configs[r].block_size),)

    def _suppress_pending(self, r: int, rid, applied: bool, discard: bool = False) -> bool:
        """Rank-level suppression (engine.md 11): while a pass is in flight, an applied
        cancel (or ``discard``) removes the request's pending outputs and lifecycle
        events; returns whether an output was removed."""
        pending = self._books[r].pending
        if pending is None or not (applied or discard):
            return False
        before = len(pending.rows)
        pending.rows = [row for row in pending.rows if not (row[0] == "output" and row[1].request_id == rid)]
        pending.lifecycle = [e for e in pending.lifecycle if e.request_id != rid]
        return len(pending.rows) != before

    # -- reading state -------------------------------------------------------------
    def metrics(self, rank: int) -> Metrics:
        return self._metrics(rank, None)

    def pass_in_flight(self, rank: int) -> bool:
        return self._books[rank].pending is not None

    def pass_had_effect(self, rank: int) -> bool:
        """Whether the rank's last started pass changed anything (admitted, computed,
        emitted, preempted): an event-driven driver parks a rank whose zero-duration
        pass changed nothing until a command reaches it (``stalled``)."""
        return self._books[rank].pass_had_effect

    def stalled(self, rank: int) -> bool:
        """Parked by ``park`` and not woken since: no command that could let the rank
        run (new work, freed room, an activation) reached it."""
        st = self._state
        return bool(st.wk.i64[int(st.st.i64[rank, L.SM_W_OFF]), L.WK_STALLED])

    def park(self, rank: int) -> None:
        """Mark the rank stalled until a command wakes it (the kernels clear the mark
        wherever the replay's event loop would wake the worker)."""
        st = self._state
        st.wk.i64[int(st.st.i64[rank, L.SM_W_OFF]), L.WK_STALLED] = 1

    def has_work(self, rank: int) -> bool:
        """Whether a pass started now would run (running or waiting requests; on an
        SGLang decode rank also activated destinations waiting for a slot)."""
        st = self._state
        wk = st.wk.i64[int(st.st.i64[rank, L.SM_W_OFF])]
        return bool(wk[L.WK_RUN_LEN] > 0 or wk[L.WK_WAIT_LEN] > 0 or wk[L.WK_SG_READY_LEN] > 0)

    def effect_free_pass_gives_up(self, rank: int) -> bool:
        """SGLang: after a zero-duration pass that changed nothing while the rank
        holds work, whether the reference's replay gives up on the run (it reruns
        such a pass at that instant while the pass still decays the new-token ratio,
        up to its retry limit; the decays are applied here)."""
        st = self._state
        return bool(rank_kernels().effect_free_passes_give_up(st.cfg, st.wk, st.st, np.array([rank], np.int64))[0])

    # -- internals -----------------------------------------------------------------
    @property
    def _state(self):
        return self._run.state

    def _rank_list(self, ranks) -> list[int]:
        ranks = [int(r) for r in ranks]
        for r in ranks:
            if not 0 <= r < len(self.configs):
                raise IndexError(f"rank {r} is not in this group of {len(self.configs)}")
        return ranks

    @staticmethod
    def _times(now_ms, n: int) -> np.ndarray:
        now = np.broadcast_to(np.asarray(now_ms, np.float64), (n,)).copy()
        if not np.all(np.isfinite(now)) or np.any(now < 0):
            raise RankError(f"now_ms: must be finite and >= 0, got {now_ms!r}")
        return now

    def _check_alive(self, r: int) -> None:
        if self._books[r].broken:
            raise RankError(f"rank {r} stopped: {self._books[r].broken}")

    def _q(self, r: int, logical: int) -> int:
        return int(self._state.st.i64[r, L.SM_Q_OFF]) + logical

    def _drain_rows(self, r: int) -> list:
        """The rank's engine-log rows since the last drain, decoded: ("kv", row),
        ("kv_report", row), ("output", Output), ("admission", Admission), ("pressure",
        PressureEvent), ("finished", request id, status)."""
        state = self._state
        log = state.pool.event_log
        n = int(log[r, 0, L.EVH_LEN])
        if n == 0:
            return []
        if n > self._event_rows:
            self._books[r].broken = "events_full"
            raise RankError(f"rank {r}: one step logged {n} engine events, more than the "
                            f"{self._event_rows} the rank holds; the rank cannot go on")
        rows = drained_event_rows(state, r, n)
        log[r, 0, L.EVH_LEN] = 0
        return self._decode(r, rows)

    def _decode(self, r: int, rows: np.ndarray) -> list:
        book = self._books[r]
        sim = self._run.sims[r]
        sglang = self.configs[r].backend == "sglang"
        kind = rows[:, L.EV_KIND]
        out_rows = np.flatnonzero(kind == L.EV_OUTPUT)
        token_ids = np.empty(len(out_rows), np.uint32)
        if len(out_rows):
            plan, authored = sim.workload.output_plan()
            output_tokens_at(plan, authored, np.ascontiguousarray(rows[out_rows, L.EV_A]),
                             np.ascontiguousarray(rows[out_rows, L.EV_B] - 1), token_ids)
        token_of = dict(zip(out_rows.tolist(), token_ids.tolist()))
        kind_l = kind.tolist()
        a, b, c = rows[:, L.EV_A].tolist(), rows[:, L.EV_B].tolist(), rows[:, L.EV_C].tolist()
        decoded = []
        i, n = 0, len(kind_l)
        while i < n:
            k = kind_l[i]
            if k <= L.EV_KV_REMOVED:
                decoded.append(("kv", rows[i]))
            elif k == L.EV_KV_REPORTED:
                decoded.append(("kv_report", rows[i]))
            elif k == L.EV_ADMITTED:
                decoded.append(("admission", Admission(book.ids[a[i]], b[i])))
            elif k == L.EV_OUTPUT:
                decoded.append(("output", Output(book.ids[a[i]], token_of[i], completed=bool(c[i]),
                                                 cached_tokens=self._first_cached(r, a[i], sglang))))
            elif k == L.EV_FINISHED:
                rid = book.ids[a[i]]
                if b[i] != L.TERM_CANCELED:
                    book.row_of.pop(rid, None)
                    h = book.req_dest.pop(rid, None)  # a finished destination's handoff ends
                    if h is not None:
                        del book.dest_req[h]
                if b[i] == L.TERM_NONE:  # a source held for its handoff (prefill rank)
                    book.row_of[rid] = a[i]
                    decoded.append(("held", rid))
                elif b[i] == L.TERM_REJECTED:
                    # a rejected source is no pending source any more (Release / Cancel: Noop)
                    h = book.req_handoff.pop(rid, None)
                    if h is not None:
                        del book.handoff_req[h]
                    decoded.append(("rejection", Output(rid, None, completed=True, rejected=True)))
                elif b[i] == L.TERM_COMPLETED and c[i] == 0:
                    decoded.append(("output", Output(rid, None, completed=True,
                                                     cached_tokens=self._first_cached(r, a[i], sglang))))
            elif k == L.EV_PREEMPTED:
                # the pressure event's rows: PREEMPTED, PRESSURE (and PRESSURE_SGLANG)
                retraction = i + 2 < n and kind_l[i + 2] == L.EV_PRESSURE_SGLANG
                running = b[i]
                waiting = None if sglang or c[i + 1] < 0 else c[i + 1]
                decoded.append(("pressure", PressureEvent(
                    at_ms=float(np.int64(rows[i, L.EV_TIME_BITS]).view(np.float64)),
                    kind="sglang_retraction" if retraction else "vllm_preemption",
                    request_id=book.ids[a[i]],
                    state_before=PressureState(running, waiting, c[i]),
                    state_after=PressureState(running - 1, None if waiting is None else waiting + 1, b[i + 1]),
                    request_active_blocks_before=a[i + 1],
                    logical_available_blocks_before=a[i + 2] if retraction else None,
                    required_blocks_before=b[i + 2] if retraction else None)))
                i += 3 if retraction else 2
                continue
            i += 1
        return decoded

    def _transfer_timing(self, r: int, rid):
        """SourceHeld's transfer inputs (engine.md 10.1): the rank's transfer config and
        the request's full prompt."""
        cfg = self.configs[r]
        prompt = int(self._state.rq.i64[self._q(r, self._books[r].row_of[rid]), L.RQ_PROMPT_LEN])
        return HandoffTransferTiming(mode=TransferTimingMode.parse(cfg.kv_transfer_timing_mode),
                                     full_prompt_tokens=prompt, kv_bytes_per_token=cfg.kv_transfer_bytes_per_token,
                                     bandwidth_gb_s=cfg.kv_transfer_bandwidth)

    def _first_cached(self, r: int, logical: int, sglang: bool):
        """vLLM / TRT-LLM: the first admission's reused prompt tokens, on the request's
        first output only; SGLang outputs carry none."""
        book = self._books[r]
        if logical in book.first_output_done:
            return None
        book.first_output_done.add(logical)
        if sglang:
            return None
        return int(self._state.rq.i64[self._q(r, logical), L.RQ_FIRST_CACHED])

    def _reported(self, r: int, kv_rows: list) -> list:
        """The KV rows visible now among ``kv_rows`` (in log order): all of them on a
        vLLM / TRT-LLM rank; on an SGLang rank those up to its latest report row, with
        the ones it had not reported before (the rest wait for its next report)."""
        if self.configs[r].backend != "sglang":
            return kv_rows
        book = self._books[r]
        out = []
        for row in kv_rows:
            if row[0] == "kv_report":
                out += book.kv_unreported
                book.kv_unreported = []
            else:
                book.kv_unreported.append(row)
        return out

    def _kv_events(self, r: int, kv_rows: list) -> tuple[KvEvent, ...]:
        """KvEvents of KV log rows: a Stored event per run of rows its first row opens
        (KV_FIRST / KV_FIRST_WITH_PARENT, then KV_NEXT), a Removed event likewise;
        event ids continue the rank's."""
        if not kv_rows:
            return ()
        rows = np.array([row[1] for row in kv_rows], np.int64)
        book = self._books[r]
        token_ids = None
        if self.configs[r].emit_kv_token_ids:
            stored = rows[:, L.EV_KIND] == L.EV_KV_STORED
            token_ids = kv_block_tokens(self._run.sims[r], rows, rows[:, L.EV_WORKER] * 0, stored)
        # columns as Python ints once (per-element numpy reads cost more than the rest)
        kind = rows[:, L.EV_KIND].tolist()
        group = rows[:, L.EV_C].tolist()
        block_hash = rows[:, L.EV_A].view(np.uint64).tolist()
        parent_hash = rows[:, L.EV_B].view(np.uint64).tolist()
        tokens_hash = rows[:, L.EV_TOKENS_HASH].view(np.uint64).tolist()
        events = []
        i, n = 0, len(kind)
        while i < n:
            j = i + 1
            while j < n and group[j] == L.KV_NEXT:
                j += 1
            if kind[i] == L.EV_KV_STORED:
                data = Stored(parent_hash[i] if group[i] == L.KV_FIRST_WITH_PARENT else None,
                              tuple(KvBlock(block_hash[k], tokens_hash[k],
                                            None if token_ids is None else tuple(map(int, token_ids[k])))
                                    for k in range(i, j)))
            else:
                data = Removed(tuple(block_hash[i:j]))
            events.append(KvEvent(book.next_event_id, 0, data))
            book.next_event_id += 1
            i = j
        return tuple(events)

    def _pass_started(self, r: int, start_ms: float, end_ms: float) -> PassStartEffects:
        decoded = self._drain_rows(r)
        st = self._state.st
        n_log = int(st.i64[r, L.SM_PASS_LOG_LEN])
        pass_row = st.pass_log[r, n_log - 1].copy() if n_log else None
        st.i64[r, L.SM_PASS_LOG_LEN] = 0
        pending = _PendingPass(start_ms, end_ms, [])
        admissions, pressure, tokens, terminal, rejections, kv = [], [], [], [], [], []
        for entry in decoded:
            tag = entry[0]
            if tag == "admission":
                admissions.append(entry[1])
            elif tag == "pressure":
                pressure.append(entry[1])
            elif tag in ("kv", "kv_report"):
                kv.append(entry)
            elif tag == "rejection":
                rejections.append(entry)
            elif tag == "held":
                continue  # SourceHeld, below
            elif entry[1].token_id is None:
                terminal.append(entry)
            else:
                tokens.append(entry)
        # vLLM's output order (engine.md 5.8): terminals without token, tokens, rejections;
        # SGLang's: the pass's outputs in order, then rejections (7.7)
        if self.configs[r].backend == "sglang":
            ordered = [e for e in decoded if e[0] == "output"]
        else:
            ordered = terminal + tokens
        pending.rows = ordered + [("output", e[1]) for e in rejections] + kv
        book = self._books[r]
        for entry in decoded:
            if entry[0] != "held":
                continue
            rid = entry[1]
            if rid in book.release_on_hold:  # unregistered while pending: an ordinary finish
                book.release_on_hold.discard(rid)
                st_ = self._state
                q = np.array([self._q(r, book.row_of.pop(rid))], np.int64)
                rank_kernels().release_sources(st_.cfg, st_.pool, st_.rq, st_.wl, st_.wk, st_.st,
                                           np.array([r], np.int64), q, np.array([start_ms]), st_.max_lease,
                                           st_.max_bs)
                pending.rows += [e for e in self._drain_rows(r) if e[0] in ("kv", "kv_report")]
            else:
                book.held.add(rid)
                pending.lifecycle.append(SourceHeld(book.req_handoff[rid], rid, self._transfer_timing(r, rid)))
        pending.pass_row = pass_row
        pending.fpm = _fpm(pass_row, start_ms, end_ms)
        self._books[r].pending = pending
        return PassStartEffects(start_ms=start_ms, end_ms=end_ms, admissions=tuple(admissions),
                                pressure_events=tuple(pressure))

    def _command_effects(self, r: int, result, now_ms: float, retired=(), suppressed=False,
                         lifecycle=()) -> CommandEffects:
        decoded = self._drain_rows(r)
        kv = [e for e in decoded if e[0] in ("kv", "kv_report")]
        book = self._books[r]
        if book.pending is not None:
            book.pending.late_kv_rows.extend(kv)  # visible at the in-flight pass's end
            kv_events = ()
        else:
            kv_events = self._kv_events(r, self._reported(r, kv))
        return CommandEffects(result=result, lifecycle_events=tuple(lifecycle), kv_events=kv_events,
                              retired_requests=tuple(retired),
                              metrics=self._metrics(r, None), suppressed_pending_output=suppressed)

    def _waiting(self, r: int, wk: np.ndarray) -> int:
        """Metrics.waiting_requests (engine.md 9.1): the waiting queue (vLLM: activated
        destinations included), SGLang's ready list, pending and reserved destinations."""
        return int(wk[L.WK_WAIT_LEN] + wk[L.WK_SG_READY_LEN] + wk[L.WK_PEND_LEN]) + len(self._books[r].reserved)

    def _metrics(self, r: int, pass_row) -> Metrics:
        state = self._state
        w = int(state.st.i64[r, L.SM_W_OFF])
        wk = state.wk.i64[w]
        if self.configs[r].backend == "sglang":
            radix = state.pool.radix
            active = int(radix.w64[w, L.RW_PAGES_USED])
            total = int(radix.w64[w, L.RW_PAGE_CAP])
            preemptions = 0
            hit = total_tokens = 0
            if pass_row is not None:
                hit = int(pass_row[L.PL_SUM_PREFILL_KV_TOKENS])
                total_tokens = hit + int(pass_row[L.PL_SUM_PREFILL_TOKENS])
        else:
            pw = state.pool.w64[w]
            active = int(pw[L.PW_NUM_COPIES] - pw[L.PW_LRU_LEN] + pw[L.PW_NUM_RESERVED])
            total = int(self.configs[r].num_gpu_blocks)
            preemptions = int(wk[L.WK_PREEMPTIONS_TOTAL])
            hit = total_tokens = 0
        return Metrics(dp_rank=0, active_blocks=active, total_blocks=total,
                       cache_usage=active / total if total else 0.0,
                       running_requests=int(wk[L.WK_RUN_LEN]), waiting_requests=self._waiting(r, wk),
                       preemptions_total=preemptions, sglang_cache_hit_tokens=hit,
                       sglang_cache_total_tokens=total_tokens)


def _fpm(row, start_ms: float, end_ms: float) -> ForwardPassMetrics:
    duration = max(0.0, end_ms - start_ms)
    if row is None:
        return ForwardPassMetrics(0, 0, 0, 0, 0, duration)
    return ForwardPassMetrics(
        num_prefill_requests=int(row[L.PL_NUM_PREFILL_REQUESTS]), sum_prefill_tokens=int(row[L.PL_SUM_PREFILL_TOKENS]),
        sum_prefill_kv_tokens=int(row[L.PL_SUM_PREFILL_KV_TOKENS]),
        num_decode_requests=int(row[L.PL_NUM_DECODE_REQUESTS]),
        sum_decode_kv_tokens=int(row[L.PL_SUM_DECODE_KV_TOKENS]), duration_ms=duration)


_LOADED: list = []
_RETRY_ARENA_FULL = -2  # kernels.protocol.rank_step.RETRY_ARENA_FULL (read without loading the kernels)


def rank_kernels():
    """``kernels.protocol.rank_step``, compiled (or loaded from the kernel cache) once per
    process under the cache lock, as the replay's kernels are."""
    if not _LOADED:
        _load(rank_step)
        _LOADED.append(True)
    return rank_step


def _load(rank_step) -> None:
    """Compile the rank kernels for the state types every rank group has (a group's
    arrays differ in size only), typed on a throwaway group's state."""
    import numba

    compile_notice(["rank"])
    sims = [Simulation(workload=_empty_workload(), rank=RankConfig(), workers=1)]
    st = BatchRun(sims, event_rows=16, log_outputs=True, growable=True, kernel_parts=[],
                  features=RANK_FEATURES).state
    ids, times = np.zeros(0, np.int64), np.zeros(0)
    calls = [(rank_step.submit_requests, (st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, ids, times)),
             (rank_step.start_passes, (st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, times, st.max_lease,
                                       st.max_bs)),
             (rank_step.complete_passes, (st.cfg, st.rq, st.wk, st.st, ids)),
             (rank_step.cancel_requests, (st.cfg, st.pool, st.rq, st.wk, st.st, ids, ids, times)),
             (rank_step.destinations_impossible, (st.cfg, st.pool, st.rq, st.st, ids, ids)),
             (rank_step.effect_free_passes_give_up, (st.cfg, st.wk, st.st, ids)),
             (rank_step.retry_destinations, (st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, st.max_lease,
                                             st.max_bs))]
    flags = np.zeros(0, np.bool_)
    for fn in (rank_step.reserve_destinations, rank_step.activate_destinations, rank_step.cancel_destinations):
        calls.append((fn, (st.cfg, st.pool, st.rq, st.wl, st.wk, st.st, ids, ids, times, flags, st.max_lease,
                           st.max_bs)))
    for fn, args in calls:
        compile_for(fn, tuple(numba.typeof(a) for a in args))
    mark_compiled("rank")


class Rank:
    """One rank driven by hand (a ``RankGroup`` of one): ``apply(command, now_ms)``,
    ``start_pass(now_ms)``, ``complete_pass()``."""

    def __init__(self, config, *, kv_events: bool | None = None):
        self.group = RankGroup([config], kv_events=kv_events)
        self.config = self.group.configs[0]

    def apply(self, command, now_ms: float) -> CommandEffects:
        if isinstance(command, Submit):
            return self.group.submit([0], [command.request], now_ms)[0]
        if isinstance(command, CancelRequest):
            return self.group.cancel([0], [command], now_ms)[0]
        if isinstance(command, SubmitHandoffPrefill):
            return self.group.submit([0], [command.request], now_ms, handoff_ids=[command.handoff_id])[0]
        if isinstance(command, (ReleaseSource, CancelSource)):
            return self.group.release_sources([0], [command.handoff_id], now_ms,
                                              cancel=isinstance(command, CancelSource))[0]
        if isinstance(command, ReserveDestination):
            return self.group.reserve_destinations([0], [command.handoff_id], [command.request], now_ms)[0]
        if isinstance(command, (ActivateDestination, CancelDestination)):
            return self.group.activate_destinations([0], [command.handoff_id], now_ms,
                                                    cancel=isinstance(command, CancelDestination))[0]
        raise RankError(f"{type(command).__name__}: not a rank command (Submit, SubmitHandoffPrefill, "
                        "ReserveDestination, ActivateDestination, ReleaseSource, CancelSource, "
                        "CancelDestination, CancelRequest)")

    def start_pass(self, now_ms: float) -> PassStartEffects | None:
        return self.group.start_passes([0], now_ms)[0]

    def complete_pass(self) -> PassCompletionEffects:
        return self.group.complete_passes([0])[0]

    @property
    def metrics(self) -> Metrics:
        return self.group.metrics(0)

    @property
    def pass_in_flight(self) -> bool:
        return self.group.pass_in_flight(0)

    @property
    def has_work(self) -> bool:
        return self.group.has_work(0)
