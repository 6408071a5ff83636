"""The replay-side handoff coordinator over arrays of handoffs.

One row of a ``HandoffState`` table per handoff, for every in-flight handoff of every
simulation in a batch. ``apply_start``, ``apply_facts`` and ``apply_outcomes`` take
arrays of rows and apply one event per row at once with numpy masks. Each call
validates the whole batch before touching the table, then computes the transition on a
copy of the addressed rows and writes it back only when every row succeeded, so one bad
row never leaves another row half-updated. ``HandoffCoordinator`` is a readable
one-handoff wrapper over the same three functions. What it issues follows the
transitions of ``handoff.actions``; transfer delays come from ``handoff.timing``.

Action ids are allocated per handoff, starting at 0 and increasing by one per issued
action, like the reference coordinator. Every action kind is issued at most once per
handoff (each is guarded by its own "issued" flag), so the action journal is a fixed
``(rows, 8)`` table indexed by action kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from aisim_fast.protocol.handoff.actions import (ActionKind, Completion, CoordinatorMode, FactKind,
                                                 HandoffOrder, NEXT_ON_ARRIVAL, NEXT_ON_DESTINATION_ACTIVATED,
                                                 NEXT_ON_DESTINATION_RESERVED, NEXT_ON_SOURCE_HELD,
                                                 NEXT_ON_TRANSFER_COMPLETED, N_ACTION_KINDS, OutcomeKind,
                                                 ACTION_NAMES, ALLOWED_OUTCOMES, CLEANUP_ACTIONS, FACT_NAMES,
                                                 OUTCOME_NAMES)
from aisim_fast.protocol.handoff.timing import (HandoffTransferTiming, TransferTimingArrays,
                                                TransferTimingMode, broadcast_column, invalid_delay_mask,
                                                timing_delay_ms, resolve_transfer_delay_ms,
                                                transfer_timing_violations)


# ---------------------------------------------------------------------------
# Coordinator state table
# ---------------------------------------------------------------------------

# (column, dtype, initial value, second dimension or None)
_SCHEMA: tuple[tuple[str, type, object, int | None], ...] = (
    # identity
    ("handoff_id", np.int64, -1, None),  # caller-allocated id, echoed in actions
    ("simulation", np.int64, 0, None),  # which simulation of the batch owns the row
    ("order", np.int8, HandoffOrder.SOURCE_FIRST, None),
    ("fallback_transfer_delay_ms", np.float64, 0.0, None),
    # lifecycle
    ("mode", np.int8, CoordinatorMode.ACTIVE, None),
    ("completion", np.int8, Completion.NONE, None),
    ("started", np.bool_, False, None),
    # action journal: id issued for each kind (-1 = not issued) and its outcome
    ("next_action_id", np.int64, 0, None),
    ("action_id_by_kind", np.int64, -1, N_ACTION_KINDS),
    ("outcome_by_kind", np.int8, OutcomeKind.NONE, N_ACTION_KINDS),
    ("outcome_message_by_kind", np.int32, -1, N_ACTION_KINDS),  # index into HandoffState.messages
    # source (prefill worker) progress
    ("src_submit_issued", np.bool_, False, None),
    ("src_submitted", np.bool_, False, None),
    ("src_held", np.bool_, False, None),
    ("src_release_issued", np.bool_, False, None),
    ("src_cancel_issued", np.bool_, False, None),
    ("src_cleanup_done", np.bool_, False, None),
    # timing frozen at SourceHeld (NaN = absent)
    ("timing_mode", np.int8, TransferTimingMode.FULL_PROMPT, None),
    ("timing_full_prompt_tokens", np.int64, 0, None),
    ("timing_kv_bytes_per_token", np.float64, np.nan, None),
    ("timing_bandwidth_gb_s", np.float64, np.nan, None),
    ("timing_state_bytes", np.float64, 0.0, None),
    # destination (decode worker) progress
    ("dst_reserve_issued", np.bool_, False, None),
    ("dst_accepted", np.bool_, False, None),
    ("dst_reserved", np.bool_, False, None),
    ("dst_transferable_prompt_tokens", np.int64, -1, None),  # -1 = not reported yet
    ("dst_activation_issued", np.bool_, False, None),
    ("dst_activation_applied", np.bool_, False, None),
    ("dst_cancel_issued", np.bool_, False, None),
    ("dst_cleanup_done", np.bool_, False, None),
    # virtual transfer progress
    ("xfer_issued", np.bool_, False, None),
    ("xfer_scheduled", np.bool_, False, None),
    ("xfer_completed", np.bool_, False, None),
    ("xfer_delay_ms", np.float64, np.nan, None),  # delay carried by StartTransfer
)

STATE_COLUMNS: tuple[str, ...] = tuple(name for name, *_ in _SCHEMA)


class HandoffState:
    """Struct-of-arrays table: one row per handoff, columns as in ``STATE_COLUMNS``.

    Column attributes are views of length ``n_rows`` into buffers that grow
    geometrically, so appending handoffs one at a time stays cheap.  Failure
    messages of ``Failed(msg)`` outcomes are interned in ``messages`` and the
    journal stores their index, so the conflicting-outcome check compares
    integers.
    """

    def __init__(self, capacity: int = 0):
        self.n_rows = 0
        self._capacity = max(int(capacity), 0)
        self._buffers: dict[str, np.ndarray] = {}
        for name, dtype, fill, width in _SCHEMA:
            shape = (self._capacity,) if width is None else (self._capacity, width)
            self._buffers[name] = np.full(shape, fill, dtype=dtype)
        self.messages: list[str] = []
        self._message_codes: dict[str, int] = {}
        self._refresh_views()

    def __len__(self) -> int:
        return self.n_rows

    def _refresh_views(self) -> None:
        for name, buf in self._buffers.items():
            setattr(self, name, buf[: self.n_rows])

    def _grow_to(self, n_rows: int) -> None:
        if n_rows > self._capacity:
            new_capacity = max(n_rows, 2 * self._capacity, 16)
            for name, dtype, fill, width in _SCHEMA:
                shape = (new_capacity,) if width is None else (new_capacity, width)
                buf = np.full(shape, fill, dtype=dtype)
                buf[: self.n_rows] = self._buffers[name][: self.n_rows]
                self._buffers[name] = buf
            self._capacity = new_capacity
        self.n_rows = n_rows
        self._refresh_views()

    def intern_message(self, message: str) -> int:
        """Code of a ``Failed(message)`` text, for the ``failure_message_codes`` argument."""
        code = self._message_codes.get(message)
        if code is None:
            code = len(self.messages)
            self.messages.append(message)
            self._message_codes[message] = code
        return code

    def take(self, rows: np.ndarray) -> "HandoffState":
        """Independent copy of the given rows (message table shared: it is append-only)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = HandoffState.__new__(HandoffState)
        out.n_rows = int(rows.shape[0])
        out._capacity = out.n_rows
        # Fancy indexing copies, so the result shares no memory with self.
        out._buffers = {name: getattr(self, name)[rows] for name in STATE_COLUMNS}
        out.messages = self.messages
        out._message_codes = self._message_codes
        out._refresh_views()
        return out

    def put(self, rows: np.ndarray, other: "HandoffState") -> None:
        for name in STATE_COLUMNS:
            getattr(self, name)[rows] = getattr(other, name)

    def copy(self) -> "HandoffState":
        out = self.take(np.arange(self.n_rows))
        out.messages = list(self.messages)
        out._message_codes = dict(self._message_codes)
        return out

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in STATE_COLUMNS}

    def equals(self, other: "HandoffState", rows: np.ndarray | None = None) -> bool:
        """Column-wise equality (NaN == NaN), optionally restricted to some rows."""
        if rows is None:
            if self.n_rows != other.n_rows:
                return False
            rows = np.arange(self.n_rows)
        for name in STATE_COLUMNS:
            a, b = getattr(self, name)[rows], getattr(other, name)[rows]
            if not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                return False
        return True

    def is_complete(self) -> np.ndarray:
        return self.mode == CoordinatorMode.COMPLETE


def add_handoffs(
    state: HandoffState,
    handoff_ids: Sequence[int] | np.ndarray,
    orders: Sequence[int] | np.ndarray | int,
    fallback_transfer_delay_ms: Sequence[float] | np.ndarray | float = 0.0,
    simulation: Sequence[int] | np.ndarray | int = 0,
) -> np.ndarray:
    """Append fresh (not started) handoffs; returns their row numbers."""
    handoff_ids = np.atleast_1d(np.asarray(handoff_ids, dtype=np.int64))
    n_new = handoff_ids.shape[0]
    orders = broadcast_column(orders, n_new, np.int64, "orders")
    fallback_ms = broadcast_column(fallback_transfer_delay_ms, n_new, np.float64, "fallback_transfer_delay_ms")
    simulation = broadcast_column(simulation, n_new, np.int64, "simulation")
    bad_order = (orders != HandoffOrder.SOURCE_FIRST) & (orders != HandoffOrder.DESTINATION_FIRST)
    if bad_order.any():
        i = int(np.flatnonzero(bad_order)[0])
        raise ValueError(f"handoff {int(handoff_ids[i])}: unknown handoff order {int(orders[i])}")
    with np.errstate(invalid="ignore"):
        bad_fallback = ~(np.isfinite(fallback_ms) & (fallback_ms >= 0.0))
    if bad_fallback.any():
        i = int(np.flatnonzero(bad_fallback)[0])
        raise ValueError(
            f"handoff {int(handoff_ids[i])}: fallback_transfer_delay_ms must be finite and >= 0, "
            f"got {float(fallback_ms[i])!r}"
        )
    first = state.n_rows
    state._grow_to(first + n_new)
    rows = np.arange(first, first + n_new, dtype=np.int64)
    state.handoff_id[rows] = handoff_ids
    state.order[rows] = orders
    state.fallback_transfer_delay_ms[rows] = fallback_ms
    state.simulation[rows] = simulation
    return rows


def pending_action_mask(state: HandoffState) -> np.ndarray:
    """(rows, kinds) mask of issued actions still awaiting an outcome.

    Complete is never pending (it is issued as the handoff finishes), and a
    complete handoff has nothing pending.
    """
    pending = (state.action_id_by_kind >= 0) & (state.outcome_by_kind == OutcomeKind.NONE)
    pending[:, ActionKind.COMPLETE] = False
    pending &= ~state.is_complete()[:, None]
    return pending


# ---------------------------------------------------------------------------
# Issued actions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedHandoffAction:
    id: int
    kind: ActionKind
    handoff_id: int
    delay_ms: float | None = None  # only StartTransfer carries a delay

    def __str__(self) -> str:
        extra = f", delay_ms={self.delay_ms!r}" if self.delay_ms is not None else ""
        return f"#{self.id} {ACTION_NAMES[self.kind]}(handoff {self.handoff_id}{extra})"


@dataclass
class IssuedActions:
    """Actions issued by one batched call, ordered by input position then action id.

    ``delay_ms`` is NaN except for StartTransfer.
    """

    rows: np.ndarray
    handoff_ids: np.ndarray
    action_ids: np.ndarray
    kinds: np.ndarray
    delay_ms: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def to_list(self) -> list[IssuedHandoffAction]:
        return [
            IssuedHandoffAction(
                id=int(self.action_ids[i]),
                kind=ActionKind(int(self.kinds[i])),
                handoff_id=int(self.handoff_ids[i]),
                delay_ms=None if math.isnan(self.delay_ms[i]) else float(self.delay_ms[i]),
            )
            for i in range(len(self))
        ]

    def for_row(self, row: int) -> list[IssuedHandoffAction]:
        mask = self.rows == row
        return IssuedActions(
            self.rows[mask], self.handoff_ids[mask], self.action_ids[mask], self.kinds[mask], self.delay_ms[mask]
        ).to_list()

    @staticmethod
    def empty() -> "IssuedActions":
        return IssuedActions(
            np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0)
        )


class _IssueLog:
    """Collects actions issued on a working copy, keyed by local row (= input position)."""

    def __init__(self) -> None:
        self._positions: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._kinds: list[np.ndarray] = []
        self._delays_ms: list[np.ndarray] = []

    def add(self, positions: np.ndarray, ids: np.ndarray, kind: ActionKind, delays_ms: np.ndarray | None) -> None:
        self._positions.append(positions)
        self._ids.append(ids)
        self._kinds.append(np.full(positions.shape[0], kind, dtype=np.int8))
        self._delays_ms.append(np.full(positions.shape[0], np.nan) if delays_ms is None else delays_ms)

    def finish(self, rows: np.ndarray, work: HandoffState) -> IssuedActions:
        if not self._positions:
            return IssuedActions.empty()
        positions = np.concatenate(self._positions)
        ids = np.concatenate(self._ids)
        order = np.lexsort((ids, positions))
        positions = positions[order]
        return IssuedActions(
            rows=rows[positions],
            handoff_ids=work.handoff_id[positions],
            action_ids=ids[order],
            kinds=np.concatenate(self._kinds)[order],
            delay_ms=np.concatenate(self._delays_ms)[order],
        )


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class HandoffError(ValueError):
    """A batched handoff update was rejected; nothing in the table was changed.

    ``rows``, ``handoff_ids`` and ``action_ids`` (-1 for facts) describe the
    offending inputs; ``reasons`` holds one message per offending input.
    """

    def __init__(self, message: str, rows, handoff_ids, action_ids, reasons: list[str]):
        super().__init__(message)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.handoff_ids = np.asarray(handoff_ids, dtype=np.int64)
        self.action_ids = np.asarray(action_ids, dtype=np.int64)
        self.reasons = reasons


_MAX_LISTED_ERRORS = 20


def _raise_if_rejected(state: HandoffState, rows: np.ndarray, problems: dict[int, tuple[int, str]]) -> None:
    """``problems`` maps input position -> (action id or -1, "what: why")."""
    if not problems:
        return
    positions = np.array(sorted(problems), dtype=np.int64)
    bad_rows = rows[positions]
    handoff_ids = state.handoff_id[bad_rows]
    simulations = state.simulation[bad_rows]
    action_ids = [problems[int(p)][0] for p in positions]
    reasons = [problems[int(p)][1] for p in positions]
    lines = [
        f"  handoff {int(h)} (row {int(r)}, simulation {int(s)}): {why}"
        for h, r, s, why in zip(handoff_ids, bad_rows, simulations, reasons)
    ]
    if len(lines) > _MAX_LISTED_ERRORS:
        lines = lines[:_MAX_LISTED_ERRORS] + [f"  ... and {len(lines) - _MAX_LISTED_ERRORS} more"]
    message = (
        f"{len(positions)} of {rows.shape[0]} handoff update(s) rejected; no row was changed:\n" + "\n".join(lines)
    )
    raise HandoffError(message, bad_rows, handoff_ids, action_ids, reasons)


def _check_rows(state: HandoffState, rows) -> np.ndarray:
    rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
    if rows.ndim != 1:
        raise ValueError(f"rows must be one-dimensional, got shape {rows.shape}")
    out_of_range = (rows < 0) | (rows >= state.n_rows)
    if out_of_range.any():
        raise IndexError(f"handoff rows {rows[out_of_range][:10].tolist()} are not in the table (n_rows={state.n_rows})")
    # One event per row per call: events for the same handoff are ordered,
    # and a vectorised update cannot express that order.
    unique, counts = np.unique(rows, return_counts=True)
    if (counts > 1).any():
        dup = unique[counts > 1]
        raise ValueError(
            f"handoff rows {dup[:10].tolist()} (handoffs {state.handoff_id[dup[:10]].tolist()}) appear more than "
            "once in one call; split ordered events for one handoff across calls"
        )
    return rows


# ---------------------------------------------------------------------------
# Transitions on a working copy (local rows 0..k-1 = input positions)
# ---------------------------------------------------------------------------


def _issue(work: HandoffState, idx: np.ndarray, kind: ActionKind, log: _IssueLog, delays_ms=None) -> None:
    if idx.shape[0] == 0:
        return
    ids = work.next_action_id[idx].copy()
    work.next_action_id[idx] += 1
    work.action_id_by_kind[idx, kind] = ids
    log.add(idx, ids, kind, delays_ms)


def _complete(work: HandoffState, idx: np.ndarray, log: _IssueLog) -> None:
    # Completing while cleaning up means the handoff was abandoned.
    work.completion[idx] = np.where(
        work.mode[idx] == CoordinatorMode.CLEANING_UP, Completion.CANCELED, Completion.SUCCESS
    )
    work.mode[idx] = CoordinatorMode.COMPLETE
    _issue(work, idx, ActionKind.COMPLETE, log)  # after a release: NEXT_ON_SOURCE_RELEASED


def _stored_timing(work: HandoffState, idx: np.ndarray) -> TransferTimingArrays:
    return TransferTimingArrays(
        mode=work.timing_mode[idx],
        full_prompt_tokens=work.timing_full_prompt_tokens[idx],
        kv_bytes_per_token=work.timing_kv_bytes_per_token[idx],
        bandwidth_gb_s=work.timing_bandwidth_gb_s[idx],
        state_bytes=work.timing_state_bytes[idx],
    )


def _advance_active(work: HandoffState, idx: np.ndarray, log: _IssueLog) -> None:
    """Issue at most one next action per row; the first matching rule wins."""
    remaining = idx

    def claim(condition: np.ndarray) -> np.ndarray:
        nonlocal remaining
        chosen = remaining[condition]
        remaining = remaining[~condition]
        return chosen

    r = remaining
    sel = claim((work.order[r] == HandoffOrder.SOURCE_FIRST) & work.src_held[r] & ~work.dst_reserve_issued[r])
    work.dst_reserve_issued[sel] = True
    _issue(work, sel, NEXT_ON_SOURCE_HELD, log)

    r = remaining
    sel = claim((work.order[r] == HandoffOrder.DESTINATION_FIRST) & work.dst_reserved[r] & ~work.src_submit_issued[r])
    work.src_submit_issued[sel] = True
    _issue(work, sel, ActionKind.SUBMIT_PREFILL, log)

    # The transfer starts only once both sides are engaged (SourceFirst: the reservation
    # is the later fact).
    r = remaining
    sel = claim(work.src_held[r] & work.dst_reserved[r] & ~work.xfer_issued[r])
    if sel.shape[0]:
        work.xfer_issued[sel] = True
        delay_ms = timing_delay_ms(_stored_timing(work, sel), work.dst_transferable_prompt_tokens[sel])
        delay_ms = resolve_transfer_delay_ms(delay_ms, work.fallback_transfer_delay_ms[sel])
        work.xfer_delay_ms[sel] = delay_ms
        _issue(work, sel, NEXT_ON_DESTINATION_RESERVED, log, delay_ms)

    r = remaining
    sel = claim(work.xfer_completed[r] & ~work.dst_activation_issued[r])
    work.dst_activation_issued[sel] = True
    _issue(work, sel, NEXT_ON_TRANSFER_COMPLETED, log)

    r = remaining
    sel = claim(work.dst_activation_applied[r] & ~work.src_release_issued[r])
    work.src_release_issued[sel] = True
    _issue(work, sel, NEXT_ON_DESTINATION_ACTIVATED, log)

    r = remaining
    sel = claim(work.src_cleanup_done[r])  # the source released
    _complete(work, sel, log)


def _advance_cleanup(work: HandoffState, idx: np.ndarray, log: _IssueLog) -> None:
    """Cancel every side that was engaged and not yet cleaned; complete when none is left."""
    cancel_source = work.src_submit_issued[idx] & ~work.src_cancel_issued[idx] & ~work.src_cleanup_done[idx]
    cancel_destination = work.dst_reserve_issued[idx] & ~work.dst_cancel_issued[idx] & ~work.dst_cleanup_done[idx]
    all_clean = (
        ~cancel_source
        & ~cancel_destination
        & (~work.src_submit_issued[idx] | work.src_cleanup_done[idx])
        & (~work.dst_reserve_issued[idx] | work.dst_cleanup_done[idx])
    )
    # Source before destination so a row's two cancels get ids in that order.
    sel = idx[cancel_source]
    work.src_cancel_issued[sel] = True
    _issue(work, sel, ActionKind.CANCEL_SOURCE, log)
    sel = idx[cancel_destination]
    work.dst_cancel_issued[sel] = True
    _issue(work, sel, ActionKind.CANCEL_DESTINATION, log)
    _complete(work, idx[all_clean], log)


def _begin_cleanup(work: HandoffState, idx: np.ndarray, log: _IssueLog) -> None:
    idx = idx[work.mode[idx] != CoordinatorMode.COMPLETE]
    work.mode[idx] = CoordinatorMode.CLEANING_UP
    _advance_cleanup(work, idx, log)


def _commit(state: HandoffState, rows: np.ndarray, work: HandoffState, log: _IssueLog) -> IssuedActions:
    issued = log.finish(rows, work)
    # Last line of defence: a computed StartTransfer delay must be usable.
    # Raised before the write-back, so the table stays untouched.
    bad = (issued.kinds == ActionKind.START_TRANSFER) & invalid_delay_mask(issued.delay_ms)
    if bad.any():
        problems = {}
        for i in np.flatnonzero(bad):
            position = int(np.flatnonzero(rows == issued.rows[i])[0])
            problems[position] = (
                int(issued.action_ids[i]),
                f"action {int(issued.action_ids[i])} (StartTransfer): invalid handoff transfer delay "
                f"{float(issued.delay_ms[i])!r} ms",
            )
        _raise_if_rejected(state, rows, problems)
    state.put(rows, work)
    return issued


# ---------------------------------------------------------------------------
# Batched public transitions
# ---------------------------------------------------------------------------


def apply_start(state: HandoffState, rows) -> IssuedActions:
    """Start handoffs: SubmitPrefill (SourceFirst) or ReserveDestination (DestinationFirst).

    Starting an already started handoff issues nothing.
    """
    rows = _check_rows(state, rows)
    work = state.take(rows)
    log = _IssueLog()
    idx = np.flatnonzero(~work.started)
    work.started[idx] = True
    source_first = idx[work.order[idx] == HandoffOrder.SOURCE_FIRST]
    work.src_submit_issued[source_first] = True
    _issue(work, source_first, NEXT_ON_ARRIVAL, log)
    destination_first = idx[work.order[idx] == HandoffOrder.DESTINATION_FIRST]
    work.dst_reserve_issued[destination_first] = True
    _issue(work, destination_first, ActionKind.RESERVE_DESTINATION, log)
    return _commit(state, rows, work, log)


def apply_facts(
    state: HandoffState,
    rows,
    fact_kinds,
    *,
    timing: TransferTimingArrays | None = None,
    transferable_prompt_tokens=None,
    handoff_ids=None,
) -> IssuedActions:
    """Apply one fact per row.

    ``fact_kinds`` is a ``FactKind`` or an array aligned with ``rows``.
    ``timing`` (aligned with ``rows``) is read for SourceHeld rows and
    ``transferable_prompt_tokens`` for DestinationReserved rows; other rows
    ignore them.  ``handoff_ids``, when given, must match the rows' ids.

    Facts only act on active handoffs; a repeated SourceHeld,
    DestinationReserved or TransferCompleted is a no-op.  Failed, TimedOut
    and Canceled start cleanup.
    """
    rows = _check_rows(state, rows)
    k = rows.shape[0]
    kinds = broadcast_column(fact_kinds, k, np.int64, "fact_kinds")
    bad_kind = (kinds < 0) | (kinds >= len(FactKind))
    if bad_kind.any():
        _raise_if_rejected(
            state, rows, {int(p): (-1, f"unknown fact kind {int(kinds[p])}") for p in np.flatnonzero(bad_kind)}
        )
    is_held = kinds == FactKind.SOURCE_HELD
    is_reserved = kinds == FactKind.DESTINATION_RESERVED
    is_transferred = kinds == FactKind.TRANSFER_COMPLETED
    is_terminal = kinds >= FactKind.FAILED

    if timing is None:
        if is_held.any():
            raise ValueError("SourceHeld facts need the timing argument")
        timing = TransferTimingArrays(np.zeros(k, np.int64), 0, np.nan, np.nan)
    elif len(timing) != k:
        raise ValueError(f"timing has {len(timing)} elements; expected {k} (one per row)")
    if transferable_prompt_tokens is None:
        if is_reserved.any():
            raise ValueError("DestinationReserved facts need the transferable_prompt_tokens argument")
        transferable_prompt_tokens = -1
    tokens = broadcast_column(transferable_prompt_tokens, k, np.int64, "transferable_prompt_tokens")

    # ---- validate everything before changing anything ----
    problems: dict[int, tuple[int, str]] = {}

    def reject(mask: np.ndarray, describe) -> None:
        for p in np.flatnonzero(mask):
            problems.setdefault(int(p), (-1, f"fact {FACT_NAMES[FactKind(int(kinds[p]))]}: {describe(int(p))}"))

    if handoff_ids is not None:
        claimed = broadcast_column(handoff_ids, k, np.int64, "handoff_ids")
        reject(claimed != state.handoff_id[rows], lambda p: f"fact belongs to a different handoff ({int(claimed[p])})")

    active = state.mode[rows] == CoordinatorMode.ACTIVE
    apply_held = active & is_held & ~state.src_held[rows]
    apply_reserved = active & is_reserved & ~state.dst_reserved[rows]
    apply_transferred = active & is_transferred & ~state.xfer_completed[rows]
    apply_terminal = active & is_terminal

    def awaiting(p: int, kind: ActionKind, outcome: OutcomeKind) -> str:
        # Name the action whose outcome is missing, so the report points at
        # the lost or reordered message.
        action_id = int(state.action_id_by_kind[rows[p], kind])
        if action_id < 0:
            return f"(action {ACTION_NAMES[kind]} not issued yet)"
        return f"(action {action_id} ({ACTION_NAMES[kind]}) has no {OUTCOME_NAMES[outcome]} outcome)"

    reject(
        apply_held & ~state.src_submitted[rows],
        lambda p: "source held before prefill submission was acknowledged "
        + awaiting(p, ActionKind.SUBMIT_PREFILL, OutcomeKind.SUBMITTED),
    )
    # Timing of rows that are not applying SourceHeld is ignored, as is the
    # timing of a repeated SourceHeld (the first one is frozen).
    timing_reasons = transfer_timing_violations(timing)
    bad_timing = np.zeros(k, dtype=bool)
    bad_timing[list(timing_reasons)] = True
    reject(apply_held & bad_timing, lambda p: timing_reasons[p])
    reject(
        apply_reserved & ~state.dst_accepted[rows],
        lambda p: "destination reserved before ownership was accepted "
        + awaiting(p, ActionKind.RESERVE_DESTINATION, OutcomeKind.ACCEPTED),
    )
    reject(apply_reserved & (tokens < 0), lambda p: f"invalid transferable_prompt_tokens {int(tokens[p])}")
    reject(
        apply_transferred & ~state.xfer_scheduled[rows],
        lambda p: "transfer completed before it was scheduled "
        + awaiting(p, ActionKind.START_TRANSFER, OutcomeKind.SCHEDULED),
    )
    _raise_if_rejected(state, rows, problems)

    # ---- apply on a copy of the addressed rows ----
    work = state.take(rows)
    log = _IssueLog()
    sel = np.flatnonzero(apply_held)
    work.src_held[sel] = True
    work.timing_mode[sel] = timing.mode[sel]
    work.timing_full_prompt_tokens[sel] = timing.full_prompt_tokens[sel]
    work.timing_kv_bytes_per_token[sel] = np.where(timing.has_kv_bytes_per_token[sel], timing.kv_bytes_per_token[sel], np.nan)
    work.timing_bandwidth_gb_s[sel] = np.where(timing.has_bandwidth_gb_s[sel], timing.bandwidth_gb_s[sel], np.nan)
    work.timing_state_bytes[sel] = timing.state_bytes[sel]
    sel = np.flatnonzero(apply_reserved)
    work.dst_reserved[sel] = True
    work.dst_transferable_prompt_tokens[sel] = tokens[sel]
    work.xfer_completed[np.flatnonzero(apply_transferred)] = True
    _advance_active(work, np.flatnonzero(apply_held | apply_reserved | apply_transferred), log)
    _begin_cleanup(work, np.flatnonzero(apply_terminal), log)
    return _commit(state, rows, work, log)


def apply_outcomes(
    state: HandoffState,
    rows,
    action_ids,
    outcome_kinds,
    failure_message_codes=None,
) -> IssuedActions:
    """Report one action outcome per row.

    ``outcome_kinds`` is an ``OutcomeKind`` or an array aligned with ``rows``;
    ``failure_message_codes`` (from ``state.intern_message``) identifies the
    text of Failed outcomes, so a repeated Failed with another text is a
    conflict.  Outcomes for complete handoffs are ignored; a repeated
    identical outcome is a no-op.  Failed on any action but a cancel starts
    cleanup; a failed cancel is an error.
    """
    rows = _check_rows(state, rows)
    k = rows.shape[0]
    ids = broadcast_column(action_ids, k, np.int64, "action_ids")
    outcomes = broadcast_column(outcome_kinds, k, np.int64, "outcome_kinds")
    codes = broadcast_column(-1 if failure_message_codes is None else failure_message_codes, k, np.int64, "failure_message_codes")
    codes = np.where(outcomes == OutcomeKind.FAILED, codes, -1)

    # ---- validate everything before changing anything ----
    problems: dict[int, tuple[int, str]] = {}
    live = state.mode[rows] != CoordinatorMode.COMPLETE
    journal = state.action_id_by_kind[rows]
    matches = (journal == ids[:, None]) & (journal >= 0)
    known = matches.any(axis=1)
    action_kinds = np.where(known, matches.argmax(axis=1), -1)

    def describe(p: int) -> str:
        outcome_code = int(outcomes[p])
        outcome = OUTCOME_NAMES[OutcomeKind(outcome_code)] if 0 <= outcome_code < len(OutcomeKind) else str(outcome_code)
        if outcome_code == OutcomeKind.FAILED and 0 <= codes[p] < len(state.messages):
            outcome = f"Failed({state.messages[int(codes[p])]!r})"
        action = ACTION_NAMES[ActionKind(int(action_kinds[p]))] if action_kinds[p] >= 0 else "unknown"
        return f"action {int(ids[p])} ({action}) outcome {outcome}"

    def reject(mask: np.ndarray, why) -> None:
        for p in np.flatnonzero(mask):
            problems.setdefault(int(p), (int(ids[p]), f"{describe(int(p))}: {why(int(p))}"))

    bad_outcome = (outcomes <= OutcomeKind.NONE) | (outcomes > OutcomeKind.FAILED)
    reject(bad_outcome, lambda p: "unknown outcome kind")
    bad_code = (outcomes == OutcomeKind.FAILED) & ((codes < -1) | (codes >= len(state.messages)))
    reject(bad_code, lambda p: f"unknown failure message code {int(codes[p])}")
    reject(live & ~known, lambda p: f"unknown handoff action {int(ids[p])}")

    safe_kinds = np.maximum(action_kinds, 0)
    previous = state.outcome_by_kind[rows, safe_kinds]
    previous_code = state.outcome_message_by_kind[rows, safe_kinds]
    considered = live & known & ~bad_outcome & ~bad_code
    repeated = considered & (previous != OutcomeKind.NONE)
    conflicting = repeated & ((previous != outcomes) | (previous_code != codes))
    reject(conflicting, lambda p: f"conflicting outcome for handoff action {int(ids[p])}")
    fresh = considered & (previous == OutcomeKind.NONE)
    failed = fresh & (outcomes == OutcomeKind.FAILED)
    failed_cleanup = failed & np.isin(action_kinds, CLEANUP_ACTIONS)
    reject(failed_cleanup, lambda p: f"handoff cleanup action {int(ids[p])} failed")
    succeeded = fresh & ~failed
    allowed = ALLOWED_OUTCOMES[safe_kinds, np.clip(outcomes, 0, len(OutcomeKind) - 1)]
    reject(succeeded & ~allowed, lambda p: "invalid handoff action outcome for this action")
    _raise_if_rejected(state, rows, problems)

    # ---- apply on a copy of the addressed rows ----
    work = state.take(rows)
    log = _IssueLog()
    recorded = np.flatnonzero(fresh)
    work.outcome_by_kind[recorded, action_kinds[recorded]] = outcomes[recorded]
    work.outcome_message_by_kind[recorded, action_kinds[recorded]] = codes[recorded]

    _begin_cleanup(work, np.flatnonzero(failed), log)

    succeeded_kinds = np.where(succeeded, action_kinds, -1)
    work.src_submitted[succeeded_kinds == ActionKind.SUBMIT_PREFILL] = True
    work.dst_accepted[succeeded_kinds == ActionKind.RESERVE_DESTINATION] = True
    work.xfer_scheduled[succeeded_kinds == ActionKind.START_TRANSFER] = True
    work.dst_activation_applied[succeeded_kinds == ActionKind.ACTIVATE_DESTINATION] = True
    work.src_cleanup_done[
        (succeeded_kinds == ActionKind.RELEASE_SOURCE) | (succeeded_kinds == ActionKind.CANCEL_SOURCE)
    ] = True
    work.dst_cleanup_done[succeeded_kinds == ActionKind.CANCEL_DESTINATION] = True

    advancing = succeeded & (action_kinds != ActionKind.COMPLETE)
    _advance_active(work, np.flatnonzero(advancing & (work.mode == CoordinatorMode.ACTIVE)), log)
    _advance_cleanup(work, np.flatnonzero(advancing & (work.mode == CoordinatorMode.CLEANING_UP)), log)
    return _commit(state, rows, work, log)


# ---------------------------------------------------------------------------
# One-handoff wrapper (readable form; every call goes through the batched API)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HandoffFact:
    kind: FactKind
    handoff_id: int
    transfer_timing: HandoffTransferTiming | None = None
    transferable_prompt_tokens: int | None = None

    @classmethod
    def source_held(cls, handoff_id: int, transfer_timing: HandoffTransferTiming) -> "HandoffFact":
        return cls(FactKind.SOURCE_HELD, handoff_id, transfer_timing=transfer_timing)

    @classmethod
    def destination_reserved(cls, handoff_id: int, transferable_prompt_tokens: int) -> "HandoffFact":
        return cls(FactKind.DESTINATION_RESERVED, handoff_id, transferable_prompt_tokens=transferable_prompt_tokens)

    @classmethod
    def transfer_completed(cls, handoff_id: int) -> "HandoffFact":
        return cls(FactKind.TRANSFER_COMPLETED, handoff_id)

    @classmethod
    def failed(cls, handoff_id: int) -> "HandoffFact":
        return cls(FactKind.FAILED, handoff_id)

    @classmethod
    def timed_out(cls, handoff_id: int) -> "HandoffFact":
        return cls(FactKind.TIMED_OUT, handoff_id)

    @classmethod
    def canceled(cls, handoff_id: int) -> "HandoffFact":
        return cls(FactKind.CANCELED, handoff_id)


@dataclass(frozen=True)
class ActionOutcome:
    kind: OutcomeKind
    message: str | None = None  # only for Failed

    @classmethod
    def failed(cls, message: str) -> "ActionOutcome":
        return cls(OutcomeKind.FAILED, message)


class HandoffCoordinator:
    """One handoff's coordinator; a thin view of one row of a ``HandoffState``."""

    def __init__(
        self,
        handoff_id: int,
        order: HandoffOrder,
        fallback_transfer_delay_ms: float = 0.0,
        *,
        state: HandoffState | None = None,
        simulation: int = 0,
    ):
        self.state = HandoffState(capacity=1) if state is None else state
        self.handoff_id = int(handoff_id)
        self.row = int(add_handoffs(self.state, [handoff_id], [order], fallback_transfer_delay_ms, simulation)[0])

    def start(self) -> list[IssuedHandoffAction]:
        return apply_start(self.state, [self.row]).to_list()

    def on_fact(self, fact: HandoffFact) -> list[IssuedHandoffAction]:
        timing = None
        if fact.kind == FactKind.SOURCE_HELD:
            if fact.transfer_timing is None:
                raise ValueError(f"handoff {fact.handoff_id}: SourceHeld needs a transfer_timing")
            timing = fact.transfer_timing.as_arrays()
        tokens = None
        if fact.kind == FactKind.DESTINATION_RESERVED:
            if fact.transferable_prompt_tokens is None:
                raise ValueError(f"handoff {fact.handoff_id}: DestinationReserved needs transferable_prompt_tokens")
            tokens = [fact.transferable_prompt_tokens]
        return apply_facts(
            self.state,
            [self.row],
            [fact.kind],
            timing=timing,
            transferable_prompt_tokens=tokens,
            handoff_ids=[fact.handoff_id],
        ).to_list()

    def on_action_outcome(self, action_id: int, outcome: "ActionOutcome | OutcomeKind") -> list[IssuedHandoffAction]:
        if not isinstance(outcome, ActionOutcome):
            outcome = ActionOutcome(OutcomeKind(outcome))
        code = -1
        if outcome.kind == OutcomeKind.FAILED:
            code = self.state.intern_message(outcome.message or "")
        return apply_outcomes(self.state, [self.row], [action_id], [outcome.kind], [code]).to_list()

    def is_complete(self) -> bool:
        return bool(self.state.mode[self.row] == CoordinatorMode.COMPLETE)

    def completion(self) -> Completion | None:
        value = Completion(int(self.state.completion[self.row]))
        return None if value == Completion.NONE else value
