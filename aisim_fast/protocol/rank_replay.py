"""Disaggregated replay driven through the rank protocol: the handoff coordinator
(``aisim_fast.protocol.handoff.coordinator``) issues every action to prefill and decode ranks
(``aisim_fast.protocol.rank``) command by command, as the reference's replay layer does,
instead of the kernels' in-kernel coordinator (``kernels.disagg.handoff``).

Both run the same scheduler kernels and follow the same per-instant order
(spec/replay.md 1.4, ``kernels.loop.event_loop``):

1. passes ending now complete, prefill ranks first, each by rank id: actions
   deferred on that rank go back to the action queue, then its outputs and
   lifecycle events (SourceHeld -> ReserveDestination; DestinationReserved ->
   StartTransfer) reach the coordinator;
2. transfers done by now: TransferCompleted -> ActivateDestination;
3. the action queue runs in FIFO order, including the actions it issues;
   ActivateDestination and ReleaseSource / CancelSource wait while their rank has
   a pass in flight;
4. idle ranks with work start passes in rank order; a zero-duration pass completes
   at once and its rank goes again; a pass that changed nothing parks its rank
   until a command wakes it;
5. the requests arriving now start their handoffs (SubmitPrefill);

repeated until nothing changes, then the clock jumps to the next pass end,
transfer completion or arrival. The result is the in-kernel replay's, request by
request (``tests/oracle/test_rank_replay.py`` holds it to the disaggregated goldens): a
check of both the rank API and the coordinator, and the way to put a router or
a coordinator of one's own between the ranks.

The handoff order is the backend's: SourceFirst for vLLM and TRT-LLM,
DestinationFirst for SGLang (the reservation before the prefill).

Traffic: open loop by timestamps or closed loop (``concurrency``: a session starts
when a slot is free); a session's later turn is released its think time after the
previous turn ended. Placement: round robin.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
import pandas as pd

from aisim_fast.config.payload import ConfigError
from aisim_fast.engine.frames import nullable_ints
from aisim_fast.engine.simulation import Simulation, SimulationError
from aisim_fast.engine.templates import next_turns
from aisim_fast.protocol.handoff.actions import (ActionKind, FactKind, OutcomeKind,
                                                 handoff_order_for_backend)
from aisim_fast.protocol.handoff.coordinator import (HandoffState, add_handoffs, apply_facts,
                                                     apply_outcomes, apply_start)
from aisim_fast.protocol.rank import RankGroup
from aisim_fast.protocol.types import Applied, DestinationReserved, RankError, Request, SourceHeld
from aisim_fast.trace.workload import prompt_tokens, sequence_tokens

__all__ = ["replay_through_ranks"]

_OUTCOME = {"submitted": OutcomeKind.SUBMITTED, "accepted": OutcomeKind.ACCEPTED,
            "scheduled": OutcomeKind.SCHEDULED, "applied": OutcomeKind.APPLIED, "noop": OutcomeKind.NOOP,
            "failed": OutcomeKind.FAILED}


def _check(sim: Simulation) -> None:
    if not sim.disaggregated:
        raise ConfigError("topology.kind: the rank-driven replay runs disaggregated topologies")
    if sim.placement != "round_robin":
        raise ConfigError(f"adapters.placement: the rank-driven replay places round robin, "
                          f"got {sim.placement!r}")
    if sim.workload.agentic is not None:
        raise ConfigError("trace_format: the rank-driven replay replays trace rows and sessions; an "
                          "agentic graph's requests are released by run_batch's kernels")
    if max(sim.dp_size, sim.prefill_dp_size) > 1:
        raise ConfigError("dp_size: the rank protocol has no attention-DP groups yet (one rank per "
                          "worker); run_batch replays them")


class _Requests:
    """Per-request timeline, one entry per workload row (the logical request)."""

    FLOAT = ("arrival_ms", "prefill_admit_ms", "first_token_ms", "second_token_ms", "last_token_ms",
             "completion_ms", "source_held_ms", "destination_reserved_ms", "destination_activated_ms",
             "decode_admit_ms", "source_released_ms", "transfer_done_ms")
    INT = ("output_tokens", "prefill_output_tokens", "cached_tokens", "first_admission_cached_tokens",
           "decode_cached_tokens", "prefill_admissions", "decode_admissions", "preemptions",
           "transferable_prompt_tokens", "prefill_worker", "decode_worker")

    def __init__(self, n: int):
        for name in self.FLOAT:
            setattr(self, name, np.full(n, np.nan))
        for name in self.INT:
            setattr(self, name, np.zeros(n, np.int64))
        self.transferable_prompt_tokens[:] = -1
        self.first_admission_cached_tokens[:] = -1
        self.decode_cached_tokens[:] = -1
        self.prefill_worker[:] = -1
        self.decode_worker[:] = -1
        self.status = np.full(n, "not_sent", dtype=object)


def replay_through_ranks(sim: Simulation) -> pd.DataFrame:
    """Replay a disaggregated simulation with the handoff coordinator driving prefill
    and decode ranks through the rank API; returns one row per request with the
    in-kernel replay's columns (``run_batch(...).requests``) that the rank protocol
    exposes (with a time cap, those of the requests terminal by it). Raises
    SimulationError on a dead end (requests that can never finish)."""
    _check(sim)
    wl = sim.workload
    n = wl.num_requests
    n_prefill, n_decode = sim.prefill_workers, sim.workers
    # each rank is its pool's worker of the same number (a speculating rank's sampler seed)
    group = RankGroup([sim.prefill_rank.for_worker(w) for w in range(n_prefill)]
                      + [sim.rank.for_worker(w) for w in range(n_decode)], kv_events=False)
    rec = _Requests(n)
    plan_tokens: dict = {}            # row -> (prompt, output token ids) until both sides took them

    def tokens_of(q: int):
        """Row q's prompt and output token ids (as the kernels read them), built for
        its first command (SubmitPrefill or ReserveDestination) and dropped after the
        other side's."""
        tokens = plan_tokens.pop(q, None)
        if tokens is None:
            prompt = prompt_tokens(wl, q)
            tokens = plan_tokens[q] = (prompt, sequence_tokens(wl, q, len(prompt), int(wl.output_len[q])))
        return tokens

    coord = HandoffState(capacity=n)
    # vLLM / TRT-LLM hold the source first, SGLang reserves the destination first
    add_handoffs(coord, np.arange(n), handoff_order_for_backend(sim.rank.backend), sim.handoff_latency_ms)

    actions: deque = deque()          # (row, action id, kind, delay_ms)
    deferred = [[] for _ in range(n_prefill + n_decode)]
    transfers: list = []              # heap of (done_ms, start seq, row)
    xfer_seq = 0
    pass_end = [None] * (n_prefill + n_decode)
    cursor = {"prefill": 0, "decode": 0}
    open_rows = set()
    next_turn = next_turns(wl)
    released: list = []               # heap of later turns: (ready_ms, session, turn, row)
    active_sessions = [0]             # sessions started and not ended (closed loop: at most the cap)
    closed_loop = sim.concurrency > 0

    def push(issued) -> None:
        for i in range(len(issued)):
            kind = ActionKind(int(issued.kinds[i]))
            if kind == ActionKind.COMPLETE:
                open_rows.discard(int(issued.rows[i]))
                continue
            actions.append((int(issued.rows[i]), int(issued.action_ids[i]), kind, float(issued.delay_ms[i])))

    def outcome(row: int, action_id: int, kind: str, message: str = "") -> None:
        code = coord.intern_message(message) if kind == "failed" else -1
        push(apply_outcomes(coord, [row], [action_id], [_OUTCOME[kind]], [code]))

    def fact(row: int, kind: FactKind, **extra) -> None:
        push(apply_facts(coord, [row], [kind], handoff_ids=[row], **extra))

    def lifecycle(events, now_ms: float) -> None:
        for event in events:
            row = int(event.handoff_id)
            if isinstance(event, SourceHeld):
                rec.source_held_ms[row] = now_ms
                fact(row, FactKind.SOURCE_HELD, timing=event.transfer_timing.as_arrays())
            else:
                assert isinstance(event, DestinationReserved)
                rec.destination_reserved_ms[row] = now_ms
                rec.transferable_prompt_tokens[row] = event.transferable_prompt_tokens
                fact(row, FactKind.DESTINATION_RESERVED,
                     transferable_prompt_tokens=[event.transferable_prompt_tokens])

    def terminal(row: int, status: str, now_ms: float) -> None:
        """The request ended: its session's next turn is due its think time later; a
        failed turn ends the session (later turns are never sent), a rejected one
        does not (``kernels.loop.arrivals.logical_terminal``)."""
        rec.status[row] = status
        rec.completion_ms[row] = now_ms
        nxt = int(next_turn[row])
        if status == "failed":
            while nxt >= 0:
                rec.status[nxt] = "not_sent"
                nxt = int(next_turn[nxt])
        if nxt >= 0:
            heapq.heappush(released, (now_ms + float(wl.delay_ms[nxt]), int(wl.session[nxt]),
                                      int(wl.turn_index[nxt]), nxt))
        else:
            active_sessions[0] -= 1  # the session ended: a closed loop starts the next one

    def started(r: int, effects) -> None:
        prefill = r < n_prefill
        for adm in effects.admissions:
            row = adm.request_id  # a rank's request id is the request's row
            reused = adm.reused_input_tokens
            if prefill:
                if rec.prefill_admissions[row] == 0:
                    rec.prefill_admit_ms[row] = effects.start_ms
                    rec.first_admission_cached_tokens[row] = reused
                rec.prefill_admissions[row] += 1
                rec.cached_tokens[row] = max(rec.cached_tokens[row], reused)
            else:
                if rec.decode_admissions[row] == 0:
                    rec.decode_admit_ms[row] = effects.start_ms
                rec.decode_admissions[row] += 1
                rec.decode_cached_tokens[row] = max(rec.decode_cached_tokens[row], reused)
        for event in effects.pressure_events:
            rec.preemptions[event.request_id] += 1

    def completed(r: int, now_ms: float) -> bool:
        """Pass end of rank r at now: deferred actions back to the queue, then its
        outputs and lifecycle events. Returns whether a destination was reserved."""
        pass_end[r] = None
        effects = group.complete_passes([r])[0]
        for item in deferred[r]:
            actions.append(item)
        deferred[r].clear()
        for out in effects.outputs:
            row = out.request_id
            if r < n_prefill:
                if out.rejected:
                    terminal(row, "rejected", now_ms)
                    fact(row, FactKind.FAILED)
                elif out.token_id is not None:
                    rec.prefill_output_tokens[row] += 1
                continue
            if out.token_id is not None:
                k = rec.output_tokens[row]
                if k == 0:
                    rec.first_token_ms[row] = now_ms
                elif k == 1:
                    rec.second_token_ms[row] = now_ms
                rec.last_token_ms[row] = now_ms
                rec.output_tokens[row] = k + 1
            if out.completed:
                terminal(row, "rejected" if out.rejected else "completed", now_ms)
        lifecycle(effects.lifecycle_events, now_ms)
        return any(isinstance(e, DestinationReserved) for e in effects.lifecycle_events)

    def run_action(row: int, action_id: int, kind: ActionKind, delay_ms: float, now_ms: float) -> None:
        nonlocal xfer_seq
        if kind == ActionKind.SUBMIT_PREFILL:
            r = cursor["prefill"]
            cursor["prefill"] = (r + 1) % n_prefill
            prompt, out = tokens_of(row)
            request = Request(row, prompt, 1, output_token_ids=out[:1] if len(out) else None)
            group.submit([r], [request], now_ms, handoff_ids=[row])
            rec.prefill_worker[row] = r
            outcome(row, action_id, "submitted")
        elif kind == ActionKind.RESERVE_DESTINATION:
            r = n_prefill + cursor["decode"]
            cursor["decode"] = (cursor["decode"] + 1) % n_decode
            prompt, out = tokens_of(row)
            request = Request(row, prompt, len(out), output_token_ids=out)
            try:
                effects = group.reserve_destinations([r], [row], [request], now_ms)[0]
            except RankError as exc:  # the destination can never hold the prompt
                terminal(row, "failed", now_ms)
                outcome(row, action_id, "failed", str(exc))
                return
            rec.decode_worker[row] = r - n_prefill
            outcome(row, action_id, "accepted")
            lifecycle(effects.lifecycle_events, now_ms)
        elif kind == ActionKind.START_TRANSFER:
            outcome(row, action_id, "scheduled")
            if delay_ms > 0.0:
                heapq.heappush(transfers, (now_ms + delay_ms, xfer_seq, row))
                xfer_seq += 1
            else:
                rec.transfer_done_ms[row] = now_ms
                fact(row, FactKind.TRANSFER_COMPLETED)
        elif kind == ActionKind.ACTIVATE_DESTINATION:
            r = n_prefill + int(rec.decode_worker[row])
            if pass_end[r] is not None:
                deferred[r].append((row, action_id, kind, delay_ms))
                return
            effects = group.activate_destinations([r], [row], now_ms)[0]
            rec.destination_activated_ms[row] = now_ms
            outcome(row, action_id, "applied" if isinstance(effects.result, Applied) else "noop")
            lifecycle(effects.lifecycle_events, now_ms)
        elif kind in (ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE):
            r = int(rec.prefill_worker[row])  # prefill ranks come first: a worker is its rank
            if r < 0:
                outcome(row, action_id, "noop")
                return
            if pass_end[r] is not None:
                deferred[r].append((row, action_id, kind, delay_ms))
                return
            effects = group.release_sources([r], [row], now_ms, cancel=kind == ActionKind.CANCEL_SOURCE)[0]
            applied = isinstance(effects.result, Applied)
            if kind == ActionKind.RELEASE_SOURCE:
                rec.source_released_ms[row] = now_ms
            outcome(row, action_id, "applied" if applied else "noop")
        elif kind == ActionKind.CANCEL_DESTINATION:
            r = n_prefill + int(rec.decode_worker[row])
            applied = False
            if r >= n_prefill:  # else never accepted
                effects = group.activate_destinations([r], [row], now_ms, cancel=True)[0]
                applied = isinstance(effects.result, Applied)
            outcome(row, action_id, "applied" if applied else "noop")
        else:
            raise AssertionError(f"unexpected handoff action {kind!r}")

    order = np.asarray(wl.order, np.int64)
    start_ms = np.asarray(wl.start_ms, np.float64)
    next_arrival = 0
    n_ranks = n_prefill + n_decode
    sglang = sim.rank.backend == "sglang"
    now_ms = 0.0
    while True:
        changed = True
        while changed:
            changed = False
            # 1. passes ending now, in rank order (prefill ranks first)
            for r in range(n_ranks):
                if pass_end[r] is not None and pass_end[r] == now_ms:
                    completed(r, now_ms)
                    changed = True
            # 2. transfers done by now
            while transfers and transfers[0][0] <= now_ms:
                done_ms, _, row = heapq.heappop(transfers)
                rec.transfer_done_ms[row] = done_ms
                fact(row, FactKind.TRANSFER_COMPLETED)
                changed = True
            # 3. the action queue, actions it issues included
            while actions:
                run_action(*actions.popleft(), now_ms)
                changed = True
            # 4. idle ranks with work start passes, in rank order
            for r in range(n_ranks):
                while pass_end[r] is None and not group.stalled(r) and group.has_work(r):
                    effects = group.start_passes([r], now_ms)[0]
                    started(r, effects)
                    had_effect = group.pass_had_effect(r)
                    pass_end[r] = effects.end_ms
                    if effects.end_ms == now_ms:
                        # a reservation at a zero-duration pass's end is an effect
                        had_effect = completed(r, now_ms) or had_effect
                    if not had_effect:
                        if sglang and effects.end_ms == now_ms and group.effect_free_pass_gives_up(r):
                            raise SimulationError(f"dead end at {now_ms} ms: SGLang rank {r}'s passes change "
                                                  "nothing at one instant (rank-driven replay)")
                        group.park(r)  # until a command wakes it
                        break
                    changed = True
            # 5. this instant's arrivals start their handoffs: first turns by start
            # time, later turns by release time, in (time, session, turn) order
            arriving = []
            while True:
                start = None
                if next_arrival < len(order):
                    q = int(order[next_arrival])
                    if closed_loop:  # a session starts when a slot is free, at once
                        if active_sessions[0] < sim.concurrency:
                            start = (now_ms, int(wl.session[q]), 0, q)
                    elif start_ms[q] <= now_ms:
                        start = (float(start_ms[q]), int(wl.session[q]), 0, q)
                turn = released[0] if released and released[0][0] <= now_ms else None
                if start is None and turn is None:
                    break
                if turn is None or (start is not None and start < turn):
                    next_arrival += 1
                    active_sessions[0] += 1
                    t_ms, _, _, q = start
                else:
                    t_ms, _, _, q = heapq.heappop(released)
                rec.arrival_ms[q] = t_ms
                rec.status[q] = "in_flight"
                arriving.append(q)
            if arriving:
                open_rows.update(arriving)
                push(apply_start(coord, np.asarray(arriving, np.int64)))
                changed = True
        if next_arrival == len(order) and not released and not open_rows \
                and not (rec.status == "in_flight").any():
            break
        candidates = [t for t in pass_end if t is not None]
        if transfers:
            candidates.append(transfers[0][0])
        if next_arrival < len(order) and not closed_loop:
            candidates.append(start_ms[order[next_arrival]])
        if released:
            candidates.append(released[0][0])
        if not candidates:
            stuck = int((rec.status == "in_flight").sum())
            raise SimulationError(f"dead end at {now_ms} ms: {stuck} requests in flight can never finish "
                                  "(rank-driven replay)")
        if sim.max_sim_time_ms is not None and min(candidates) > sim.max_sim_time_ms:
            break  # every instant up to the time cap is drained
        now_ms = min(candidates)
    frame = _frame(sim, rec)
    if sim.max_sim_time_ms is not None:
        # the requests terminal by the cap, indexed by trace row (as run_batch keeps them)
        frame = frame[frame["completion_ms"].to_numpy(np.float64) <= sim.max_sim_time_ms]
    return frame


def _frame(sim: Simulation, rec: _Requests) -> pd.DataFrame:
    wl = sim.workload
    n_out = rec.output_tokens
    with np.errstate(invalid="ignore"):
        tpot = np.where(n_out >= 2, (rec.last_token_ms - rec.first_token_ms) / np.maximum(n_out - 1, 1), np.nan)
    def optional(v):
        return nullable_ints(v, v >= 0)
    admissions = rec.prefill_admissions + rec.decode_admissions
    frame = pd.DataFrame({
        "request_id": wl.request_name,
        "trace_line": wl.line_no,
        "turn_index": wl.turn_index.astype(np.int64),
        "arrival_ms": rec.arrival_ms,
        "first_admit_ms": rec.prefill_admit_ms,
        "first_token_ms": rec.first_token_ms,
        "second_token_ms": rec.second_token_ms,
        "last_token_ms": rec.last_token_ms,
        "completion_ms": rec.completion_ms,
        "ttft_ms": rec.first_token_ms - rec.arrival_ms,
        "tpot_ms": tpot,
        "e2e_ms": rec.last_token_ms - rec.arrival_ms,
        "input_tokens": wl.input_len.astype(np.int64),
        "output_tokens": n_out,
        "prefill_output_tokens": rec.prefill_output_tokens,
        "cached_tokens": rec.cached_tokens,
        "first_admission_cached_tokens": np.maximum(rec.first_admission_cached_tokens, 0),
        "prefill_worker": optional(rec.prefill_worker),
        "decode_worker": optional(rec.decode_worker),
        "prefill_admit_ms": rec.prefill_admit_ms,
        "source_held_ms": rec.source_held_ms,
        "destination_reserved_ms": rec.destination_reserved_ms,
        "destination_activated_ms": rec.destination_activated_ms,
        "decode_admit_ms": rec.decode_admit_ms,
        "source_released_ms": rec.source_released_ms,
        "transfer_done_ms": rec.transfer_done_ms,
        "transferable_prompt_tokens": rec.transferable_prompt_tokens,
        # as replay's request frame: none without a destination, or with one never
        # admitted because the prefill side rejected the prompt (SGLang reserves first)
        "decode_cached_tokens": optional(np.where(
            (rec.decode_worker >= 0) & ~((rec.decode_admissions == 0) & (rec.status == "rejected")),
            np.maximum(rec.decode_cached_tokens, 0), -1)),
        "admission_count": admissions,
        "readmission_count": np.maximum(rec.prefill_admissions - 1, 0) + np.maximum(rec.decode_admissions - 1, 0),
        "preemptions": rec.preemptions,
        "terminal_status": rec.status,
    })
    sent = rec.status != "not_sent"  # turns after a failed one: never sent, no record
    return frame[sent].reset_index(drop=True) if not sent.all() else frame
