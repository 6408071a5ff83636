"""KV transfer timing of a handoff on numpy arrays: the inputs a source publishes, their
validation, the delay (``kernels.disagg.transfer_timing``'s formula and fallback rule)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from aisim_fast.kernels.disagg.transfer_timing import kv_transfer_ms, transfer_is_modeled


class TransferTimingMode(enum.IntEnum):
    """Which prompt footprint is charged to the KV transfer."""

    FULL_PROMPT = 0
    DESTINATION_MISSING = 1

    @property
    def wire_name(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: "TransferTimingMode | int | str") -> "TransferTimingMode":
        """Accept the enum, its integer code or the engine-arg spelling."""
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(
                    f"unknown kv_transfer_timing_mode {value!r}; "
                    "expected 'full_prompt' or 'destination_missing'"
                ) from None
        return cls(int(value))


class TransferTimingError(ValueError):
    """Invalid transfer-timing inputs; ``indices`` are the offending elements."""

    def __init__(self, message: str, indices: Sequence[int] = ()):
        super().__init__(message)
        self.indices = np.asarray(indices, dtype=np.int64)


@dataclass
class TransferTimingArrays:
    """Transfer-timing inputs for many handoffs, one element per handoff.

    Absent optional values are NaN.  ``has_kv_bytes_per_token`` and
    ``has_bandwidth_gb_s`` default to "not NaN"; pass them explicitly when a
    present-but-NaN value must be rejected rather than treated as absent.
    """

    mode: np.ndarray
    full_prompt_tokens: np.ndarray
    kv_bytes_per_token: np.ndarray
    bandwidth_gb_s: np.ndarray
    state_bytes: np.ndarray | None = None
    has_kv_bytes_per_token: np.ndarray | None = None
    has_bandwidth_gb_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.mode = np.atleast_1d(np.asarray(self.mode, dtype=np.int64))
        n = self.mode.shape[0]
        self.full_prompt_tokens = broadcast_column(self.full_prompt_tokens, n, np.int64, "full_prompt_tokens")
        self.kv_bytes_per_token = broadcast_column(self.kv_bytes_per_token, n, np.float64, "kv_bytes_per_token")
        self.bandwidth_gb_s = broadcast_column(self.bandwidth_gb_s, n, np.float64, "bandwidth_gb_s")
        self.state_bytes = broadcast_column(
            0.0 if self.state_bytes is None else self.state_bytes, n, np.float64, "state_bytes"
        )
        if self.has_kv_bytes_per_token is None:
            self.has_kv_bytes_per_token = ~np.isnan(self.kv_bytes_per_token)
        else:
            self.has_kv_bytes_per_token = broadcast_column(self.has_kv_bytes_per_token, n, bool, "has_kv_bytes_per_token")
        if self.has_bandwidth_gb_s is None:
            self.has_bandwidth_gb_s = ~np.isnan(self.bandwidth_gb_s)
        else:
            self.has_bandwidth_gb_s = broadcast_column(self.has_bandwidth_gb_s, n, bool, "has_bandwidth_gb_s")

    def __len__(self) -> int:
        return int(self.mode.shape[0])

    def take(self, idx: np.ndarray) -> "TransferTimingArrays":
        return TransferTimingArrays(
            self.mode[idx],
            self.full_prompt_tokens[idx],
            self.kv_bytes_per_token[idx],
            self.bandwidth_gb_s[idx],
            self.state_bytes[idx],
            self.has_kv_bytes_per_token[idx],
            self.has_bandwidth_gb_s[idx],
        )


def broadcast_column(values, n: int, dtype, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=dtype)
    if arr.ndim == 0:
        return np.full(n, arr, dtype=dtype)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name} has shape {arr.shape}; expected a scalar or ({n},)")
    return arr


def _delay_ms_unchecked(
    tokens: np.ndarray,
    kv_bytes_per_token: np.ndarray,
    has_kv_bytes_per_token: np.ndarray,
    bandwidth_gb_s: np.ndarray,
    has_bandwidth_gb_s: np.ndarray,
    state_bytes: np.ndarray,
) -> np.ndarray:
    """The delay formula (``kernels.disagg.transfer_timing``, the one the kernels use), NaN
    where the model is incomplete. Adding ``state_bytes`` = 0 does not change the
    product.
    """
    # the kernels' rule (transfer_is_modeled), an absent value read as unknown (NaN)
    defined = transfer_is_modeled(np.where(has_kv_bytes_per_token, kv_bytes_per_token, np.nan),
                                  np.where(has_bandwidth_gb_s, bandwidth_gb_s, np.nan))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        delay_ms = kv_transfer_ms(tokens.astype(np.float64), kv_bytes_per_token, state_bytes,
                                  bandwidth_gb_s)
    return np.where(defined, delay_ms, np.nan)


def transfer_timing_violations(timing: TransferTimingArrays) -> dict[int, str]:
    """Map element index -> reason for every handoff whose timing inputs are invalid.

    Rules (first failing rule is reported): a known mode; non-negative
    ``full_prompt_tokens``; a present bandwidth must be finite and >= 0; present
    per-token bytes and the state bytes must be finite and >= 0; the
    full-prompt delay they imply must be finite and >= 0.  A bandwidth of
    exactly 0 is valid: it means "no timing model" and selects the fallback.
    """
    reasons: dict[int, str] = {}

    def flag(mask: np.ndarray, describe) -> None:
        for i in np.flatnonzero(mask):
            reasons.setdefault(int(i), describe(int(i)))

    bw = timing.bandwidth_gb_s
    kv = timing.kv_bytes_per_token
    flag(
        (timing.mode != TransferTimingMode.FULL_PROMPT) & (timing.mode != TransferTimingMode.DESTINATION_MISSING),
        lambda i: f"unknown transfer timing mode {int(timing.mode[i])}",
    )
    flag(
        timing.full_prompt_tokens < 0,
        lambda i: f"invalid handoff transfer full_prompt_tokens {int(timing.full_prompt_tokens[i])}",
    )
    with np.errstate(invalid="ignore"):
        flag(
            timing.has_bandwidth_gb_s & ~(np.isfinite(bw) & (bw >= 0.0)),
            lambda i: f"invalid handoff transfer bandwidth_gb_s {float(bw[i])!r}",
        )
        flag(
            timing.has_kv_bytes_per_token & ~(np.isfinite(kv) & (kv >= 0.0)),
            lambda i: f"invalid handoff transfer kv_bytes_per_token {float(kv[i])!r}",
        )
        flag(
            ~(np.isfinite(timing.state_bytes) & (timing.state_bytes >= 0.0)),
            lambda i: f"invalid handoff transfer state_bytes {float(timing.state_bytes[i])!r}",
        )
    full_delay_ms = _delay_ms_unchecked(
        timing.full_prompt_tokens,
        kv,
        timing.has_kv_bytes_per_token,
        bw,
        timing.has_bandwidth_gb_s,
        timing.state_bytes,
    )
    flag(invalid_delay_mask(full_delay_ms), lambda i: f"invalid handoff transfer delay {float(full_delay_ms[i])!r} ms")
    return dict(sorted(reasons.items()))


def invalid_delay_mask(delay_ms: np.ndarray) -> np.ndarray:
    """NaN means "undefined" (fallback) and is fine; inf and negatives are not."""
    with np.errstate(invalid="ignore"):
        return ~np.isnan(delay_ms) & (~np.isfinite(delay_ms) | (delay_ms < 0.0))


def _raise_timing_violations(reasons: dict[int, str]) -> None:
    if not reasons:
        return
    shown = "; ".join(f"[{i}] {r}" for i, r in list(reasons.items())[:10])
    more = f" (and {len(reasons) - 10} more)" if len(reasons) > 10 else ""
    raise TransferTimingError(f"invalid transfer timing: {shown}{more}", list(reasons))


def transfer_delay_ms(
    timing: TransferTimingArrays,
    destination_missing_tokens: np.ndarray | int = 0,
) -> np.ndarray:
    """Vectorised KV transfer delay in ms; NaN where the timing model is incomplete.

    ``destination_missing_tokens`` is only read for rows in
    ``destination_missing`` mode (it is the destination's block-rounded
    ``transferable_prompt_tokens``).  Raises ``TransferTimingError`` naming
    the field and element when any input is invalid.
    """
    _raise_timing_violations(transfer_timing_violations(timing))
    missing = broadcast_column(destination_missing_tokens, len(timing), np.int64, "destination_missing_tokens")
    uses_missing = timing.mode == TransferTimingMode.DESTINATION_MISSING
    bad_missing = uses_missing & (missing < 0)
    if bad_missing.any():
        _raise_timing_violations(
            {int(i): f"invalid destination_missing_tokens {int(missing[i])}" for i in np.flatnonzero(bad_missing)}
        )
    delay_ms = timing_delay_ms(timing, missing)
    bad_delay = invalid_delay_mask(delay_ms)
    if bad_delay.any():
        _raise_timing_violations(
            {int(i): f"invalid handoff transfer delay {float(delay_ms[i])!r} ms" for i in np.flatnonzero(bad_delay)}
        )
    return delay_ms


def timing_delay_ms(timing: TransferTimingArrays, destination_missing_tokens: np.ndarray) -> np.ndarray:
    tokens = np.where(
        timing.mode == TransferTimingMode.DESTINATION_MISSING,
        destination_missing_tokens,
        timing.full_prompt_tokens,
    )
    return _delay_ms_unchecked(
        tokens,
        timing.kv_bytes_per_token,
        timing.has_kv_bytes_per_token,
        timing.bandwidth_gb_s,
        timing.has_bandwidth_gb_s,
        timing.state_bytes,
    )


def resolve_transfer_delay_ms(delay_ms: np.ndarray, fallback_transfer_delay_ms: np.ndarray | float) -> np.ndarray:
    """Replace undefined (NaN) delays by the configured fallback ``handoff_latency_ms``."""
    delay_ms = np.asarray(delay_ms, dtype=np.float64)
    return np.where(np.isnan(delay_ms), fallback_transfer_delay_ms, delay_ms)


def validate_transfer_delay_ms(transfer_delay_ms: float | None) -> None:
    """None (undefined) is fine; a present delay must be finite and >= 0."""
    if transfer_delay_ms is None:
        return
    delay_ms = float(transfer_delay_ms)
    if not math.isfinite(delay_ms) or delay_ms < 0.0:
        raise TransferTimingError(f"invalid handoff transfer delay {delay_ms!r} ms", [0])


@dataclass(frozen=True)
class HandoffTransferTiming:
    """Scalar transfer-timing inputs of one handoff (what SourceHeld carries)."""

    mode: TransferTimingMode = TransferTimingMode.FULL_PROMPT
    full_prompt_tokens: int = 0
    kv_bytes_per_token: int | None = None
    bandwidth_gb_s: float | None = None
    # Per-request bytes (recurrent state etc.); always 0 in the observed runs.
    state_bytes: int = 0

    def as_arrays(self) -> TransferTimingArrays:
        # Presence is explicit so a NaN given on purpose is rejected as
        # non-finite instead of silently meaning "absent".
        return TransferTimingArrays(
            mode=np.array([int(TransferTimingMode.parse(self.mode))], dtype=np.int64),
            full_prompt_tokens=np.array([self.full_prompt_tokens], dtype=np.int64),
            kv_bytes_per_token=np.array(
                [np.nan if self.kv_bytes_per_token is None else self.kv_bytes_per_token], dtype=np.float64
            ),
            bandwidth_gb_s=np.array([np.nan if self.bandwidth_gb_s is None else self.bandwidth_gb_s], dtype=np.float64),
            state_bytes=np.array([self.state_bytes], dtype=np.float64),
            has_kv_bytes_per_token=np.array([self.kv_bytes_per_token is not None]),
            has_bandwidth_gb_s=np.array([self.bandwidth_gb_s is not None]),
        )

    def delay_ms(self, destination_missing_tokens: int = 0) -> float | None:
        """Transfer delay in ms, or None when the caller must use its fallback."""
        delay_ms = float(transfer_delay_ms(self.as_arrays(), destination_missing_tokens)[0])
        return None if math.isnan(delay_ms) else delay_ms

    def full_prompt_delay_ms(self) -> float | None:
        """Delay charged for the full prompt irrespective of ``mode``."""
        arrays = self.as_arrays()
        arrays.mode[:] = TransferTimingMode.FULL_PROMPT
        delay_ms = float(transfer_delay_ms(arrays, 0)[0])
        return None if math.isnan(delay_ms) else delay_ms


def validate_transfer_timing(timing: HandoffTransferTiming) -> None:
    """Raise ``TransferTimingError`` when the timing inputs are unusable."""
    _raise_timing_violations(transfer_timing_violations(timing.as_arrays()))


def prefill_handoff_delay_ms(
    worker_type: str,
    completed: bool,
    num_input_tokens: int,
    bandwidth_gb_s: float | None,
    kv_bytes_per_token: int | None,
) -> float | None:
    """Client-visible prefill-to-decode delay: only a completed prefill-worker request crosses it."""
    if str(worker_type).lower() != "prefill" or not completed:
        return None
    return HandoffTransferTiming(
        mode=TransferTimingMode.FULL_PROMPT,
        full_prompt_tokens=num_input_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        bandwidth_gb_s=bandwidth_gb_s,
    ).full_prompt_delay_ms()
