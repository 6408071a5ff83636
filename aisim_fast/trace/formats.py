"""The trace formats a replay reads, by the name a payload gives them
(``traffic.trace_format``): one loader per format, each returning a ``Workload``."""

from __future__ import annotations

from aisim_fast.trace.public_csv import PUBLIC_CSV_FORMATS, load_public_csv
from aisim_fast.trace.session_history import with_session_history
from aisim_fast.trace.workload import Workload, load_mooncake

# the reference's names
TRACE_FORMATS = ("mooncake", "mooncake-delta")
# every format a replay reads: the reference's, then public CSVs it does not read
# (beyond the reference; a run reports them under ``beyond_reference``)
ALL_TRACE_FORMATS = TRACE_FORMATS + PUBLIC_CSV_FORMATS


def load_trace(path, trace_format: str = "mooncake", *, trace_block_size: int = 512,
               arrival_speedup_ratio: float = 1.0, max_rows: int | None = None,
               closed_loop: bool = False, emits=None) -> Workload:
    """Load ``path`` as ``trace_format`` (one of ``ALL_TRACE_FORMATS``).

    ``mooncake``: rows of whole prompts (``workload.load_mooncake``).
    ``mooncake-delta``: the same rows, each later turn carrying only its new input;
    prompts become the session's history (``session_history``), each turn adding the
    output ``emits(prompt_len, output_len)`` says it emits (the generating rank's
    rule; None: all of it).
    ``azure`` / ``burstgpt``: request lengths and arrivals only (``public_csv``;
    ``trace_block_size`` does not apply)."""
    if trace_format not in ALL_TRACE_FORMATS:
        raise ValueError(f"trace_format must be one of {', '.join(ALL_TRACE_FORMATS)}, got {trace_format!r}")
    if trace_format in PUBLIC_CSV_FORMATS:
        return load_public_csv(path, trace_format, arrival_speedup_ratio=arrival_speedup_ratio, max_rows=max_rows)
    w = load_mooncake(path, trace_block_size=trace_block_size, arrival_speedup_ratio=arrival_speedup_ratio,
                      max_rows=max_rows, closed_loop=closed_loop)
    if trace_format == "mooncake-delta":
        w = with_session_history(w, emits)
    return w
