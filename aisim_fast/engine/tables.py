"""The result tables of a simulation, declared once.

Each table has a name (the key of ``BatchResult.tables``, the ``BatchRun`` method that
builds it from kernel state, the stem of its run-folder file), the column a time cap
keeps rows by, and how a simulation split into worker units (``engine.split``) gets
one table back. Adding a table: a row here, a ``BatchRun.<name>(s)`` builder, and the
simulations that record it either never split (``UNSPLIT``) or a merge rule in
``engine.batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a split simulation's worker units give one table (engine.batch.merge_units)
BY_TRACE_ROW = "by_trace_row"        # rows back in trace order, each unit's worker numbered in the simulation
BY_PASS_START = "by_pass_start"      # concatenated, each unit's worker, ordered by (start_ms, worker)
NONE_WHEN_SPLIT = "none_when_split"  # only aggregated simulations split, and they have none of these rows
UNSPLIT = "unsplit"                  # a simulation that records this table always runs whole


@dataclass(frozen=True)
class ResultTable:
    name: str
    cap_column: str   # a capped simulation keeps the rows with this time at or before the cap
    merge: str        # BY_TRACE_ROW, BY_PASS_START, NONE_WHEN_SPLIT or UNSPLIT
    doc: str

    @property
    def file(self) -> str:
        """Its file in a run folder."""
        return f"{self.name}.parquet"


TABLES: dict[str, ResultTable] = {t.name: t for t in (
    ResultTable("requests", "completion_ms", BY_TRACE_ROW,
                "one row per request (trace row), the reference's per-request columns"),
    ResultTable("passes", "end_ms", BY_PASS_START, "one row per forward pass (ForwardPassMetrics)"),
    ResultTable("handoffs", "time_ms", NONE_WHEN_SPLIT,
                "one row per handoff lifecycle event (record_handoffs; disaggregated only)"),
    ResultTable("kv_events", "at_ms", UNSPLIT, "one row per KV Stored / Removed event (record_events)"),
    ResultTable("engine_events", "time_ms", UNSPLIT,
                "one row per admission, preemption or finish (record_events, record_pressure)"),
    ResultTable("pressure_events", "at_ms", UNSPLIT,
                "one row per vLLM preemption or SGLang retraction (record_events, record_pressure)"),
    ResultTable("output_events", "time_ms", UNSPLIT, "one row per output token (record_outputs)"),
    ResultTable("routing", "time_ms", UNSPLIT, "one row per kv_router decision (kv_router placement)"),
)}
EVENT_TABLES = ("kv_events", "engine_events", "pressure_events", "output_events", "routing")
