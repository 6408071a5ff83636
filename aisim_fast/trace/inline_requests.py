"""Requests given inline in a payload (``spec.requests``, what the reference's runner
sends when its workload is a list of requests rather than a trace), checked and lowered
to a ``Workload``.

As the reference lowers them: each request is its own single-turn session whose
arrival is ``arrival_time_ms`` as written (not re-based), released in arrival order
(equal arrivals in list order); its prompt is ``input_token_ids`` when given, else
``input_tokens`` tokens ``seed + 0, seed + 1, ...`` with ``seed = index * 1,000,003``
(u32 arithmetic, ``index`` its place in the list), so length-only requests share no
prefix (the first request's tokens are 0, 1, 2, ...). The prompt is held as one-token
trace blocks (``trace_block_size`` 1): block hashing then reads the tokens themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_U32_END = 1 << 32
_SEED_STRIDE = 1_000_003  # the reference's per-request token seed step
_FIELDS = ("id", "arrival_time_ms", "input_tokens", "input_token_ids", "output_tokens",
           "output_token_ids", "dp_rank", "prefill_dp_rank", "session_id", "turn_index", "metadata")
# metadata keys the reference reads for routing, at the values that change nothing
_NEUTRAL_METADATA = {"priority": 0, "strict_priority": 0, "policy_class": None}


class InlineRequestError(ValueError):
    """An inline request the reference refuses or aisim_fast does not simulate."""


@dataclass(frozen=True)
class InlineRequest:
    id: str
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    input_token_ids: tuple | None = None  # None: length only (synthesized as the reference does)


def _fail(path: str, message: str):
    raise InlineRequestError(f"{path}: {message}")


def _count(path: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"must be an integer >= {minimum}, got {value!r}")
    return value


def parse_inline_requests(raw: Any, path: str = "spec.requests") -> tuple[InlineRequest, ...]:
    """Every request of ``spec.requests`` checked: the reference's rules (a non-empty
    unique id, a finite non-negative arrival, ``input_token_ids`` as long as
    ``input_tokens`` and of u32 tokens) and the fields not simulated refused."""
    if not isinstance(raw, list):
        _fail(path, f"must be a list of requests, got {raw!r}")
    out = []
    seen = set()
    for i, req in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(req, dict):
            _fail(where, f"must be an object, got {req!r}")
        for key in req:
            if key not in _FIELDS:
                _fail(f"{where}.{key}", "unknown field; allowed: " + ", ".join(_FIELDS))
        rid = req.get("id")
        if not isinstance(rid, str) or not rid:
            _fail(f"{where}.id", f"must be a non-empty string, got {rid!r}")
        if rid in seen:
            _fail(f"{where}.id", f"duplicate request id {rid!r}")
        seen.add(rid)
        arrival = req.get("arrival_time_ms")
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) \
                or arrival < 0:
            _fail(f"{where}.arrival_time_ms", f"must be finite and non-negative, got {arrival!r}")
        n_in = _count(f"{where}.input_tokens", req.get("input_tokens"), 1)
        ids = req.get("input_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _U32_END for t in ids):
                _fail(f"{where}.input_token_ids", "must be a list of unsigned 32-bit token ids")
            if len(ids) != n_in:
                _fail(f"{where}.input_token_ids", f"declares {n_in} input tokens but materializes "
                                                  f"{len(ids)} token ids")
        n_out = _count(f"{where}.output_tokens", req.get("output_tokens"), 1)
        for key, what in (("output_token_ids", "an authored output plan of an inline request"),
                          ("dp_rank", "a preferred attention-DP rank"),
                          ("prefill_dp_rank", "a preferred attention-DP rank")):
            if req.get(key) is not None:
                _fail(f"{where}.{key}", f"{what} is not simulated; only null is accepted")
        metadata = req.get("metadata")
        if metadata is not None:
            if not isinstance(metadata, dict):
                _fail(f"{where}.metadata", f"must be an object or null, got {metadata!r}")
            for key, neutral in _NEUTRAL_METADATA.items():
                if metadata.get(key, neutral) != neutral:
                    _fail(f"{where}.metadata.{key}", "request priorities are not simulated; only "
                                                     f"{neutral!r} is accepted")
        out.append(InlineRequest(rid, float(arrival), n_in, n_out,
                                 None if ids is None else tuple(ids)))
    if not out:
        _fail(path, "empty: give at least one request, or a trace in traffic")
    return tuple(out)


def inline_workload(requests: tuple[InlineRequest, ...], max_rows: int | None = None):
    """The requests (the first ``max_rows`` of the list) as a ``trace.workload.Workload``."""
    # here, not at the top: the payload parser reads requests without the trace loader
    from aisim_fast.trace.workload import Workload
    reqs = requests if max_rows is None else requests[:max_rows]
    n = len(reqs)
    input_len = np.array([r.input_tokens for r in reqs], np.int64)
    output_len = np.array([r.output_tokens for r in reqs], np.int64)
    indptr = np.concatenate([[0], np.cumsum(input_len)]).astype(np.int64)
    tokens = np.empty(int(indptr[-1]), np.uint32)
    for i, r in enumerate(reqs):
        if r.input_token_ids is not None:
            tokens[indptr[i]:indptr[i + 1]] = r.input_token_ids
        else:
            seed = (i * _SEED_STRIDE) % _U32_END
            tokens[indptr[i]:indptr[i + 1]] = (seed + np.arange(r.input_tokens, dtype=np.uint64)) % _U32_END
    start_ms = np.array([r.arrival_ms for r in reqs], np.float64)
    session = np.arange(n, dtype=np.int32)
    names = np.empty(n, dtype=object)
    names[:] = [r.id for r in reqs]
    return Workload(
        path="spec.requests",
        trace_block_size=1,
        line_no=np.arange(1, n + 1, dtype=np.int64),
        request_name=names,
        session=session,
        turn_index=np.zeros(n, np.int32),
        start_ms=start_ms,
        delay_ms=np.zeros(n, np.float64),
        input_len=input_len,
        output_len=output_len,
        hash_indptr=indptr,
        hash_ids=tokens,
        # equal arrivals keep list order, as the reference's stable sort does
        order=np.argsort(start_ms, kind="stable").astype(np.int64),
    )
