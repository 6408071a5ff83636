"""The state buffers a run leaves for the next one (aisim_fast.engine.reused_buffers): lent
only when idle, and never read before they are written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from aisim_fast.engine import reused_buffers
from aisim_fast.engine.batch import run_batch
from support.goldens import simulation


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def keep_everything(monkeypatch):
    """Every array is kept, however small, starting from none."""
    monkeypatch.setattr(reused_buffers, "MIN_KEPT_BYTES", 0)
    reused_buffers.release()
    yield
    reused_buffers.release()


def test_a_buffer_is_lent_again_only_when_nothing_sees_it(keep_everything):
    a = reused_buffers.empty("t", 100, np.int64)
    b = reused_buffers.empty("t", 100, np.int64)
    assert not np.shares_memory(a, b)  # a is still in use
    at = _address(a)
    del a, b
    c = reused_buffers.empty("t", (5, 10), np.int32)  # smaller: the idle kept buffer
    assert _address(c) == at and c.shape == (5, 10) and c.dtype == np.int32
    derived = c[2:].T
    del c
    d = reused_buffers.empty("t", 10, np.int32)  # a view of a view still holds it
    assert not np.shares_memory(d, derived)
    del derived, d
    bigger = reused_buffers.empty("t", 1000, np.int64)  # too small now: replaced
    assert _address(bigger) != at and reused_buffers.kept_bytes() == 8000
    other = reused_buffers.empty("u", 10, np.int64)  # names do not share
    assert not np.shares_memory(bigger, other)


def test_small_arrays_are_not_kept(monkeypatch):
    reused_buffers.release()
    assert reused_buffers.empty("t", 10, np.int64).shape == (10,)
    assert reused_buffers.kept_bytes() == 0


KEPT = {"request_fields", "request_times", "lease", "seq_hash", "radix_pg32", "radix_pg_key",
        "radix_nodes", "radix_table", "radix_heap_time", "radix_heap_node", "block_fields",
        "block_hash", "block_table"}


ROUTER_KEPT = {"router_counts", "router_keys", "router_evicted"}


def _case(case: str):
    """A golden case, with ``+PLACEMENT`` another placement."""
    name, _, placement = case.partition("+")
    sim = simulation(name)
    return dataclasses.replace(sim, placement=placement) if placement else sim


@pytest.mark.parametrize("cases", [("1k_sglang_agg2", "1k_vllm_agg2"), ("1k_sglang_disagg1p2d", "seqs2"),
                                   ("1k_vllm_agg2+kv_router", "1k_sglang_agg2")])
def test_a_run_reads_nothing_a_previous_run_left(keep_everything, monkeypatch, cases):
    """Kept buffers filled with garbage between two runs change nothing: every kept
    array (request rows, leases, keys, radix pages, nodes, child tables and heaps,
    block arenas and tables, the KV router's active-block sets and evicted-hash lists)
    is written before it is read."""
    sims = [_case(case) for case in cases]
    routed = [s for s, sim in enumerate(sims) if sim.placement == "kv_router"]
    first = run_batch(sims)
    expected = [(first.requests[s].copy(), first.passes[s].copy(), first.token_stat[s].copy())
                for s in range(len(sims))]
    expected_routing = {s: first.routing[s].copy() for s in routed}
    del first  # its frames no longer hold any buffer
    idle = [name for name in reused_buffers._kept if reused_buffers._idle(name)]
    assert set(idle) == KEPT | (ROUTER_KEPT if routed else set())
    poisoned = {}  # name -> address (a reference would keep the buffer busy)
    for name in idle:
        reused_buffers._kept[name].fill(0x7F)  # int32 2139062143, float64 1.4e306
        poisoned[name] = _address(reused_buffers._kept[name])
    lent = set()
    take = reused_buffers.empty

    def watched(name, shape, dtype):
        out = take(name, shape, dtype)
        if poisoned.get(name) == _address(out):
            lent.add(name)
        return out

    monkeypatch.setattr(reused_buffers, "empty", watched)
    second = run_batch(sims)
    assert lent == set(idle)  # the second run had every poisoned buffer
    for s, routing in expected_routing.items():
        pd.testing.assert_frame_equal(routing, second.routing[s])
    for s, (requests, passes, token_stat) in enumerate(expected):
        pd.testing.assert_frame_equal(requests, second.requests[s])
        pd.testing.assert_frame_equal(passes, second.passes[s])
        np.testing.assert_array_equal(token_stat, second.token_stat[s])
