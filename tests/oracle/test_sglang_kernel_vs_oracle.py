"""The SGLang kernels against the plain-Python SGLang oracle (tests/support/oracle_sglang.py)
on random small replays: tight page pools (eviction, retraction), page sizes 1 to 16,
fifo and lpm, chunk budgets, clipped output reserves, closed loop. Every column of
every request agrees, or both stop at a dead end."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from test_oracle_sglang import _random_case, _write_trace

from aisim_fast.config.payload import parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from support import oracle
from support.oracle_sglang import reference_row
from support.parity_rules import as_key_part, row_differences

SEEDS = range(40)


def _kernel(spec, path):
    setup = parse_payload(spec, Path(path).parent, trace_override=path)
    res = run_batch([simulation_from_setup(setup)])
    return res.status[0], res.error[0], (res.requests[0] if res.status[0] == "ok" else None)


@pytest.mark.bounds
@pytest.mark.parametrize("seed", SEEDS)
def test_kernels_match_the_oracle(seed):
    rows, spec = _random_case(seed)
    path = _write_trace(rows)
    try:
        try:
            records, _ = oracle.run(spec, path)
        except RuntimeError as error:
            assert "replay dead end" in str(error)
            records = None
        status, error, frame = _kernel(spec, path)
    finally:
        os.unlink(path)
    if records is None:
        assert status == "dead_end", f"the oracle dead-ends, the kernels: {status} {error}"
        return
    assert status == "ok", error
    cand = {(str(r["request_id"]), as_key_part(r["turn_index"])): r for r in frame.to_dict("records")}
    bad = []
    for record in records:
        gold = reference_row(record)
        key = (str(gold["request_id"]), as_key_part(gold["turn_index"]))
        bad += [(key, col, g, c) for col, g, c in row_differences(gold, cand[key])]
    assert not bad, f"{len(bad)} cells differ, first: {bad[:5]}"


@pytest.mark.parametrize("seed", range(12))
def test_radix_kv_events_follow_the_tree(seed):
    """The radix cache's KV events on random small replays (tight pools, page sizes 1
    to 16): a Stored block is not visible before it and a Removed one is, a Stored
    event's parent is visible, positions number each event's rows; recording them
    changes no request."""
    rows, spec = _random_case(seed)
    path = _write_trace(rows)
    try:
        setup = parse_payload(spec, Path(path).parent, trace_override=path)
        plain = run_batch([simulation_from_setup(setup)])
        res = run_batch([simulation_from_setup(setup)], record_events=True)
    finally:
        os.unlink(path)
    assert res.status[0] == plain.status[0]
    if res.status[0] != "ok":
        return
    assert res.requests[0].equals(plain.requests[0])
    events = res.kv_events[0]
    visible = {}  # worker -> its visible block hashes
    last = {}  # worker -> (event id, position) of its latest row
    for e in events.itertuples():
        h = int(e.block_hash)
        mine = visible.setdefault(e.worker, set())
        event_id, position = last.get(e.worker, (-1, -1))
        first = e.event_id != event_id
        assert e.event_id == (event_id + 1 if first else event_id)
        assert e.position == (0 if first else position + 1)
        last[e.worker] = (e.event_id, e.position)
        if e.kind == "stored":
            if first and e.parent_hash is not pd.NA:
                assert int(e.parent_hash) in mine
            assert h not in mine
            mine.add(h)
        else:
            assert h in mine
            mine.remove(h)
    # a worker reports its facts in order: its rows' times never go back
    assert all(g["at_ms"].is_monotonic_increasing for _, g in events.groupby("worker"))
    if (res.requests[0]["cached_tokens"] > 0).any():
        assert (events["kind"] == "stored").any()
