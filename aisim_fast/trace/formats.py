"""The trace formats a replay reads, by the name a payload gives them
(``traffic.trace_format``): one loader per format, each returning a ``Workload``."""

from __future__ import annotations

from functools import partial

from aisim_fast.trace.agentic_graph import load_agentic_mooncake
from aisim_fast.trace.agentic_snapshot import snapshot_workload
from aisim_fast.trace.applied_compute import load_applied_compute
from aisim_fast.trace.dynamo_requests import load_dynamo
from aisim_fast.trace.public_csv import PUBLIC_CSV_FORMATS, load_public_csv
from aisim_fast.trace.session_history import with_session_history
from aisim_fast.trace.weka import load_weka
from aisim_fast.trace.workload import Workload, load_mooncake

# the reference's names
TRACE_FORMATS = ("mooncake", "mooncake-delta", "applied_compute_agentic", "dynamo", "agentic_mooncake", "weka")
# read from several files as one trace (traffic.trace_paths)
MULTI_FILE_FORMATS = ("dynamo",)
# every format a replay reads: the reference's, then public CSVs it does not read
# (beyond the reference; a run reports them under ``beyond_reference``)
ALL_TRACE_FORMATS = TRACE_FORMATS + PUBLIC_CSV_FORMATS


def load_trace(path, trace_format: str = "mooncake", *, trace_block_size: int | None = None,
               arrival_speedup_ratio: float = 1.0, max_rows: int | None = None,
               closed_loop: bool = False, emits=None, more_paths=(), agentic_lanes: int | None = None,
               agentic_snapshot_seed: int | None = None, weka_basis: str = "auto") -> Workload:
    """Load ``path`` as ``trace_format`` (one of ``ALL_TRACE_FORMATS``).

    ``mooncake``: rows of whole prompts (``workload.load_mooncake``).
    ``mooncake-delta``: the same rows, each later turn carrying only its new input;
    prompts become the session's history (``session_history``), each turn adding the
    output ``emits(prompt_len, output_len)`` says it emits (the generating rank's
    rule; None: all of it).
    ``applied_compute_agentic``: tool-calling sessions (``applied_compute``).
    ``dynamo``: Dynamo's request records, ``path`` and ``more_paths`` read as one
    trace (``dynamo_requests``; ``trace_block_size`` None or 0: the trace's own, else it
    must match it); with ``agent_context`` a dependency graph (``dynamo_agentic``).
    The other formats' ``trace_block_size`` defaults to 512.
    ``agentic_mooncake``: dependency graphs of requests, v2 or legacy rows
    (``agentic_graph``; ``agentic_lanes``: plays run N at a time, None: all at once;
    ``agentic_snapshot_seed``: each lane replays a seeded cut of one play,
    ``agentic_snapshot``).
    ``weka``: Weka / AgentX plays, a file or a directory (``weka``; ``weka_basis``: how
    nested subagent times read, auto | absolute | relative).
    ``azure`` / ``burstgpt``: request lengths and arrivals only (``public_csv``;
    ``trace_block_size`` does not apply)."""
    # an agentic graph's seeded cuts replace it (agentic_snapshot)
    cut = None if agentic_snapshot_seed is None else partial(snapshot_workload, seed=agentic_snapshot_seed)
    if trace_format not in ALL_TRACE_FORMATS:
        raise ValueError(f"trace_format must be one of {', '.join(ALL_TRACE_FORMATS)}, got {trace_format!r}")
    if more_paths and trace_format not in MULTI_FILE_FORMATS:
        raise ValueError(f"trace format {trace_format!r} takes one file, got {1 + len(more_paths)}")
    if trace_format == "applied_compute_agentic":
        return load_applied_compute(path, trace_block_size=trace_block_size or 512,
                                    arrival_speedup_ratio=arrival_speedup_ratio, max_rows=max_rows)
    if trace_format == "agentic_mooncake":
        return load_agentic_mooncake(path, trace_block_size=trace_block_size or None,
                                     arrival_speedup_ratio=arrival_speedup_ratio, lanes=agentic_lanes,
                                     max_rows=max_rows, cut=cut)
    if trace_format == "weka":
        return load_weka(path, trace_block_size=trace_block_size or None, arrival_speedup_ratio=arrival_speedup_ratio,
                         lanes=agentic_lanes, max_rows=max_rows, cut=cut, basis=weka_basis)
    if trace_format == "dynamo":
        return load_dynamo([path, *more_paths], trace_block_size=trace_block_size or None,
                           arrival_speedup_ratio=arrival_speedup_ratio, max_rows=max_rows,
                           agentic_lanes=agentic_lanes, cut=cut)
    if agentic_lanes is not None:
        raise ValueError("agentic_lanes requires weka, agentic_mooncake, or agentic Dynamo input")
    if trace_format in PUBLIC_CSV_FORMATS:
        return load_public_csv(path, trace_format, arrival_speedup_ratio=arrival_speedup_ratio, max_rows=max_rows)
    w = load_mooncake(path, trace_block_size=trace_block_size or 512, arrival_speedup_ratio=arrival_speedup_ratio,
                      max_rows=max_rows, closed_loop=closed_loop)
    if trace_format == "mooncake-delta":
        w = with_session_history(w, emits)
    return w
