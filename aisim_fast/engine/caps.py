"""A simulated-time cap (spec replay.md 12.11): what a capped simulation keeps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class CapFacts:
    """What a simulation with a time cap reports besides its records (spec replay.md
    12.11): every arrival by the cap counts, worker-seconds run to its last instant at
    or before the cap, and only passes that end by the cap commit prefill tokens."""
    cap_ms: float
    num_requests: int            # arrivals at or before the cap
    last_instant_ms: float       # the last arrival, pass end or transfer at or before the cap
    committed_prefill_tokens: int


def until_cap(table, cap_ms: float, column: str):
    """The rows of a result table (a frame, or an Arrow table of passes) that happened
    by the cap, by its cap column (``engine.tables``): requests terminal by then, passes
    that end by then, events and decisions at or before it. A pass that ends after the
    cap is dropped whole."""
    if isinstance(table, pd.DataFrame):
        kept = table[table[column].to_numpy(np.float64) <= cap_ms]
        # requests keep their trace rows as the index (``requests_in_uuid_order``)
        return kept if column == "completion_ms" else kept.reset_index(drop=True)
    import pyarrow.compute as pc
    return table.filter(pc.less_equal(table[column], cap_ms))
