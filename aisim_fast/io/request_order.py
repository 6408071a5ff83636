"""Requests in the reference's order: by canonical request uuid (the ordinal of each
(session, turn) in session-major order)."""

from __future__ import annotations

import numpy as np
import pandas as pd

# ---------------------------------------------------------------------------------------
# request order and summary


def uuid_order(session, turn_index) -> np.ndarray:
    """Row permutation that puts trace rows in request-id (uuid) order.

    Under ``determinism: canonical_v1`` the reference numbers requests 1, 2, 3, ... in
    session-major order: sessions in order of first appearance in the file, each
    session's turns in file order (spec output-plan.md 3.1). That is neither file order
    nor arrival order once a trace has multi-turn sessions, and the summary means must
    be summed in this order to match the reference bit for bit (report.py docstring).
    """
    return np.lexsort((np.asarray(turn_index), np.asarray(session)))


def canonical_uuid(ordinal: int) -> str:
    """The reference's canonical_v1 uuid string of a 1-based ordinal."""
    text = f"{ordinal:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


_UUIDS = np.zeros(0, dtype=object)  # canonical_uuid(1..n), kept: a sweep asks for them per point


def canonical_uuids(n: int) -> np.ndarray:
    """``canonical_uuid(1)`` .. ``canonical_uuid(n)`` as an object array."""
    global _UUIDS
    if len(_UUIDS) < n:
        _UUIDS = np.array([canonical_uuid(i + 1) for i in range(max(n, 2 * len(_UUIDS)))], dtype=object)
    return _UUIDS[:n]


def requests_in_uuid_order(frame: pd.DataFrame, session, turn_index) -> pd.DataFrame:
    """The simulator's request frame (trace-row order) re-ordered by uuid, with a
    ``uuid`` column spelled as in the golden CSVs so rows can be joined with them.
    A frame of some of the rows (a run with a time cap keeps its terminal requests,
    indexed by trace row) keeps each row's uuid among all of them."""
    order = uuid_order(session, turn_index)
    if len(frame) == len(order):
        out = frame.iloc[order].reset_index(drop=True)
        out["uuid"] = canonical_uuids(len(out))
        return out
    kept = np.isin(order, frame.index.to_numpy())
    out = frame.loc[order[kept]].reset_index(drop=True)
    out["uuid"] = canonical_uuids(len(order))[kept]
    return out
