"""The rank protocol's vocabulary: requests, commands, lifecycle events and the effects a
rank returns (the seed protocol's names; frozen dataclasses)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Sequence, Union

RequestId = Union[str, int, uuid.UUID]


# ---------------------------------------------------------------------------------
# protocol types
# ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """A request as a rank takes it: prompt token ids, the output length asked for,
    and optionally the exact output token ids (their count then is the length).
    Without ``output_token_ids`` a rank emits the reference's synthetic tokens
    (``synthetic_output_tokens``)."""
    request_id: RequestId
    tokens: Sequence[int]
    max_output_tokens: int
    output_token_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class Submit:
    request: Request


@dataclass(frozen=True)
class CancelRequest:
    request_id: RequestId
    discard_pending_output: bool = False


@dataclass(frozen=True)
class SubmitHandoffPrefill:
    """Submit a request to a prefill rank whose completed prefill KV stays held for
    the decode side (SourceHeld) until ReleaseSource or CancelSource."""
    handoff_id: RequestId
    request: Request


@dataclass(frozen=True)
class ReleaseSource:
    handoff_id: RequestId


@dataclass(frozen=True)
class CancelSource:
    handoff_id: RequestId


@dataclass(frozen=True)
class ReserveDestination:
    """Accept a decode request on a decode rank and reserve its prompt's KV there
    (at once when the rank is idle and has room, else at a later retry)."""
    handoff_id: RequestId
    request: Request


@dataclass(frozen=True)
class ActivateDestination:
    """The transfer is done: the reserved destination becomes runnable."""
    handoff_id: RequestId


@dataclass(frozen=True)
class CancelDestination:
    """Give back a pending or reserved destination, or drop an activated one."""
    handoff_id: RequestId


@dataclass(frozen=True)
class DestinationReserved:
    """Lifecycle event: decode-side KV for the prompt is reserved;
    ``transferable_prompt_tokens`` = fresh (not resident) blocks x block size."""
    handoff_id: RequestId
    request_id: RequestId
    transferable_prompt_tokens: int


@dataclass(frozen=True)
class SourceHeld:
    """Lifecycle event: the prefill finished and its KV is held for the transfer."""
    handoff_id: RequestId
    request_id: RequestId
    transfer_timing: object   # aisim_fast.protocol.handoff.coordinator.HandoffTransferTiming


@dataclass(frozen=True)
class Submitted:
    request_id: RequestId


@dataclass(frozen=True)
class DestinationAccepted:
    request_id: RequestId


@dataclass(frozen=True)
class Applied:
    pass


@dataclass(frozen=True)
class Noop:
    pass


APPLIED = Applied()
NOOP = Noop()
CommandResult = Union[Submitted, DestinationAccepted, Applied, Noop]


@dataclass(frozen=True)
class KvBlock:
    block_hash: int
    tokens_hash: int
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Stored:
    """Consecutive blocks that became prefix-cache visible; ``parent_hash`` is the
    block before the first one (None at a sequence's block 0)."""
    parent_hash: int | None
    blocks: tuple[KvBlock, ...]


@dataclass(frozen=True)
class Removed:
    """The last physical copy of each of these hashes was evicted."""
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvEvent:
    event_id: int          # rank-local, from 0, strictly increasing
    dp_rank: int
    data: Union[Stored, Removed]


@dataclass(frozen=True)
class Admission:
    request_id: RequestId
    reused_input_tokens: int


@dataclass(frozen=True)
class PressureState:
    running_requests: int
    waiting_requests: int | None
    active_blocks: int


@dataclass(frozen=True)
class PressureEvent:
    at_ms: float
    kind: str              # "vllm_preemption" | "sglang_retraction"
    request_id: RequestId
    state_before: PressureState
    state_after: PressureState
    request_active_blocks_before: int
    logical_available_blocks_before: int | None
    required_blocks_before: int | None


@dataclass(frozen=True)
class Output:
    """One client-visible output: a token, or (token_id None, completed) a terminal
    without token (zero output, rejection). ``cached_tokens``: vLLM / TRT-LLM, on a
    request's first output only, the prompt tokens its first admission reused."""
    request_id: RequestId
    token_id: int | None
    completed: bool
    rejected: bool = False
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Metrics:
    dp_rank: int
    active_blocks: int
    total_blocks: int
    cache_usage: float
    running_requests: int
    waiting_requests: int
    preemptions_total: int
    sglang_cache_hit_tokens: int = 0
    sglang_cache_total_tokens: int = 0


@dataclass(frozen=True)
class ForwardPassMetrics:
    """The pass's batch as the pass log records it (variances and queued-work
    counts of the reference's ForwardPassMetrics are not recorded)."""
    num_prefill_requests: int
    sum_prefill_tokens: int
    sum_prefill_kv_tokens: int
    num_decode_requests: int
    sum_decode_kv_tokens: int
    duration_ms: float


@dataclass(frozen=True)
class CommandEffects:
    result: CommandResult
    lifecycle_events: tuple = ()
    kv_events: tuple[KvEvent, ...] = ()
    retired_requests: tuple[RequestId, ...] = ()
    metrics: Metrics | None = None
    suppressed_pending_output: bool = False


@dataclass(frozen=True)
class PassStartEffects:
    start_ms: float
    end_ms: float          # the modeled pass end: complete the pass then
    admissions: tuple[Admission, ...] = ()
    pressure_events: tuple[PressureEvent, ...] = ()
    kv_events: tuple[KvEvent, ...] = ()   # always empty: KV events are visible at completion


@dataclass(frozen=True)
class PassCompletionEffects:
    outputs: tuple[Output, ...]
    lifecycle_events: tuple
    kv_events: tuple[KvEvent, ...]
    metrics: Metrics
    forward_pass_metrics: ForwardPassMetrics | None


class RankError(ValueError):
    """A command the rank refuses (the rank is unchanged)."""
