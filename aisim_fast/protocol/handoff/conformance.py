"""The normalized conformance record of a handoff (what the reference's conformance tests
compare) and the one a lifecycle should produce."""

from __future__ import annotations

import enum
from dataclasses import dataclass


from aisim_fast.protocol.handoff.actions import Backend, HandoffOrder, handoff_order_for_backend


class NormalizedHandoffEvent(enum.Enum):
    SOURCE_HELD = "SourceHeld"
    DESTINATION_ACCEPTED = "DestinationAccepted"
    DESTINATION_RESERVED = "DestinationReserved"
    DESTINATION_ACTIVATED = "DestinationActivated"
    SOURCE_RELEASED = "SourceReleased"
    COMPLETED = "Completed"


def expected_normalized_handoff(order: HandoffOrder) -> tuple[NormalizedHandoffEvent, ...]:
    """Lifecycle of a successful handoff as the conformance fixture records it."""
    e = NormalizedHandoffEvent
    if HandoffOrder(order) == HandoffOrder.SOURCE_FIRST:
        return (
            e.SOURCE_HELD,
            e.DESTINATION_ACCEPTED,
            e.DESTINATION_RESERVED,
            e.DESTINATION_ACTIVATED,
            e.SOURCE_RELEASED,
            e.COMPLETED,
        )
    return (
        e.DESTINATION_ACCEPTED,
        e.DESTINATION_RESERVED,
        e.SOURCE_HELD,
        e.DESTINATION_ACTIVATED,
        e.SOURCE_RELEASED,
        e.COMPLETED,
    )


@dataclass
class NormalizedStoredTiming:
    """Destination KV ``Stored`` events relative to activation (counts of blocks)."""

    before_activation: int = 0
    on_activation: int = 0
    repeated_activation_hashes_after_activation: int = 0


@dataclass
class NormalizedHandoffConformance:
    """Backend-neutral summary of one fixture handoff (one request, 1 prefill token, 2 decode tokens)."""

    engine_type: Backend
    order: HandoffOrder
    lifecycle: list[NormalizedHandoffEvent]
    source_output_tokens: int
    destination_output_tokens: int
    completed_requests: int
    destination_stored: NormalizedStoredTiming
    source_drained: bool
    destination_drained: bool
    driver_drained: bool

    def validate(self) -> None:
        """Raise ``ValueError`` describing the first rule the record breaks."""
        backend = Backend(self.engine_type)
        if backend is Backend.TRTLLM:
            # The fixture covers the two backends with a native destination
            # handoff; TRT-LLM's source-first flow is not part of it.
            raise ValueError("TRT-LLM does not support destination handoff")
        expected_order = handoff_order_for_backend(backend)
        if HandoffOrder(self.order) != expected_order:
            raise ValueError(
                f"normalized handoff order mismatch: expected {expected_order.name}, got {HandoffOrder(self.order).name}"
            )
        if tuple(self.lifecycle) != expected_normalized_handoff(self.order):
            raise ValueError(
                f"normalized handoff lifecycle mismatch: got {[e.value for e in self.lifecycle]}"
            )
        if self.source_output_tokens != 1 or self.destination_output_tokens != 2 or self.completed_requests != 1:
            raise ValueError("normalized handoff output/completion counts do not match the fixture")
        stored = self.destination_stored
        if (
            stored.before_activation != 0
            or stored.on_activation == 0
            or stored.repeated_activation_hashes_after_activation != 0
        ):
            raise ValueError("normalized handoff destination KV visibility is invalid")
        if not (self.source_drained and self.destination_drained and self.driver_drained):
            raise ValueError("normalized handoff did not drain")
