"""Agentic Mooncake traces (``trace.agentic_graph``): what the loader builds from v2
and legacy rows (node order, plays, starts, hash interning, lowering of legacy rows),
the reference's refusals in its words with file and line, and the kernel feature an
agentic batch compiles (``kernels.features``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aisim_fast.kernels.features import ON, features_of
from aisim_fast.kernels.schema import layout as L
from aisim_fast.report.agentic import json_float
from aisim_fast.trace.agentic_graph import load_agentic_mooncake
from aisim_fast.trace.workload import TraceError

HEADER = {"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": 4, "hash_id_scope": "local",
          "source": {"format": "t", "digest": "d"}}


def row(rid, play="p", nb=0.0, deps=(), il=8, ol=2, hashes=None, **kw):
    r = {"request_id": rid, "play_id": play, "session_id": play, "model": "m", "input_length": il,
         "output_length": ol, "hash_ids": hashes if hashes is not None else list(range(1, (il + 3) // 4 + 1)),
         "not_before_ms": nb,
         "dependencies": [dict(request_id=d[0], trigger=d[1], delay_ms=d[2], relation=d[3]) for d in deps]}
    r.update(kw)
    return r


def write(tmp_path, rows, header=HEADER):
    path = tmp_path / "t.jsonl"
    lines = ([json.dumps(header)] if header is not None else []) + [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_nodes_are_numbered_by_request_id_and_hash_ids_interned_in_that_order(tmp_path):
    w = load_agentic_mooncake(write(tmp_path, [row("z", hashes=[7, 8]), row("a", hashes=[9, 7]),
                                               row("m", hashes=[8, 10])]))
    assert list(w.request_name) == ["a", "m", "z"]
    assert w.hash_ids.tolist() == [0, 1, 2, 3, 1, 2]  # a=[9,7], m=[8,10], z=[7,8]
    assert list(w.session) == [0, 1, 2]


def test_starts_are_rebased_on_every_request_and_sped_up(tmp_path):
    rows = [row("r0", "p", nb=1000.0), row("q0", "q", nb=1200.0),
            row("q1", "q", nb=900.0, deps=[("q0", "completion", 4.0, "sequence")])]
    w = load_agentic_mooncake(write(tmp_path, rows), arrival_speedup_ratio=2.0)
    g = w.agentic
    assert g.not_before_ms.tolist() == [150.0, 0.0, 50.0]  # q0, q1, r0
    assert g.dep_delay_ms.tolist() == [2.0]
    assert w.order.tolist() == [2, 0]  # the roots, by start


def test_lanes_start_the_first_plays_relative_to_their_roots(tmp_path):
    rows = [row("a0", "a", nb=50.0), row("a1", "a", nb=10.0), row("b0", "b", nb=500.0)]
    w = load_agentic_mooncake(write(tmp_path, rows), lanes=1)
    ready, started = w.agentic.initial_ready_ms()
    assert started.tolist() == [True, True, False]
    assert ready[:2].tolist() == [40.0, 0.0] and np.isnan(ready[2])


def test_root_and_spawning_parent(tmp_path):
    rows = [row("r"), row("a", deps=[("r", "completion", 0.0, "sequence")]),
            row("b", deps=[("r", "dispatch", 0.0, "spawn"), ("a", "completion", 0.0, "spawn")])]
    g = load_agentic_mooncake(write(tmp_path, rows)).agentic
    assert list(g.request_id) == ["a", "b", "r"]
    assert list(g.root_id()) == ["r", "r", "r"]
    assert list(g.parent_id()) == [None, "a", None]  # the spawning source of smallest node


def test_legacy_rows_lower_to_plays_of_connected_requests(tmp_path):
    rows = [{"request_id": "L0-0", "session_id": "L0", "input_length": 700, "output_length": 3,
             "hash_ids": [1, 2], "timestamp": 100.0},
            {"request_id": "L0-1", "input_length": 900, "output_length": 3, "hash_ids": [1, 2],
             "timestamp": 5000.0, "wait_for": ["L0-0"], "tool_wait_ms": 80.0, "delay": 5.0},
            {"request_id": "L1-0", "input_length": 10, "output_length": 1, "hash_ids": [3], "timestamp": 100.0}]
    g = load_agentic_mooncake(write(tmp_path, rows, header=None)).agentic
    assert list(g.play_id) == ["legacy-play:L0-0", "legacy-play:L0-0", "legacy-play:L1-0"]
    assert g.not_before_ms.tolist() == [100.0, 0.0, 100.0]  # a waiting row's timestamp is not read
    assert g.dep_delay_ms.tolist() == [85.0] and g.source_format == "legacy_agentic_mooncake"
    assert g.session_id[2] == "agentic-session" and g.block_size == 512


@pytest.mark.parametrize("rows, header, message", [
    ([row("a", hashes=[1])], HEADER, ":2: trace line 2 has input_length 8 at block_size 4 and requires exactly 2 "
                                     "hash_ids, got 1"),
    ([row("a"), row("a")], HEADER, "trace line 3 duplicates request_id a"),
    ([row("a", deps=[("b", "completion", 0.0, "sequence")])], HEADER, "request a references unknown request_id b"),
    ([row("a", deps=[("b", "completion", 0.0, "sequence")]), row("b", deps=[("a", "completion", 0.0, "join")])],
     HEADER, "cycle detected among 2 agentic requests; blocked request IDs: a, b"),
    ([row("a"), row("b", deps=[("a", "dispatch", 0.0, "sequence")])], HEADER,
     "trace line 3 has invalid Sequence dependency with Dispatch trigger"),
    ([row("a", "p"), row("b", "q", deps=[("a", "completion", 0.0, "sequence")])], HEADER,
     "request b in play q depends on request a in play p"),
    ([row("a", nb=-1)], HEADER, "trace line 2 has invalid not_before_ms -1"),
    ([row("a")], dict(HEADER, version=3), "unsupported agentic Mooncake version 3; expected 2"),
])
def test_refusals_are_the_references(tmp_path, rows, header, message):
    with pytest.raises(TraceError, match=None) as err:
        load_agentic_mooncake(write(tmp_path, rows, header))
    assert message in str(err.value) and str(err.value).startswith(str(tmp_path / "t.jsonl"))


def test_max_rows_keeps_whole_plays(tmp_path):
    rows = [row("a0", "a"), row("a1", "a", deps=[("a0", "completion", 0.0, "sequence")]), row("b0", "b")]
    assert load_agentic_mooncake(write(tmp_path, rows), max_rows=1).num_requests == 2  # the first play whole


def test_agentic_simulations_compile_the_agentic_feature():
    sims = L.SIMULATION.new(2)
    assert features_of(np.zeros((0, L.CFG_I_FIELDS), np.int64), sims).agentic is None
    sims[1, L.SM_AGENTIC] = 1
    assert features_of(np.zeros((0, L.CFG_I_FIELDS), np.int64), sims).agentic is ON


@pytest.mark.parametrize("x, text", [(0.0, "0.0"), (100.0, "100.0"), (1e16, "1e16"), (1e15, "1000000000000000.0"),
                                     (1e-5, "0.00001"), (1e-7, "1e-7"), (33.333333333333336, "33.333333333333336"),
                                     (-2.5, "-2.5"), (1.5e-7, "1.5e-7")])
def test_floats_are_written_as_the_references_json(x, text):
    assert json_float(x) == text
