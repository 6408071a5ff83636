"""The coordinator's check of a finished disaggregated run.

The kernels execute the handoff sequence inline (SourceFirst for vLLM and TRT-LLM,
DestinationFirst for SGLang) (one compiled event
loop per simulation: a round trip to Python per action would cost more than the
simulation). ``audit_handoffs`` then replays every handoff of a batch through the
driver's ``HandoffCoordinatorCore`` (``aisim_fast.protocol.handoff.coordinator``), all rows at once, one
step per lifecycle fact or outcome, and checks that

* at every step the coordinator issues exactly the action the kernel executed next
  (SourceFirst: SubmitPrefill, ReserveDestination, StartTransfer; DestinationFirst:
  ReserveDestination, SubmitPrefill, StartTransfer; then ActivateDestination,
  ReleaseSource, and Complete with Success): the ``NEXT_ON_*`` and ``DF_NEXT_ON_*``
  tables of ``kernels.schema.layout``, which the kernels' handoff queues from;
* the transfer delay the coordinator derives from the timing frozen at SourceHeld
  and the reported ``transferable_prompt_tokens`` is the delay the kernel used
  (``transfer_done_ms`` = the later of held and reserved + delay, bit for bit);
* the kernel's lifecycle timestamps are ordered as the actions are: held <= reserved
  (SourceFirst) or reserved <= prefill admission (DestinationFirst), transfer start
  <= transfer done <= activated <= released, activated <= decode admission <= first
  decode token.

Any disagreement raises ``HandoffAuditError`` naming the simulation and request.

``conformance_record`` runs the seed's conformance fixture (one request, one hidden
prefill token, two decode tokens, one prefill and one decode worker) through the
simulator and fills ``NormalizedHandoffConformance`` from what the run recorded: the
lifecycle from the handoff journal, token counts from both rows, destination KV
visibility around activation, and whether every pool, queue and the driver drained.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from aisim_fast.config.payload import check_disaggregated_pair, parse_rank
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.schema import layout as L
from aisim_fast.protocol.handoff.actions import (ActionKind, Backend, Completion, FactKind,
                                                 HandoffOrder, OutcomeKind,
                                                 handoff_order_for_backend)
from aisim_fast.protocol.handoff.coordinator import (HandoffState, IssuedActions, add_handoffs,
                                                     apply_facts, apply_outcomes, apply_start)
from aisim_fast.protocol.handoff.conformance import (NormalizedHandoffConformance,
                                                     NormalizedHandoffEvent, NormalizedStoredTiming)
from aisim_fast.protocol.handoff.timing import TransferTimingArrays, TransferTimingMode
from aisim_fast.trace.workload import load_mooncake


class HandoffAuditError(AssertionError):
    """The kernel's handoff lifecycle disagrees with the coordinator."""


@dataclass(frozen=True)
class AuditedRun:
    """One disaggregated simulation to audit: its request frame and transfer model."""
    requests: pd.DataFrame        # the simulator's per-request frame (handoff columns)
    backend: str
    transfer_mode: str            # kv_transfer_timing_mode of the prefill ranks
    kv_bytes_per_token: float     # NaN = not configured
    bandwidth_gb_s: float         # NaN = not configured
    handoff_latency_ms: float


def audited_runs(sims, result) -> list[AuditedRun]:
    """The disaggregated simulations of a ``run_batch`` call, ready for ``audit_handoffs``."""
    runs = []
    for s, sim in enumerate(sims):
        if not sim.disaggregated:
            continue
        source = sim.prefill_rank  # the source publishes the transfer timing
        runs.append(AuditedRun(
            result.requests[s], source.backend, source.kv_transfer_timing_mode,
            np.nan if source.kv_transfer_bytes_per_token is None else source.kv_transfer_bytes_per_token,
            np.nan if source.kv_transfer_bandwidth is None else source.kv_transfer_bandwidth,
            sim.handoff_latency_ms))
    return runs


@dataclass(frozen=True)
class AuditSummary:
    handoffs: int                 # handoffs checked (completed requests)
    transfers_with_delay: int     # of those, transfers that took virtual time
    steps: int                    # batched coordinator calls


def _expect(issued: IssuedActions, rows: np.ndarray, kind: ActionKind, what: str,
            names: np.ndarray) -> np.ndarray:
    """Action ids of ``kind`` issued once per row, in row order."""
    per_row = np.zeros(len(rows), np.int64)
    pos = np.searchsorted(rows, issued.rows)
    np.add.at(per_row, pos, 1)
    wrong = (per_row != 1)
    if len(issued):
        bad_kind = issued.kinds != kind
        wrong[pos[bad_kind]] = True
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        got = [ActionKind(int(k)).name for k in issued.kinds[issued.rows == rows[i]]]
        raise HandoffAuditError(f"{names[i]}: after {what} the coordinator issued {got}, "
                                f"the kernel executed {kind.name}")
    return issued.action_ids


def _expect_none(issued: IssuedActions, what: str, names: np.ndarray) -> None:
    if len(issued):
        raise HandoffAuditError(f"{names[int(issued.rows[0])]}: {what} issued "
                                f"{ActionKind(int(issued.kinds[0])).name}; the kernel waited for a fact")


def audit_handoffs(runs: Sequence[AuditedRun]) -> AuditSummary:
    """Check every completed handoff of ``runs`` against the coordinator (see module doc)."""
    frames = []
    for s, run in enumerate(runs):
        df = run.requests
        done = df["terminal_status"].to_numpy(object) == "completed"
        frames.append(df.loc[done].assign(
            _sim=s, _mode=int(TransferTimingMode.parse(run.transfer_mode)),
            _bytes=run.kv_bytes_per_token, _bw=run.bandwidth_gb_s, _fallback=run.handoff_latency_ms,
            _order=int(handoff_order_for_backend(run.backend))))
    req = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    total = AuditSummary(0, 0, 0)
    if len(req) == 0:
        return total
    for order in (HandoffOrder.SOURCE_FIRST, HandoffOrder.DESTINATION_FIRST):
        part = req[req["_order"].to_numpy() == order].reset_index(drop=True)
        if len(part):
            one = _audit_order(part, order)
            total = AuditSummary(total.handoffs + one.handoffs,
                                 total.transfers_with_delay + one.transfers_with_delay,
                                 total.steps + one.steps)
    return total


def _audit_order(req: pd.DataFrame, order: HandoffOrder) -> AuditSummary:
    """The audit of the completed handoffs ``req``, all of one order."""
    n = len(req)
    dest_first = order == HandoffOrder.DESTINATION_FIRST
    names = np.array([f"simulation {s}, {r}" for s, r in zip(req["_sim"], req["request_id"])], object)

    def col(name):
        return req[name].to_numpy(np.float64)

    held, reserved, done_ms = col("source_held_ms"), col("destination_reserved_ms"), col("transfer_done_ms")
    activated, released = col("destination_activated_ms"), col("source_released_ms")
    admitted, first_token = col("decode_admit_ms"), col("first_token_ms")
    prefill_admitted = col("prefill_admit_ms")
    n_out = req["output_tokens"].to_numpy(np.int64)
    # the transfer starts once both the source is held and the destination reserved
    started = np.maximum(held, reserved)
    checks = [
        ("destination_reserved_ms <= prefill_admit_ms", reserved <= prefill_admitted) if dest_first
        else ("source_held_ms <= destination_reserved_ms", held <= reserved),
        ("transfer start <= transfer_done_ms", started <= done_ms),
        ("transfer_done_ms <= destination_activated_ms", done_ms <= activated),
        ("destination_activated_ms <= source_released_ms", activated <= released),
        ("destination_activated_ms <= decode_admit_ms", activated <= admitted),
        ("decode_admit_ms <= first_token_ms", (n_out == 0) | (admitted <= first_token)),
    ]
    for rule, ok in checks:
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise HandoffAuditError(f"{names[i]}: kernel lifecycle breaks {rule}")

    state = HandoffState(capacity=n)
    rows = add_handoffs(state, np.arange(n), req["_order"].to_numpy(np.int64),
                        req["_fallback"].to_numpy(np.float64), req["_sim"].to_numpy(np.int64))
    steps = 0

    def outcome(ids, kind):
        nonlocal steps
        steps += 1
        return apply_outcomes(state, rows, ids, kind)

    def fact(kind, **kw):
        nonlocal steps
        steps += 1
        return apply_facts(state, rows, kind, **kw)

    timing = TransferTimingArrays(
        mode=req["_mode"].to_numpy(np.int64),
        full_prompt_tokens=req["input_tokens"].to_numpy(np.int64),
        kv_bytes_per_token=req["_bytes"].to_numpy(np.float64),
        bandwidth_gb_s=req["_bw"].to_numpy(np.float64))
    transferable = req["transferable_prompt_tokens"].to_numpy(np.int64)
    steps += 1
    started_ids = apply_start(state, rows)
    if dest_first:
        # DestinationFirst: reserve, then submit the prefill, then transfer once held
        ids = _expect(started_ids, rows, ActionKind(L.DF_NEXT_ON_ARRIVAL), "start", names)
        _expect_none(outcome(ids, OutcomeKind.ACCEPTED), "Accepted", names)
        ids = _expect(fact(FactKind.DESTINATION_RESERVED, transferable_prompt_tokens=transferable), rows,
                      ActionKind(L.DF_NEXT_ON_DESTINATION_RESERVED), "DestinationReserved", names)
        _expect_none(outcome(ids, OutcomeKind.SUBMITTED), "Submitted", names)
        issued = fact(FactKind.SOURCE_HELD, timing=timing)
        ids = _expect(issued, rows, ActionKind(L.DF_NEXT_ON_SOURCE_HELD), "SourceHeld", names)
    else:
        ids = _expect(started_ids, rows, ActionKind(L.NEXT_ON_ARRIVAL), "start", names)
        _expect_none(outcome(ids, OutcomeKind.SUBMITTED), "Submitted", names)
        ids = _expect(fact(FactKind.SOURCE_HELD, timing=timing), rows,
                      ActionKind(L.NEXT_ON_SOURCE_HELD), "SourceHeld", names)
        _expect_none(outcome(ids, OutcomeKind.ACCEPTED), "Accepted", names)
        issued = fact(FactKind.DESTINATION_RESERVED, transferable_prompt_tokens=transferable)
        ids = _expect(issued, rows, ActionKind(L.NEXT_ON_DESTINATION_RESERVED), "DestinationReserved", names)
    delay_ms = issued.delay_ms
    same = done_ms == started + delay_ms
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise HandoffAuditError(
            f"{names[i]}: the kernel's transfer ended at {done_ms[i]!r} ms, the coordinator's delay "
            f"{delay_ms[i]!r} ms after its start at {started[i]!r} ms gives "
            f"{started[i] + delay_ms[i]!r}")
    _expect_none(outcome(ids, OutcomeKind.SCHEDULED), "Scheduled", names)
    ids = _expect(fact(FactKind.TRANSFER_COMPLETED), rows, ActionKind(L.NEXT_ON_TRANSFER_COMPLETED),
                  "TransferCompleted", names)
    ids = _expect(outcome(ids, OutcomeKind.APPLIED), rows, ActionKind(L.NEXT_ON_DESTINATION_ACTIVATED),
                  "ActivateDestination Applied", names)
    _expect(outcome(ids, OutcomeKind.APPLIED), rows, ActionKind(L.NEXT_ON_SOURCE_RELEASED),
            "ReleaseSource Applied", names)
    finished = state.completion == Completion.SUCCESS
    if not finished.all():
        i = int(np.flatnonzero(~finished)[0])
        raise HandoffAuditError(f"{names[i]}: the coordinator did not complete with Success")
    return AuditSummary(handoffs=n, transfers_with_delay=int((delay_ms > 0).sum()), steps=steps)


# The fixture: a two-block prompt (block size 16), two decode tokens, fixed timing.
FIXTURE_PROMPT_TOKENS = 32
FIXTURE_OUTPUT_TOKENS = 2
FIXTURE_BLOCK_SIZE = 16


def conformance_record(backend: str = "vllm") -> NormalizedHandoffConformance:
    """Run the conformance fixture on ``backend`` and describe it as the seed does."""

    ranks = {role: parse_rank({"backend": backend, "block_size": FIXTURE_BLOCK_SIZE,
                               "num_gpu_blocks": 64, "worker_type": role,
                               "timing_model": {"type": "fixed", "prefill_ms": 10.0,
                                                "decode_ms": 5.0}}, f"fixture.{role}")
             for role in ("prefill", "decode")}
    check_disaggregated_pair(ranks["prefill"], ranks["decode"], "fixture.decode")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "fixture.jsonl"
        trace.write_text(json.dumps({"timestamp": 0, "input_length": FIXTURE_PROMPT_TOKENS,
                                     "output_length": FIXTURE_OUTPUT_TOKENS,
                                     "hash_ids": [1, 2]}) + "\n")
        workload = load_mooncake(trace, trace_block_size=FIXTURE_BLOCK_SIZE)
    sim = Simulation(workload, ranks["decode"], 1, prefill_rank=ranks["prefill"], prefill_workers=1)
    result = run_batch([sim], record_handoffs=True).check()
    audit_handoffs(audited_runs([sim], result))
    request = result.requests[0].iloc[0]
    journal = result.handoffs[0]
    names = list(journal["event"])
    activated = journal[journal["event"] == "DestinationActivated"]
    left = result.leftovers[0]
    return NormalizedHandoffConformance(
        engine_type=Backend(backend),
        order=handoff_order_for_backend(backend),
        lifecycle=[NormalizedHandoffEvent(name) for name in names],
        source_output_tokens=int(request["prefill_output_tokens"]),
        destination_output_tokens=int(request["output_tokens"]),
        completed_requests=int((result.requests[0]["terminal_status"] == "completed").sum()),
        destination_stored=NormalizedStoredTiming(
            before_activation=int(activated["blocks_visible_before"].sum()),
            on_activation=int(activated["blocks"].sum()),
            repeated_activation_hashes_after_activation=int(request["decode_republished_prompt_blocks"])),
        source_drained=bool(left["active_blocks"][0] == 0 and left["queued_requests"][0] == 0),
        destination_drained=bool(left["active_blocks"][1] == 0 and left["queued_requests"][1] == 0
                                 and left["pending_destinations"][1] == 0),
        driver_drained=(left["open_handoffs"] == 0 and left["queued_actions"] == 0
                        and left["transfers_in_flight"] == 0),
    )
