"""Tests for aisim_fast.protocol.handoff.coordinator: transfer timing, the batched coordinator, conformance record."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings, strategies as st

from aisim_fast.protocol.handoff.actions import (ActionKind, Backend, Completion, CoordinatorMode,
                                                 FactKind, HandoffOrder, OutcomeKind,
                                                 handoff_order_for_backend)
from aisim_fast.protocol.handoff.coordinator import (ActionOutcome, HandoffCoordinator,
                                                     HandoffError, HandoffFact, HandoffState,
                                                     add_handoffs, apply_facts, apply_outcomes,
                                                     apply_start, pending_action_mask)
from aisim_fast.protocol.handoff.timing import (HandoffTransferTiming, TransferTimingArrays,
                                                TransferTimingError, TransferTimingMode,
                                                prefill_handoff_delay_ms, resolve_transfer_delay_ms,
                                                transfer_delay_ms, validate_transfer_delay_ms,
                                                validate_transfer_timing)
from aisim_fast.protocol.handoff.conformance import (NormalizedHandoffConformance,
                                                     NormalizedHandoffEvent, NormalizedStoredTiming,
                                                     expected_normalized_handoff)

SF = HandoffOrder.SOURCE_FIRST
DF = HandoffOrder.DESTINATION_FIRST
A = ActionKind
O = OutcomeKind

# ---------------------------------------------------------------------------
# Transfer timing (seed 001 unit tests and spec examples)
# ---------------------------------------------------------------------------


def test_handoff_id_round_trips_caller_owned_value():
    coordinator = HandoffCoordinator(17, SF)
    assert coordinator.state.handoff_id[coordinator.row] == 17
    (submit,) = coordinator.start()
    assert submit.handoff_id == 17


def test_transfer_delay_uses_selected_prompt_footprint():
    timing = HandoffTransferTiming(
        mode=TransferTimingMode.DESTINATION_MISSING,
        full_prompt_tokens=100,
        kv_bytes_per_token=1_000,
        bandwidth_gb_s=1.0,
    )
    assert timing.delay_ms(20) == 0.02
    assert timing.full_prompt_delay_ms() == 0.1


def test_incomplete_or_non_positive_timing_model_has_no_delay():
    timing = HandoffTransferTiming(
        mode=TransferTimingMode.FULL_PROMPT, full_prompt_tokens=100, kv_bytes_per_token=None, bandwidth_gb_s=1.0
    )
    assert timing.delay_ms(0) is None
    timing = HandoffTransferTiming(
        mode=TransferTimingMode.FULL_PROMPT, full_prompt_tokens=100, kv_bytes_per_token=1_000, bandwidth_gb_s=0.0
    )
    assert timing.delay_ms(0) is None
    timing = HandoffTransferTiming(full_prompt_tokens=100, kv_bytes_per_token=1_000, bandwidth_gb_s=None)
    assert timing.delay_ms(0) is None


def test_prefill_handoff_delay_requires_completed_prefill_work():
    args = (128, 1.0, 1_000_000)
    assert prefill_handoff_delay_ms("prefill", True, *args) == 128.0
    assert prefill_handoff_delay_ms("prefill", False, *args) is None
    assert prefill_handoff_delay_ms("decode", True, *args) is None
    assert prefill_handoff_delay_ms("aggregated", True, *args) is None


def test_spec_example_64_tokens_at_1_gb_s_is_64_ms():
    timing = HandoffTransferTiming(full_prompt_tokens=64, kv_bytes_per_token=1_000_000, bandwidth_gb_s=1.0)
    assert timing.delay_ms() == 64.0


def test_spec_golden_905_tokens_at_25_gb_s():
    timing = HandoffTransferTiming(full_prompt_tokens=905, kv_bytes_per_token=163_840, bandwidth_gb_s=25.0)
    delay_ms = timing.delay_ms()
    # Bit-equal to the reference's f64 evaluation order, no rounding.
    assert delay_ms == 905 * 163_840 / (25.0 * 1e9) * 1000.0
    assert delay_ms == pytest.approx(5.931008, abs=1e-12)
    # Activation time of request_1 in 1k_vllm_disagg1p2d_bw is the plain f64 sum.
    assert 30.587242 + delay_ms == 36.51825


def test_destination_missing_uses_block_rounded_transferable_tokens():
    # A cold 905-token prompt with 64-token blocks transfers 960 tokens.
    timing = HandoffTransferTiming(
        mode="destination_missing", full_prompt_tokens=905, kv_bytes_per_token=163_840, bandwidth_gb_s=25.0
    )
    assert timing.delay_ms(960) == 960 * 163_840 / (25.0 * 1e9) * 1000.0
    assert timing.delay_ms(0) == 0.0


def test_state_bytes_are_added_per_request():
    timing = HandoffTransferTiming(full_prompt_tokens=10, kv_bytes_per_token=100, bandwidth_gb_s=1.0, state_bytes=500)
    assert timing.delay_ms() == (10 * 100 + 500) / 1e9 * 1000.0


def test_vectorised_delay_matches_scalar_form_elementwise():
    rng = np.random.default_rng(7)
    n = 200
    mode = rng.integers(0, 2, n)
    full = rng.integers(0, 5000, n)
    kv = np.where(rng.random(n) < 0.2, np.nan, rng.integers(0, 2_000_000, n).astype(float))
    bw = np.where(rng.random(n) < 0.2, np.nan, np.where(rng.random(n) < 0.1, 0.0, rng.uniform(0.1, 100, n)))
    missing = rng.integers(0, 5000, n)
    delays = transfer_delay_ms(TransferTimingArrays(mode, full, kv, bw), missing)
    for i in range(n):
        scalar = HandoffTransferTiming(
            mode=TransferTimingMode(int(mode[i])),
            full_prompt_tokens=int(full[i]),
            kv_bytes_per_token=None if np.isnan(kv[i]) else int(kv[i]),
            bandwidth_gb_s=None if np.isnan(bw[i]) else float(bw[i]),
        ).delay_ms(int(missing[i]))
        if scalar is None:
            assert np.isnan(delays[i])
        else:
            assert delays[i] == scalar
    resolved = resolve_transfer_delay_ms(delays, 7.5)
    assert np.all(resolved[np.isnan(delays)] == 7.5)
    assert np.array_equal(resolved[~np.isnan(delays)], delays[~np.isnan(delays)])


@pytest.mark.parametrize("bandwidth_gb_s", [-1.0, float("nan"), float("inf"), float("-inf")])
def test_negative_or_non_finite_bandwidth_is_rejected(bandwidth_gb_s):
    timing = HandoffTransferTiming(
        mode=TransferTimingMode.FULL_PROMPT, full_prompt_tokens=10, kv_bytes_per_token=1024, bandwidth_gb_s=bandwidth_gb_s
    )
    with pytest.raises(TransferTimingError, match="bandwidth_gb_s"):
        validate_transfer_timing(timing)
    with pytest.raises(TransferTimingError, match="bandwidth_gb_s"):
        timing.delay_ms()


def test_vectorised_validation_names_offending_elements():
    timing = TransferTimingArrays(
        mode=[0, 0, 0, 1],
        full_prompt_tokens=[10, -1, 10, 10],
        kv_bytes_per_token=[1.0, 1.0, -5.0, 1.0],
        bandwidth_gb_s=[-2.0, 1.0, 1.0, 1.0],
    )
    with pytest.raises(TransferTimingError) as info:
        transfer_delay_ms(timing, [0, 0, 0, -3])
    assert info.value.indices.tolist() == [0, 1, 2]
    message = str(info.value)
    assert "[0] invalid handoff transfer bandwidth_gb_s -2.0" in message
    assert "[1] invalid handoff transfer full_prompt_tokens -1" in message
    assert "[2] invalid handoff transfer kv_bytes_per_token -5.0" in message
    ok = TransferTimingArrays(mode=[1], full_prompt_tokens=[10], kv_bytes_per_token=[1.0], bandwidth_gb_s=[1.0])
    with pytest.raises(TransferTimingError, match="destination_missing_tokens -3"):
        transfer_delay_ms(ok, [-3])


def test_invalid_transfer_delay_is_rejected():
    validate_transfer_delay_ms(None)
    validate_transfer_delay_ms(0.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(TransferTimingError, match="invalid handoff transfer delay"):
            validate_transfer_delay_ms(bad)
    # A denormal bandwidth is finite and positive but overflows the delay.
    overflowing = HandoffTransferTiming(full_prompt_tokens=10**6, kv_bytes_per_token=10**6, bandwidth_gb_s=1e-320)
    with pytest.raises(TransferTimingError, match="invalid handoff transfer delay inf"):
        validate_transfer_timing(overflowing)


def test_zero_bandwidth_is_valid_and_means_no_model():
    validate_transfer_timing(HandoffTransferTiming(full_prompt_tokens=10, kv_bytes_per_token=1024, bandwidth_gb_s=0.0))


def test_timing_mode_parses_engine_arg_spelling():
    assert TransferTimingMode.parse("full_prompt") is TransferTimingMode.FULL_PROMPT
    assert TransferTimingMode.parse("destination_missing") is TransferTimingMode.DESTINATION_MISSING
    assert TransferTimingMode.DESTINATION_MISSING.wire_name == "destination_missing"
    with pytest.raises(ValueError, match="kv_transfer_timing_mode"):
        TransferTimingMode.parse("half_prompt")


# ---------------------------------------------------------------------------
# Coordinator helpers
# ---------------------------------------------------------------------------

HID = 42
TIMING_7_5 = HandoffTransferTiming(
    mode=TransferTimingMode.DESTINATION_MISSING, full_prompt_tokens=10, kv_bytes_per_token=None, bandwidth_gb_s=None
)
TIMING_64MS = HandoffTransferTiming(full_prompt_tokens=64, kv_bytes_per_token=1_000_000, bandwidth_gb_s=1.0)


def kinds(actions):
    return [a.kind for a in actions]


def start_transfer_delay(timing: HandoffTransferTiming, fallback_ms: float) -> float:
    """Seed helper: drive a SourceFirst handoff to StartTransfer and return its delay."""
    coordinator = HandoffCoordinator(1, SF, fallback_ms)
    (submit,) = coordinator.start()
    assert submit.kind == A.SUBMIT_PREFILL
    assert coordinator.on_action_outcome(submit.id, O.SUBMITTED) == []
    (reserve,) = coordinator.on_fact(HandoffFact.source_held(1, timing))
    assert reserve.kind == A.RESERVE_DESTINATION
    assert coordinator.on_action_outcome(reserve.id, O.ACCEPTED) == []
    (transfer,) = coordinator.on_fact(HandoffFact.destination_reserved(1, 3))
    assert transfer.kind == A.START_TRANSFER
    return transfer.delay_ms


def test_missing_or_zero_bandwidth_uses_configured_fallback():
    assert start_transfer_delay(TIMING_7_5, 7.5) == 7.5
    zero_bandwidth = HandoffTransferTiming(
        mode=TransferTimingMode.DESTINATION_MISSING, full_prompt_tokens=10, kv_bytes_per_token=1024, bandwidth_gb_s=0.0
    )
    validate_transfer_timing(zero_bandwidth)
    assert start_transfer_delay(zero_bandwidth, 7.5) == 7.5


def test_start_transfer_carries_modelled_delay():
    assert start_transfer_delay(TIMING_64MS, 7.5) == 64.0
    dm = HandoffTransferTiming(
        mode=TransferTimingMode.DESTINATION_MISSING, full_prompt_tokens=64, kv_bytes_per_token=1_000_000, bandwidth_gb_s=1.0
    )
    # Destination-missing mode charges the 3 transferable tokens reported at reservation.
    assert start_transfer_delay(dm, 7.5) == 3.0


# Happy-path scripts: (event, argument).  "outcome" events name the action kind
# whose latest issued id receives the outcome.
HAPPY = {
    SF: [
        ("start", None),
        ("outcome", (A.SUBMIT_PREFILL, O.SUBMITTED)),
        ("fact", HandoffFact.source_held(HID, TIMING_64MS)),
        ("outcome", (A.RESERVE_DESTINATION, O.ACCEPTED)),
        ("fact", HandoffFact.destination_reserved(HID, 64)),
        ("outcome", (A.START_TRANSFER, O.SCHEDULED)),
        ("fact", HandoffFact.transfer_completed(HID)),
        ("outcome", (A.ACTIVATE_DESTINATION, O.APPLIED)),
        ("outcome", (A.RELEASE_SOURCE, O.APPLIED)),
    ],
    DF: [
        ("start", None),
        ("outcome", (A.RESERVE_DESTINATION, O.ACCEPTED)),
        ("fact", HandoffFact.destination_reserved(HID, 64)),
        ("outcome", (A.SUBMIT_PREFILL, O.SUBMITTED)),
        ("fact", HandoffFact.source_held(HID, TIMING_64MS)),
        ("outcome", (A.START_TRANSFER, O.SCHEDULED)),
        ("fact", HandoffFact.transfer_completed(HID)),
        ("outcome", (A.ACTIVATE_DESTINATION, O.APPLIED)),
        ("outcome", (A.RELEASE_SOURCE, O.APPLIED)),
    ],
}

# Actions issued by each happy-path step.
HAPPY_ISSUED = {
    SF: [
        [A.SUBMIT_PREFILL],
        [],
        [A.RESERVE_DESTINATION],
        [],
        [A.START_TRANSFER],
        [],
        [A.ACTIVATE_DESTINATION],
        [A.RELEASE_SOURCE],
        [A.COMPLETE],
    ],
    DF: [
        [A.RESERVE_DESTINATION],
        [],
        [A.SUBMIT_PREFILL],
        [],
        [A.START_TRANSFER],
        [],
        [A.ACTIVATE_DESTINATION],
        [A.RELEASE_SOURCE],
        [A.COMPLETE],
    ],
}


class Driver:
    """A coordinator plus the id of every action it issued, by kind."""

    def __init__(self, order, fallback_ms=0.0, state=None, handoff_id=HID):
        self.coordinator = HandoffCoordinator(handoff_id, order, fallback_ms, state=state)
        self.order = order
        self.ids: dict[ActionKind, int] = {}
        self.issued = []

    def record(self, actions):
        for action in actions:
            self.ids[action.kind] = action.id
        self.issued.extend(actions)
        return actions

    def step(self, event, arg):
        c = self.coordinator
        if event == "start":
            return self.record(c.start())
        if event == "fact":
            return self.record(c.on_fact(dataclasses.replace(arg, handoff_id=c.handoff_id)))
        kind, outcome = arg
        return self.record(c.on_action_outcome(self.ids[kind], outcome))

    def run_to(self, stage):
        for event, arg in HAPPY[self.order][:stage]:
            self.step(event, arg)
        return self


@pytest.mark.parametrize("order", [SF, DF])
def test_happy_path_issues_each_action_once_with_increasing_ids(order):
    driver = Driver(order)
    for (event, arg), expected in zip(HAPPY[order], HAPPY_ISSUED[order]):
        assert not driver.coordinator.is_complete()
        assert kinds(driver.step(event, arg)) == expected
    assert [a.id for a in driver.issued] == list(range(6))
    assert all(a.handoff_id == HID for a in driver.issued)
    assert driver.coordinator.is_complete()
    assert driver.coordinator.completion() == Completion.SUCCESS
    transfer = next(a for a in driver.issued if a.kind == A.START_TRANSFER)
    assert transfer.delay_ms == 64.0
    assert all(a.delay_ms is None for a in driver.issued if a.kind != A.START_TRANSFER)


def test_release_noop_outcome_also_completes():
    driver = Driver(SF).run_to(8)
    assert kinds(driver.coordinator.on_action_outcome(driver.ids[A.RELEASE_SOURCE], O.NOOP)) == [A.COMPLETE]
    assert driver.coordinator.completion() == Completion.SUCCESS


def test_backend_orders():
    assert handoff_order_for_backend("vllm") == SF
    assert handoff_order_for_backend(Backend.TRTLLM) == SF
    assert handoff_order_for_backend("sglang") == DF


@pytest.mark.parametrize("order", [SF, DF])
def test_start_is_idempotent(order):
    driver = Driver(order)
    assert len(driver.step("start", None)) == 1
    assert driver.coordinator.start() == []


def test_repeated_facts_are_noops():
    driver = Driver(SF).run_to(3)
    state_before = driver.coordinator.state.copy()
    # A repeated SourceHeld is ignored before its timing is looked at, even invalid timing.
    bad = HandoffTransferTiming(full_prompt_tokens=1, kv_bytes_per_token=1, bandwidth_gb_s=-1.0)
    assert driver.coordinator.on_fact(HandoffFact.source_held(HID, bad)) == []
    assert driver.coordinator.on_fact(HandoffFact.source_held(HID, TIMING_7_5)) == []
    assert driver.coordinator.state.equals(state_before)
    driver.step(*HAPPY[SF][3])
    driver.step(*HAPPY[SF][4])
    state_before = driver.coordinator.state.copy()
    assert driver.coordinator.on_fact(HandoffFact.destination_reserved(HID, 999)) == []
    assert driver.coordinator.state.equals(state_before)
    driver.step(*HAPPY[SF][5])
    driver.step(*HAPPY[SF][6])
    state_before = driver.coordinator.state.copy()
    assert driver.coordinator.on_fact(HandoffFact.transfer_completed(HID)) == []
    assert driver.coordinator.state.equals(state_before)


def test_repeated_identical_outcome_is_noop():
    driver = Driver(SF).run_to(2)
    state_before = driver.coordinator.state.copy()
    assert driver.coordinator.on_action_outcome(driver.ids[A.SUBMIT_PREFILL], O.SUBMITTED) == []
    assert driver.coordinator.state.equals(state_before)


def test_facts_outside_active_mode_are_ignored_without_checks():
    driver = Driver(SF).run_to(1)
    assert kinds(driver.coordinator.on_fact(HandoffFact.canceled(HID))) == [A.CANCEL_SOURCE]
    state_before = driver.coordinator.state.copy()
    # Preconditions are not checked while cleaning up.
    for fact in (
        HandoffFact.source_held(HID, TIMING_64MS),
        HandoffFact.destination_reserved(HID, 1),
        HandoffFact.transfer_completed(HID),
        HandoffFact.failed(HID),
        HandoffFact.timed_out(HID),
        HandoffFact.canceled(HID),
    ):
        assert driver.coordinator.on_fact(fact) == []
    assert driver.coordinator.state.equals(state_before)


def test_outcomes_after_completion_are_ignored():
    driver = Driver(DF).run_to(9)
    state_before = driver.coordinator.state.copy()
    assert driver.coordinator.on_action_outcome(12345, O.APPLIED) == []
    assert driver.coordinator.on_action_outcome(driver.ids[A.SUBMIT_PREFILL], ActionOutcome.failed("late")) == []
    assert driver.coordinator.state.equals(state_before)


def test_cancel_before_start_completes_at_once_and_start_still_submits():
    coordinator = HandoffCoordinator(HID, SF)
    (complete,) = coordinator.on_fact(HandoffFact.canceled(HID))
    assert complete.kind == A.COMPLETE and complete.id == 0
    assert coordinator.completion() == Completion.CANCELED
    # The reference's start() does not look at the mode: it still submits once.
    assert kinds(coordinator.start()) == [A.SUBMIT_PREFILL]
    assert coordinator.is_complete()
    assert coordinator.on_action_outcome(1, O.SUBMITTED) == []


# Expected cleanup actions after a terminal fact at each happy-path stage.
BOTH = [A.CANCEL_SOURCE, A.CANCEL_DESTINATION]
CLEANUP_BY_STAGE = {
    SF: [[A.COMPLETE], [A.CANCEL_SOURCE], [A.CANCEL_SOURCE], BOTH, BOTH, BOTH, BOTH, BOTH, BOTH, []],
    DF: [[A.COMPLETE], [A.CANCEL_DESTINATION], [A.CANCEL_DESTINATION], BOTH, BOTH, BOTH, BOTH, BOTH, BOTH, []],
}
# Which action is awaiting an outcome at each stage (None: waiting for a fact or done).
PENDING_BY_STAGE = {
    SF: [None, A.SUBMIT_PREFILL, None, A.RESERVE_DESTINATION, None, A.START_TRANSFER, None, A.ACTIVATE_DESTINATION, A.RELEASE_SOURCE, None],
    DF: [None, A.RESERVE_DESTINATION, None, A.SUBMIT_PREFILL, None, A.START_TRANSFER, None, A.ACTIVATE_DESTINATION, A.RELEASE_SOURCE, None],
}


def finish_cleanup(driver, cancels, ack=O.APPLIED):
    """Acknowledge cancels one by one; the last acknowledgment completes the handoff."""
    for i, action in enumerate(cancels):
        out = driver.coordinator.on_action_outcome(action.id, ack if i % 2 == 0 else O.NOOP)
        if i < len(cancels) - 1:
            assert out == [] and not driver.coordinator.is_complete()
        else:
            assert kinds(out) == [A.COMPLETE]
            assert out[0].id == max(a.id for a in cancels) + 1
    assert driver.coordinator.is_complete()
    assert driver.coordinator.completion() == Completion.CANCELED


@pytest.mark.parametrize("order", [SF, DF])
@pytest.mark.parametrize("stage", range(10))
@pytest.mark.parametrize("cause", [FactKind.FAILED, FactKind.TIMED_OUT, FactKind.CANCELED])
def test_cleanup_from_every_state_by_fact(order, stage, cause):
    driver = Driver(order).run_to(stage)
    out = driver.coordinator.on_fact(HandoffFact(cause, HID))
    assert kinds(out) == CLEANUP_BY_STAGE[order][stage]
    if stage == 9:
        # A finished handoff ignores late cancellation.
        assert driver.coordinator.completion() == Completion.SUCCESS
        return
    if stage == 0:
        assert driver.coordinator.completion() == Completion.CANCELED
        return
    assert driver.coordinator.state.mode[driver.coordinator.row] == CoordinatorMode.CLEANING_UP
    # A second terminal fact while cleaning up issues nothing new.
    assert driver.coordinator.on_fact(HandoffFact.canceled(HID)) == []
    finish_cleanup(driver, out)


@pytest.mark.parametrize("order", [SF, DF])
@pytest.mark.parametrize("stage", [s for s in range(10) if PENDING_BY_STAGE[SF][s] is not None])
def test_cleanup_from_every_pending_action_by_failed_outcome(order, stage):
    driver = Driver(order).run_to(stage)
    pending = PENDING_BY_STAGE[order][stage]
    out = driver.coordinator.on_action_outcome(driver.ids[pending], ActionOutcome.failed("worker lost"))
    assert kinds(out) == CLEANUP_BY_STAGE[order][stage]
    finish_cleanup(driver, out)


def test_late_outcomes_while_cleaning_up_advance_cleanup():
    # Release pending, then canceled: ReleaseSource Applied marks the source clean.
    driver = Driver(SF).run_to(8)
    cancel_source, cancel_destination = driver.coordinator.on_fact(HandoffFact.canceled(HID))
    assert driver.coordinator.on_action_outcome(driver.ids[A.RELEASE_SOURCE], O.APPLIED) == []
    # Both sides are clean now; completion does not wait for the CancelSource outcome.
    assert kinds(driver.coordinator.on_action_outcome(cancel_destination.id, O.APPLIED)) == [A.COMPLETE]
    assert driver.coordinator.completion() == Completion.CANCELED
    assert driver.coordinator.on_action_outcome(cancel_source.id, O.NOOP) == []

    # A submission acknowledged after cancellation changes nothing visible.
    driver = Driver(SF).run_to(1)
    (cancel_source,) = driver.coordinator.on_fact(HandoffFact.timed_out(HID))
    assert driver.coordinator.on_action_outcome(driver.ids[A.SUBMIT_PREFILL], O.SUBMITTED) == []
    assert kinds(driver.coordinator.on_action_outcome(cancel_source.id, O.APPLIED)) == [A.COMPLETE]


def test_release_ack_completes_cleanup_when_destination_already_clean():
    driver = Driver(SF).run_to(8)
    cancel_source, cancel_destination = driver.coordinator.on_fact(HandoffFact.canceled(HID))
    assert driver.coordinator.on_action_outcome(cancel_destination.id, O.APPLIED) == []
    # Source becomes clean through the release outcome: nothing is left, complete.
    assert kinds(driver.coordinator.on_action_outcome(driver.ids[A.RELEASE_SOURCE], O.APPLIED)) == [A.COMPLETE]


def test_pending_action_mask_tracks_journal():
    driver = Driver(SF).run_to(3)
    state, row = driver.coordinator.state, driver.coordinator.row
    assert np.flatnonzero(pending_action_mask(state)[row]).tolist() == [A.RESERVE_DESTINATION]
    assert state.action_id_by_kind[row, A.SUBMIT_PREFILL] == 0
    assert state.outcome_by_kind[row, A.SUBMIT_PREFILL] == O.SUBMITTED
    for event, arg in HAPPY[SF][3:]:
        driver.step(event, arg)
    assert not pending_action_mask(state).any()


# ---------------------------------------------------------------------------
# Errors: named handoff and action, nothing changed
# ---------------------------------------------------------------------------


def expect_rejected(coordinator, call, *fragments):
    before = coordinator.state.copy()
    with pytest.raises(HandoffError) as info:
        call()
    message = str(info.value)
    assert f"handoff {coordinator.handoff_id}" in message
    for fragment in fragments:
        assert fragment in message, message
    assert coordinator.state.equals(before)
    return info.value


def test_unknown_action_id_is_rejected():
    driver = Driver(SF).run_to(1)
    error = expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_action_outcome(99, O.SUBMITTED),
        "action 99",
        "unknown handoff action 99",
    )
    assert error.action_ids.tolist() == [99]
    assert error.handoff_ids.tolist() == [HID]


def test_conflicting_outcome_is_rejected():
    driver = Driver(SF).run_to(2)
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_action_outcome(0, ActionOutcome.failed("x")),
        "action 0 (SubmitPrefill)",
        "conflicting outcome",
    )
    driver = Driver(SF).run_to(1)
    driver.coordinator.on_action_outcome(0, ActionOutcome.failed("first"))
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_action_outcome(0, ActionOutcome.failed("second")),
        "action 0 (SubmitPrefill) outcome Failed('second')",
        "conflicting outcome",
    )
    # The same failure text again is a repeat, not a conflict.
    assert driver.coordinator.on_action_outcome(0, ActionOutcome.failed("first")) == []


@pytest.mark.parametrize(
    "order,stage,fact,fragments",
    [
        (SF, 1, HandoffFact.source_held(HID, TIMING_64MS), ["fact SourceHeld", "action 0 (SubmitPrefill) has no Submitted"]),
        (DF, 1, HandoffFact.source_held(HID, TIMING_64MS), ["fact SourceHeld", "SubmitPrefill not issued yet"]),
        (SF, 0, HandoffFact.destination_reserved(HID, 5), ["fact DestinationReserved", "ReserveDestination not issued"]),
        (SF, 3, HandoffFact.destination_reserved(HID, 5), ["destination reserved before ownership was accepted", "action 1 (ReserveDestination)"]),
        (SF, 4, HandoffFact.transfer_completed(HID), ["transfer completed before it was scheduled", "StartTransfer not issued"]),
        (DF, 5, HandoffFact.transfer_completed(HID), ["fact TransferCompleted", "action 2 (StartTransfer) has no Scheduled"]),
    ],
)
def test_fact_before_precondition_is_rejected(order, stage, fact, fragments):
    driver = Driver(order).run_to(stage)
    expect_rejected(driver.coordinator, lambda: driver.coordinator.on_fact(fact), *fragments)


@pytest.mark.parametrize("ack", [O.APPLIED, O.NOOP])
def test_failed_cleanup_action_is_rejected(ack):
    driver = Driver(SF).run_to(3)
    cancel_source, cancel_destination = driver.coordinator.on_fact(HandoffFact.canceled(HID))
    driver.coordinator.on_action_outcome(cancel_source.id, ack)
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_action_outcome(cancel_destination.id, ActionOutcome.failed("gone")),
        f"action {cancel_destination.id} (CancelDestination)",
        "cleanup action",
        "failed",
    )


@pytest.mark.parametrize(
    "kind,outcome",
    [
        (A.SUBMIT_PREFILL, O.ACCEPTED),
        (A.SUBMIT_PREFILL, O.NOOP),
        (A.RESERVE_DESTINATION, O.SUBMITTED),
        (A.START_TRANSFER, O.APPLIED),
        (A.ACTIVATE_DESTINATION, O.NOOP),
        (A.RELEASE_SOURCE, O.SCHEDULED),
    ],
)
def test_outcome_not_allowed_for_action_is_rejected(kind, outcome):
    stage = {A.SUBMIT_PREFILL: 1, A.RESERVE_DESTINATION: 3, A.START_TRANSFER: 5, A.ACTIVATE_DESTINATION: 7, A.RELEASE_SOURCE: 8}
    driver = Driver(SF).run_to(stage[kind])
    action_id = driver.ids[kind]
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_action_outcome(action_id, outcome),
        f"action {action_id} (",
        "invalid handoff action outcome",
    )
    # Nothing was recorded, so the right outcome is still accepted afterwards.
    allowed = {A.SUBMIT_PREFILL: O.SUBMITTED, A.RESERVE_DESTINATION: O.ACCEPTED, A.START_TRANSFER: O.SCHEDULED,
               A.ACTIVATE_DESTINATION: O.APPLIED, A.RELEASE_SOURCE: O.APPLIED}[kind]
    driver.coordinator.on_action_outcome(action_id, allowed)


def test_fact_for_other_handoff_is_rejected_even_when_complete():
    driver = Driver(SF).run_to(9)
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_fact(HandoffFact.canceled(7)),
        "fact Canceled",
        "different handoff (7)",
    )


def test_invalid_timing_in_source_held_is_rejected():
    driver = Driver(SF).run_to(2)
    bad = HandoffTransferTiming(full_prompt_tokens=10, kv_bytes_per_token=1024, bandwidth_gb_s=-1.0)
    expect_rejected(
        driver.coordinator,
        lambda: driver.coordinator.on_fact(HandoffFact.source_held(HID, bad)),
        "fact SourceHeld",
        "bandwidth_gb_s -1.0",
    )
    nan_bw = HandoffTransferTiming(full_prompt_tokens=10, kv_bytes_per_token=1024, bandwidth_gb_s=float("nan"))
    expect_rejected(driver.coordinator, lambda: driver.coordinator.on_fact(HandoffFact.source_held(HID, nan_bw)), "bandwidth_gb_s nan")


def test_invalid_fallback_is_rejected():
    with pytest.raises(ValueError, match="fallback_transfer_delay_ms"):
        HandoffCoordinator(HID, SF, -1.0)
    with pytest.raises(ValueError, match="fallback_transfer_delay_ms"):
        HandoffCoordinator(HID, SF, float("nan"))


# ---------------------------------------------------------------------------
# Batched API
# ---------------------------------------------------------------------------


def batch_of(n_rows, order=SF, fallback_ms=0.0):
    state = HandoffState()
    rows = add_handoffs(state, np.arange(100, 100 + n_rows), order, fallback_ms, simulation=np.arange(n_rows) % 2)
    return state, rows


def timing_arrays(n, tokens=64, kv=1_000_000.0, bw=1.0, mode=0):
    return TransferTimingArrays(mode=np.full(n, mode), full_prompt_tokens=tokens, kv_bytes_per_token=kv, bandwidth_gb_s=bw)


def test_batched_happy_path_on_many_rows():
    n = 5
    state, rows = batch_of(n)
    issued = apply_start(state, rows)
    assert issued.kinds.tolist() == [A.SUBMIT_PREFILL] * n and issued.rows.tolist() == rows.tolist()
    assert len(apply_outcomes(state, rows, issued.action_ids, O.SUBMITTED)) == 0
    issued = apply_facts(state, rows, FactKind.SOURCE_HELD, timing=timing_arrays(n, tokens=np.arange(n) * 10))
    assert set(issued.kinds.tolist()) == {A.RESERVE_DESTINATION}
    apply_outcomes(state, rows, issued.action_ids, O.ACCEPTED)
    issued = apply_facts(state, rows, FactKind.DESTINATION_RESERVED, transferable_prompt_tokens=7)
    assert issued.kinds.tolist() == [A.START_TRANSFER] * n
    assert issued.delay_ms.tolist() == [t * 1e6 / 1e9 * 1000.0 for t in range(0, 50, 10)]
    np.testing.assert_array_equal(state.xfer_delay_ms, issued.delay_ms)
    apply_outcomes(state, rows, issued.action_ids, O.SCHEDULED)
    issued = apply_facts(state, rows, FactKind.TRANSFER_COMPLETED)
    issued = apply_outcomes(state, rows, issued.action_ids, O.APPLIED)
    assert issued.kinds.tolist() == [A.RELEASE_SOURCE] * n
    issued = apply_outcomes(state, rows, issued.action_ids, [O.APPLIED, O.NOOP, O.APPLIED, O.NOOP, O.APPLIED])
    assert issued.kinds.tolist() == [A.COMPLETE] * n
    assert issued.handoff_ids.tolist() == list(range(100, 105))
    assert state.is_complete().all() and (state.completion == Completion.SUCCESS).all()


def test_batch_mixes_fact_kinds_and_orders():
    state = HandoffState()
    rows = add_handoffs(state, [1, 2, 3], [SF, DF, SF])
    first = apply_start(state, rows)
    assert first.kinds.tolist() == [A.SUBMIT_PREFILL, A.RESERVE_DESTINATION, A.SUBMIT_PREFILL]
    apply_outcomes(state, rows, first.action_ids, [O.SUBMITTED, O.ACCEPTED, O.SUBMITTED])
    out = apply_facts(
        state,
        rows,
        [FactKind.SOURCE_HELD, FactKind.DESTINATION_RESERVED, FactKind.CANCELED],
        timing=timing_arrays(3),
        transferable_prompt_tokens=[0, 12, 0],
    )
    assert out.rows.tolist() == [0, 1, 2]
    assert out.kinds.tolist() == [A.RESERVE_DESTINATION, A.SUBMIT_PREFILL, A.CANCEL_SOURCE]
    assert state.dst_transferable_prompt_tokens.tolist() == [-1, 12, -1]


def test_two_cancels_of_one_row_are_ordered_by_id():
    state, rows = batch_of(3)
    apply_start(state, rows)
    apply_outcomes(state, rows, 0, O.SUBMITTED)
    apply_facts(state, rows, FactKind.SOURCE_HELD, timing=timing_arrays(3))
    out = apply_facts(state, rows[::-1], FactKind.FAILED)
    # Grouped by input position, then by action id.
    assert out.rows.tolist() == [2, 2, 1, 1, 0, 0]
    assert out.kinds.tolist() == [A.CANCEL_SOURCE, A.CANCEL_DESTINATION] * 3
    assert out.action_ids.tolist() == [2, 3] * 3


def test_error_in_one_row_leaves_every_row_unchanged():
    n = 6
    state, rows = batch_of(n)
    issued = apply_start(state, rows)
    before = state.copy()
    ids = issued.action_ids.copy()
    ids[3] = 77  # unknown
    with pytest.raises(HandoffError) as info:
        apply_outcomes(state, rows, ids, O.SUBMITTED)
    assert info.value.rows.tolist() == [3]
    assert info.value.handoff_ids.tolist() == [103]
    assert info.value.action_ids.tolist() == [77]
    assert "handoff 103 (row 3, simulation 1): action 77 (unknown)" in str(info.value)
    assert "1 of 6" in str(info.value)
    assert state.equals(before)
    # The valid rows go through once the bad row is left out.
    keep = np.array([0, 1, 2, 4, 5])
    apply_outcomes(state, rows[keep], issued.action_ids[keep], O.SUBMITTED)
    assert state.src_submitted.tolist() == [True, True, True, False, True, True]


def test_every_offending_row_is_named():
    state, rows = batch_of(4)
    apply_start(state, rows)
    apply_outcomes(state, rows[:2], 0, O.SUBMITTED)
    before = state.copy()
    bad_timing = timing_arrays(4, bw=np.array([1.0, -3.0, 1.0, 1.0]))
    with pytest.raises(HandoffError) as info:
        apply_facts(state, rows, FactKind.SOURCE_HELD, timing=bad_timing)
    assert info.value.rows.tolist() == [1, 2, 3]
    message = str(info.value)
    assert "handoff 101 (row 1, simulation 1): fact SourceHeld: invalid handoff transfer bandwidth_gb_s -3.0" in message
    assert "handoff 102 (row 2, simulation 0): fact SourceHeld: source held before prefill submission" in message
    assert state.equals(before)


def test_rows_must_be_unique_and_in_range():
    state, rows = batch_of(3)
    with pytest.raises(ValueError, match="more than once"):
        apply_start(state, [0, 1, 0])
    with pytest.raises(IndexError):
        apply_start(state, [3])
    assert not state.started.any()


def test_missing_payload_is_rejected():
    state, rows = batch_of(2)
    with pytest.raises(ValueError, match="timing"):
        apply_facts(state, rows, FactKind.SOURCE_HELD)
    with pytest.raises(ValueError, match="transferable_prompt_tokens"):
        apply_facts(state, rows, FactKind.DESTINATION_RESERVED)


def test_unknown_failure_message_code_is_rejected():
    state, rows = batch_of(1)
    apply_start(state, rows)
    with pytest.raises(HandoffError, match="unknown failure message code 99"):
        apply_outcomes(state, rows, 0, O.FAILED, 99)
    code = state.intern_message("prefill worker died")
    assert kinds_of(apply_outcomes(state, rows, 0, O.FAILED, code)) == [A.CANCEL_SOURCE]
    assert state.outcome_message_by_kind[0, A.SUBMIT_PREFILL] == code


def kinds_of(issued):
    return [ActionKind(int(k)) for k in issued.kinds]


def test_negative_transferable_tokens_rejected():
    state, rows = batch_of(1, order=DF)
    apply_start(state, rows)
    apply_outcomes(state, rows, 0, O.ACCEPTED)
    with pytest.raises(HandoffError, match="transferable_prompt_tokens -1"):
        apply_facts(state, rows, FactKind.DESTINATION_RESERVED, transferable_prompt_tokens=-1)


def test_coordinators_can_share_one_table():
    state = HandoffState()
    a = Driver(SF, state=state, handoff_id=1)
    b = Driver(DF, state=state, handoff_id=2)
    a.run_to(9)
    b.run_to(4)
    assert state.n_rows == 2
    assert a.coordinator.is_complete() and not b.coordinator.is_complete()
    assert state.mode.tolist() == [CoordinatorMode.COMPLETE, CoordinatorMode.ACTIVE]


def test_table_grows_past_initial_capacity():
    state = HandoffState(capacity=2)
    for i in range(40):
        add_handoffs(state, [i], SF)
    apply_start(state, np.arange(40))
    assert state.started.all() and state.handoff_id.tolist() == list(range(40))


# ---------------------------------------------------------------------------
# Normalized conformance record
# ---------------------------------------------------------------------------


def conformance(**changes):
    record = dict(
        engine_type=Backend.VLLM,
        order=SF,
        lifecycle=list(expected_normalized_handoff(SF)),
        source_output_tokens=1,
        destination_output_tokens=2,
        completed_requests=1,
        destination_stored=NormalizedStoredTiming(0, 3, 0),
        source_drained=True,
        destination_drained=True,
        driver_drained=True,
    )
    record.update(changes)
    return NormalizedHandoffConformance(**record)


def test_expected_lifecycles():
    E = NormalizedHandoffEvent
    assert expected_normalized_handoff(SF) == (
        E.SOURCE_HELD, E.DESTINATION_ACCEPTED, E.DESTINATION_RESERVED, E.DESTINATION_ACTIVATED, E.SOURCE_RELEASED, E.COMPLETED
    )
    assert expected_normalized_handoff(DF) == (
        E.DESTINATION_ACCEPTED, E.DESTINATION_RESERVED, E.SOURCE_HELD, E.DESTINATION_ACTIVATED, E.SOURCE_RELEASED, E.COMPLETED
    )


def test_valid_conformance_records_pass():
    conformance().validate()
    conformance(engine_type=Backend.SGLANG, order=DF, lifecycle=list(expected_normalized_handoff(DF))).validate()


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(engine_type=Backend.TRTLLM), "TRT-LLM does not support destination handoff"),
        (dict(order=DF, lifecycle=list(expected_normalized_handoff(DF))), "order mismatch: expected SOURCE_FIRST"),
        (dict(engine_type=Backend.SGLANG), "order mismatch: expected DESTINATION_FIRST"),
        (dict(lifecycle=list(expected_normalized_handoff(DF))), "lifecycle mismatch"),
        (dict(lifecycle=list(expected_normalized_handoff(SF))[:-1]), "lifecycle mismatch"),
        (dict(source_output_tokens=2), "output/completion counts"),
        (dict(destination_output_tokens=1), "output/completion counts"),
        (dict(completed_requests=0), "output/completion counts"),
        (dict(destination_stored=NormalizedStoredTiming(1, 3, 0)), "KV visibility"),
        (dict(destination_stored=NormalizedStoredTiming(0, 0, 0)), "KV visibility"),
        (dict(destination_stored=NormalizedStoredTiming(0, 3, 1)), "KV visibility"),
        (dict(source_drained=False), "did not drain"),
        (dict(destination_drained=False), "did not drain"),
        (dict(driver_drained=False), "did not drain"),
    ],
)
def test_conformance_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        conformance(**changes).validate()


# ---------------------------------------------------------------------------
# Property: batched application == one row at a time == plain reference model
# ---------------------------------------------------------------------------


class ReferenceCore:
    """Plain-object model of one handoff, written from the reference behaviour."""

    ALLOWED = {
        A.SUBMIT_PREFILL: {O.SUBMITTED},
        A.RESERVE_DESTINATION: {O.ACCEPTED},
        A.START_TRANSFER: {O.SCHEDULED},
        A.ACTIVATE_DESTINATION: {O.APPLIED},
        A.RELEASE_SOURCE: {O.APPLIED, O.NOOP},
        A.CANCEL_SOURCE: {O.APPLIED, O.NOOP},
        A.CANCEL_DESTINATION: {O.APPLIED, O.NOOP},
    }
    FLAG_ON_SUCCESS = {
        A.SUBMIT_PREFILL: "submitted",
        A.RESERVE_DESTINATION: "accepted",
        A.START_TRANSFER: "scheduled",
        A.ACTIVATE_DESTINATION: "activation_applied",
        A.RELEASE_SOURCE: "src_clean",
        A.CANCEL_SOURCE: "src_clean",
        A.CANCEL_DESTINATION: "dst_clean",
    }

    def __init__(self, handoff_id, order, fallback_ms):
        self.handoff_id, self.order, self.fallback_ms = handoff_id, order, fallback_ms
        self.mode = "active"
        self.completion = None
        self.started = False
        self.next_id = 0
        self.issued: dict[int, ActionKind] = {}
        self.outcomes: dict[int, tuple] = {}
        self.flags = dict.fromkeys(
            "submit_issued submitted held release_issued src_cancel_issued src_clean reserve_issued accepted "
            "reserved activation_issued activation_applied dst_cancel_issued dst_clean transfer_issued scheduled "
            "transferred".split(),
            False,
        )
        self.timing = None
        self.tokens = None

    def _issue(self, kind, delay_ms=None):
        action_id = self.next_id
        self.next_id += 1
        self.issued[action_id] = kind
        return [(action_id, kind, delay_ms)]

    def _complete(self):
        self.completion = Completion.CANCELED if self.mode == "cleanup" else Completion.SUCCESS
        self.mode = "complete"
        return self._issue(A.COMPLETE)

    def start(self):
        if self.started:
            return []
        self.started = True
        if self.order == SF:
            self.flags["submit_issued"] = True
            return self._issue(A.SUBMIT_PREFILL)
        self.flags["reserve_issued"] = True
        return self._issue(A.RESERVE_DESTINATION)

    def fact(self, kind, timing=None, tokens=None):
        f = self.flags
        if self.mode != "active":
            return []
        if kind == FactKind.SOURCE_HELD:
            if f["held"]:
                return []
            assert f["submitted"]
            f["held"], self.timing = True, timing
        elif kind == FactKind.DESTINATION_RESERVED:
            if f["reserved"]:
                return []
            assert f["accepted"]
            f["reserved"], self.tokens = True, tokens
        elif kind == FactKind.TRANSFER_COMPLETED:
            if f["transferred"]:
                return []
            assert f["scheduled"]
            f["transferred"] = True
        else:
            return self._begin_cleanup()
        return self._advance()

    def outcome(self, action_id, outcome, message):
        if self.mode == "complete":
            return []
        kind = self.issued[action_id]
        if action_id in self.outcomes:
            assert self.outcomes[action_id] == (outcome, message)
            return []
        self.outcomes[action_id] = (outcome, message)
        if outcome == O.FAILED:
            assert kind not in (A.CANCEL_SOURCE, A.CANCEL_DESTINATION)
            return self._begin_cleanup()
        assert outcome in self.ALLOWED[kind]
        self.flags[self.FLAG_ON_SUCCESS[kind]] = True
        return self._advance() if self.mode == "active" else self._advance_cleanup()

    def _delay_ms(self):
        mode, full, kv, bw, state_bytes = self.timing
        tokens = self.tokens if mode == TransferTimingMode.DESTINATION_MISSING else full
        if kv is None or bw is None or bw == 0.0:
            return self.fallback_ms
        return (float(tokens) * float(kv) + float(state_bytes)) / (bw * 1e9) * 1000.0

    def _advance(self):
        f = self.flags
        if self.order == SF and f["held"] and not f["reserve_issued"]:
            f["reserve_issued"] = True
            return self._issue(A.RESERVE_DESTINATION)
        if self.order == DF and f["reserved"] and not f["submit_issued"]:
            f["submit_issued"] = True
            return self._issue(A.SUBMIT_PREFILL)
        if f["held"] and f["reserved"] and not f["transfer_issued"]:
            f["transfer_issued"] = True
            return self._issue(A.START_TRANSFER, self._delay_ms())
        if f["transferred"] and not f["activation_issued"]:
            f["activation_issued"] = True
            return self._issue(A.ACTIVATE_DESTINATION)
        if f["activation_applied"] and not f["release_issued"]:
            f["release_issued"] = True
            return self._issue(A.RELEASE_SOURCE)
        if f["src_clean"]:
            return self._complete()
        return []

    def _begin_cleanup(self):
        if self.mode == "complete":
            return []
        self.mode = "cleanup"
        return self._advance_cleanup()

    def _advance_cleanup(self):
        f, out = self.flags, []
        if f["submit_issued"] and not f["src_cancel_issued"] and not f["src_clean"]:
            f["src_cancel_issued"] = True
            out += self._issue(A.CANCEL_SOURCE)
        if f["reserve_issued"] and not f["dst_cancel_issued"] and not f["dst_clean"]:
            f["dst_cancel_issued"] = True
            out += self._issue(A.CANCEL_DESTINATION)
        if not out and (not f["submit_issued"] or f["src_clean"]) and (not f["reserve_issued"] or f["dst_clean"]):
            out += self._complete()
        return out


MESSAGES = ["boom", "other"]

timing_strategy = st.tuples(
    st.sampled_from([TransferTimingMode.FULL_PROMPT, TransferTimingMode.DESTINATION_MISSING]),
    st.integers(0, 4096),
    st.one_of(st.none(), st.integers(0, 2_000_000)),
    st.one_of(st.none(), st.just(0.0), st.floats(0.1, 100.0)),
    st.sampled_from([0, 0, 4096]),
)


def draw_event(data, ref: ReferenceCore):
    """One event that is valid for the reference's current state.

    Events that make progress are drawn most of the time so that runs reach
    the late states; repeats, failures and terminal facts are drawn rarely.
    """
    progress, noise = [], [("start",)]
    f = ref.flags
    if ref.mode == "complete":
        noise += [("outcome", 999, O.APPLIED, None), ("fact", FactKind.CANCELED)]
    else:
        if not ref.started:
            progress.append(("start",))
        for action_id, kind in ref.issued.items():
            if action_id in ref.outcomes:
                noise.append(("outcome", action_id) + ref.outcomes[action_id])
                continue
            progress += [("outcome", action_id, o, None) for o in sorted(ReferenceCore.ALLOWED[kind])]
            if kind not in (A.CANCEL_SOURCE, A.CANCEL_DESTINATION):
                noise.append(("outcome", action_id, O.FAILED, "fail"))
        for kind, ready, done in (
            (FactKind.SOURCE_HELD, "submitted", "held"),
            (FactKind.DESTINATION_RESERVED, "accepted", "reserved"),
            (FactKind.TRANSFER_COMPLETED, "scheduled", "transferred"),
        ):
            if ref.mode != "active" or f[done]:
                noise.append(("fact", kind))
            elif f[ready]:
                progress.append(("fact", kind))
        noise += [("fact", FactKind.FAILED), ("fact", FactKind.TIMED_OUT), ("fact", FactKind.CANCELED)]
    use_noise = not progress or data.draw(st.integers(0, 9)) == 0
    event = data.draw(st.sampled_from(noise if use_noise else progress))
    if event[0] == "outcome" and event[3] == "fail":
        event = event[:3] + (data.draw(st.sampled_from(MESSAGES)),)
    if event[0] == "fact":
        kind = event[1]
        timing = data.draw(timing_strategy) if kind == FactKind.SOURCE_HELD else None
        tokens = data.draw(st.integers(0, 4096)) if kind == FactKind.DESTINATION_RESERVED else None
        event = ("fact", kind, timing, tokens)
    return event


def timing_payload(timings):
    mode, full, kv, bw, sb = zip(*timings)
    return TransferTimingArrays(
        mode=np.array(mode),
        full_prompt_tokens=np.array(full),
        kv_bytes_per_token=np.array([np.nan if v is None else v for v in kv], dtype=float),
        bandwidth_gb_s=np.array([np.nan if v is None else v for v in bw], dtype=float),
        state_bytes=np.array(sb, dtype=float),
    )


def apply_group(state, rows, events):
    """Apply one event per row through the batched API, grouped by event type."""
    out = []
    starts = [r for r, e in zip(rows, events) if e[0] == "start"]
    if starts:
        out.append(apply_start(state, starts))
    facts = [(r, e) for r, e in zip(rows, events) if e[0] == "fact"]
    if facts:
        default_timing = (TransferTimingMode.FULL_PROMPT, 0, None, None, 0)
        out.append(
            apply_facts(
                state,
                [r for r, _ in facts],
                [e[1] for _, e in facts],
                timing=timing_payload([e[2] or default_timing for _, e in facts]),
                transferable_prompt_tokens=[-1 if e[3] is None else e[3] for _, e in facts],
            )
        )
    outcomes = [(r, e) for r, e in zip(rows, events) if e[0] == "outcome"]
    if outcomes:
        out.append(
            apply_outcomes(
                state,
                [r for r, _ in outcomes],
                [e[1] for _, e in outcomes],
                [e[2] for _, e in outcomes],
                [-1 if e[3] is None else state.intern_message(e[3]) for _, e in outcomes],
            )
        )
    issued = {}
    for batch in out:
        for r in set(batch.rows.tolist()):
            issued[r] = [(a.id, a.kind, a.delay_ms) for a in batch.for_row(r)]
    return issued


def new_tables(orders, fallbacks):
    tables = []
    for _ in range(2):
        state = HandoffState()
        for m in MESSAGES:
            state.intern_message(m)
        add_handoffs(state, np.arange(len(orders)) + 1000, orders, fallbacks)
        tables.append(state)
    return tables


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    setup=st.lists(st.tuples(st.sampled_from([SF, DF]), st.sampled_from([0.0, 7.5])), min_size=1, max_size=6),
    data=st.data(),
)
def test_batched_equals_row_by_row_equals_reference(setup, data):
    orders = [o for o, _ in setup]
    fallbacks = [fb for _, fb in setup]
    n = len(setup)
    batched, single = new_tables(orders, fallbacks)
    refs = [ReferenceCore(1000 + i, o, fb) for i, (o, fb) in enumerate(setup)]

    for _ in range(40):
        if all(r.mode == "complete" for r in refs) and data.draw(st.booleans()):
            break
        rows = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
        events = [draw_event(data, refs[r]) for r in rows]

        # Inject an invalid outcome for some other live row: the whole batch
        # must be rejected naming that row, and nothing may change.
        spare = [r for r in range(n) if r not in rows and refs[r].mode != "complete"]
        if spare and data.draw(st.integers(0, 3)) == 0:
            bad_row = data.draw(st.sampled_from(spare))
            snapshot = batched.copy()
            outcome_rows = [r for r, e in zip(rows, events) if e[0] == "outcome"]
            outcome_events = [e for e in events if e[0] == "outcome"]
            with pytest.raises(HandoffError) as info:
                # Outcome events only, so this is a single batched call.
                apply_group(batched, outcome_rows + [bad_row], outcome_events + [("outcome", 10_000, O.APPLIED, None)])
            assert info.value.rows.tolist() == [bad_row]
            assert f"handoff {1000 + bad_row}" in str(info.value) and "action 10000" in str(info.value)
            assert batched.equals(snapshot)

        issued_batched = apply_group(batched, rows, events)
        for r, e in zip(rows, events):
            issued_single = apply_group(single, [r], [e]).get(r, [])
            ref = refs[r]
            if e[0] == "start":
                issued_ref = ref.start()
            elif e[0] == "fact":
                issued_ref = ref.fact(e[1], e[2], e[3])
            else:
                issued_ref = ref.outcome(e[1], e[2], e[3])
            assert issued_batched.get(r, []) == issued_single == issued_ref, (r, e)
        assert batched.equals(single)
        for r, ref in enumerate(refs):
            assert (batched.mode[r] == CoordinatorMode.COMPLETE) == (ref.mode == "complete")
            expected = Completion.NONE if ref.completion is None else ref.completion
            assert batched.completion[r] == expected
            assert batched.next_action_id[r] == ref.next_id
