"""The handoff's vocabulary: lifecycle facts, actions and outcomes with the kernels' numbers, the
SourceFirst transitions (``NEXT_ON_*``: which action follows which fact), the two orders."""

from __future__ import annotations

import enum

import numpy as np

from aisim_fast.kernels.schema import layout as L


class HandoffOrder(enum.IntEnum):
    """Which side is engaged first; fixed by the backend."""

    SOURCE_FIRST = 0
    DESTINATION_FIRST = 1


class Backend(str, enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


def handoff_order_for_backend(backend: "Backend | str") -> HandoffOrder:
    """vLLM and TRT-LLM hold the source first; SGLang reserves the decode slot first."""
    backend = Backend(backend)
    if backend is Backend.SGLANG:
        return HandoffOrder.DESTINATION_FIRST
    return HandoffOrder.SOURCE_FIRST


class FactKind(enum.IntEnum):
    SOURCE_HELD = 0
    DESTINATION_RESERVED = 1
    TRANSFER_COMPLETED = 2
    FAILED = 3
    TIMED_OUT = 4
    CANCELED = 5


class ActionKind(enum.IntEnum):
    """The handoff actions, numbered as the kernels number them (``ACT_*`` of
    ``kernels.schema.layout``): one vocabulary for the coordinator and the kernels."""
    SUBMIT_PREFILL = L.ACT_SUBMIT_PREFILL
    RESERVE_DESTINATION = L.ACT_RESERVE
    START_TRANSFER = L.ACT_START_TRANSFER
    ACTIVATE_DESTINATION = L.ACT_ACTIVATE
    RELEASE_SOURCE = L.ACT_RELEASE
    CANCEL_SOURCE = L.ACT_CANCEL_SOURCE
    CANCEL_DESTINATION = L.ACT_CANCEL_DESTINATION
    COMPLETE = L.ACT_COMPLETE


N_ACTION_KINDS = len(ActionKind)

# The SourceFirst transition, read from its one definition (``NEXT_ON_*`` of
# ``kernels.schema.layout``, which the kernels' event loop queues by): the action that
# follows each lifecycle fact. The rules of ``apply_start`` / ``_advance_active``
# issue these; the DestinationFirst order (reservation first) has its own two rules
# and shares the rest.
NEXT_ON_ARRIVAL = ActionKind(L.NEXT_ON_ARRIVAL)
NEXT_ON_SOURCE_HELD = ActionKind(L.NEXT_ON_SOURCE_HELD)
NEXT_ON_DESTINATION_RESERVED = ActionKind(L.NEXT_ON_DESTINATION_RESERVED)
NEXT_ON_TRANSFER_COMPLETED = ActionKind(L.NEXT_ON_TRANSFER_COMPLETED)
NEXT_ON_DESTINATION_ACTIVATED = ActionKind(L.NEXT_ON_DESTINATION_ACTIVATED)
NEXT_ON_SOURCE_RELEASED = ActionKind(L.NEXT_ON_SOURCE_RELEASED)


class OutcomeKind(enum.IntEnum):
    # 0 marks "no outcome recorded yet" in the journal; it is not a valid input.
    NONE = 0
    SUBMITTED = 1
    ACCEPTED = 2
    SCHEDULED = 3
    APPLIED = 4
    NOOP = 5
    FAILED = 6


class CoordinatorMode(enum.IntEnum):
    ACTIVE = 0
    CLEANING_UP = 1
    COMPLETE = 2


class Completion(enum.IntEnum):
    # 0 marks "not complete" in the completion column.
    NONE = 0
    SUCCESS = 1
    CANCELED = 2


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


FACT_NAMES = {k: camel(k.name) for k in FactKind}
ACTION_NAMES = {k: camel(k.name) for k in ActionKind}
OUTCOME_NAMES = {k: camel(k.name) for k in OutcomeKind}

# Which successful outcome each action kind accepts.  Failed is handled before
# this table is consulted.  Complete never receives an outcome in practice
# (the handoff is already complete when it is issued), so every kind is
# accepted there and nothing happens.
ALLOWED_OUTCOMES = np.zeros((N_ACTION_KINDS, len(OutcomeKind)), dtype=bool)
ALLOWED_OUTCOMES[ActionKind.SUBMIT_PREFILL, OutcomeKind.SUBMITTED] = True
ALLOWED_OUTCOMES[ActionKind.RESERVE_DESTINATION, OutcomeKind.ACCEPTED] = True
ALLOWED_OUTCOMES[ActionKind.START_TRANSFER, OutcomeKind.SCHEDULED] = True
ALLOWED_OUTCOMES[ActionKind.ACTIVATE_DESTINATION, OutcomeKind.APPLIED] = True
for _kind in (ActionKind.RELEASE_SOURCE, ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION):
    ALLOWED_OUTCOMES[_kind, OutcomeKind.APPLIED] = True
    ALLOWED_OUTCOMES[_kind, OutcomeKind.NOOP] = True
ALLOWED_OUTCOMES[ActionKind.COMPLETE, 1:] = True

CLEANUP_ACTIONS = np.array([ActionKind.CANCEL_SOURCE, ActionKind.CANCEL_DESTINATION], dtype=np.int64)
