"""KV events, output token ids and block hashes as the reference emits them.

Reference runs with per-token artifacts (``ref_replay.py --artifacts``: one aggregated
worker) are replayed with ``emit_kv_events`` and compared field by field: every KV
event (rank-local id, visibility time, kind, parent, each block's sequence and
tokens-only hash), every output token id with its time, and every prompt block hash.
The cases (``tests/data/kv_events/*/flags.txt``) bind KV pressure with small blocks
(evictions: Removed events), FIFO preemption, sessions with shared prefixes, authored
``output_token_ids`` with ``max_model_len`` rejections, TRT-LLM and no chunked prefill.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import xxhash

from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.kernels.hashing.xxh3 import hash_token_blocks
from aisim_fast.kernels.trace.output_plan import plan_offsets, plan_words
from aisim_fast.trace.workload import load_mooncake, prompt_tokens, select_rows, sequence_tokens
from support.kv_artifacts import (ARTIFACT_CASES, artifact_case, kv_event_rows, reference_kv_events,
                                  reference_tokens, row_of_uuid, token_rows)
from support.lanes import lane
from support.paths import DATA_DIR

DATA = DATA_DIR
# the SGLang runs (sglang-*) have their own tests below
CASES = [name for name in ARTIFACT_CASES if not name.startswith("sglang")]


def _case(name):
    """(simulation with KV events on, the reference's artifacts)."""
    setup, artifacts = artifact_case(name, emit_kv_events=True)
    return simulation_from_setup(setup), artifacts


@pytest.mark.parametrize("name", lane(CASES))
def test_kv_events_equal_the_references(name):
    sim, artifacts = _case(name)
    frame = run_batch([sim], record_events=True).check().kv_events[0]
    gold = reference_kv_events(artifacts)
    assert len(gold) > 0
    assert set(frame["worker"]) == {0} and set(frame["dp_rank"]) == {0}
    assert kv_event_rows(frame) == gold


@pytest.mark.parametrize("name", lane(CASES))
def test_output_token_ids_equal_the_references(name):
    """Every emitted token id and its time, per request (preempted requests resume
    their plan, truncated ones emit a prefix, rejected ones none)."""
    sim, artifacts = _case(name)
    out = run_batch([sim], record_outputs=True).check().output_events[0]
    gold = reference_tokens(artifacts, sim.workload)
    assert sum(map(len, gold.values())) > 0
    assert token_rows(out, sim.workload) == gold


SGLANG_CASES = [name for name in ARTIFACT_CASES if name.startswith("sglang")]


@pytest.mark.parametrize("name", lane(SGLANG_CASES))
def test_sglang_output_token_ids_equal_the_references(name):
    """SGLang ranks (pages of 1, 4 and 16, pools tight enough to retract) emit the same
    plan: every token id and its time."""
    setup, artifacts = artifact_case(name)
    sim = simulation_from_setup(setup)
    res = run_batch([sim], record_outputs=True).check()
    gold = reference_tokens(artifacts, sim.workload)
    assert sum(map(len, gold.values())) > 0
    assert token_rows(res.output_events[0], sim.workload) == gold
    if name in ("sglang-tokens", "sglang-retractmany"):
        assert res.requests[0]["preemptions"].sum() > 0


@pytest.mark.parametrize("name", lane(SGLANG_CASES))
def test_sglang_kv_events_are_the_references(name):
    """The radix cache's KV events against the reference's SGLang runs (one-token
    pages with retractions, tight pools, idle gaps; pages of 4 with lpm and of 16):
    every row's event id, time, kind, position, block, parent and tokens hash. The
    reference reports a worker's facts at the end of a pass that prefills, of every
    40th pass without a prefill batch and of a pass after which nothing runs, so a
    fact is seen at the first such pass at or after the one that caused it; up to a
    report a run of Removed rows is one event, and so is an insert chained to the
    previous Stored event's last block with that event (sglang-chain16,
    sglang-chain-plain, sglang-chain-cross-pass), unless either belongs to a row with a
    session_id (sglang-sessions16, sglang-chain-sessions, sglang-chain-session-partial)."""
    sim = simulation_from_setup(artifact_case(name)[0])
    gold = reference_kv_events(artifact_case(name)[1])
    mine = kv_event_rows(run_batch([sim], record_events=True).check().kv_events[0])
    assert len(mine) == len(gold) > 0
    assert mine == gold


@pytest.mark.parametrize("name", lane(CASES))
def test_prompt_block_hashes_equal_the_references(name):
    sim, artifacts = _case(name)
    row_of = row_of_uuid(sim.workload)
    bs = sim.rank.block_size
    for request in artifacts["requests"]:
        tokens = prompt_tokens(sim.workload, row_of(request["request_id"]))
        n = len(tokens) // bs
        local, seq = np.empty(n, np.uint64), np.empty(n, np.uint64)
        hash_token_blocks(tokens, bs, local, seq)
        assert seq.tolist() == request["replay_hashes"]["sequence_hashes"]
        assert local.tolist() == request["replay_hashes"]["local_block_hashes"]


def test_kv_token_ids_are_each_blocks_tokens():
    """With ``emit_kv_token_ids`` each Stored row lists its block's tokens, whose
    XXH3 (seed 1337) is the row's tokens_hash; Removed rows list none."""
    sim, _ = _case("sess32")
    assert "token_ids" not in run_batch([sim], record_events=True).kv_events[0]
    sim = dataclasses.replace(sim, rank=dataclasses.replace(sim.rank, emit_kv_token_ids=True))
    frame = run_batch([sim], record_events=True).kv_events[0]
    stored = frame[frame["kind"] == "stored"]
    assert len(stored) > 20 and frame.loc[frame["kind"] == "removed", "token_ids"].isna().all()
    for ids, th in zip(stored["token_ids"], stored["tokens_hash"]):
        assert len(ids) == sim.rank.block_size
        assert xxhash.xxh3_64_intdigest(np.array(ids, "<u4").tobytes(), seed=1337) == int(th)


# -- the output plan ----------------------------------------------------------------
def test_plan_stream_starts_with_the_references_words():
    out = np.zeros(40, np.uint32)
    plan_words(0, 40, out, 0)
    assert out[:8].tolist() == [952584220, 694593853, 2967053780, 2932165014, 2184908278,
                                3971079078, 3124715654, 3718916919]
    for start in (1, 15, 16, 17, 31):  # any word, without the ones before it
        part = np.zeros(40 - start, np.uint32)
        plan_words(start, 40 - start, part, 0)
        assert (part == out[start:]).all()


def test_plan_order_is_session_major_and_authored_rows_draw_nothing(tmp_path):
    rows = [dict(session_id="a", timestamp=0, output_length=3),
            dict(session_id="b", timestamp=1, output_length=2, output_token_ids=[7, 8]),
            dict(session_id="a", delay=5, output_length=4),
            dict(session_id="c", timestamp=2, output_length=1),
            dict(session_id="b", delay=1, output_length=2)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({**r, "input_length": 10, "hash_ids": [i]}) + "\n"
                            for i, r in enumerate(rows)))
    wl = load_mooncake(path)
    out_plan, authored = wl.output_plan()
    # sessions a (rows 0, 2), b (1 authored, 4), c (3): a takes words 0-6, b's turn 2 7-8, c 9
    assert out_plan.tolist() == [0, -1, 3, 9, 7]
    assert authored.tolist() == [7, 8]
    words = np.zeros(10, np.uint32)
    plan_words(0, 10, words, 0)
    assert sequence_tokens(wl, 1, 10, 2).tolist() == [7, 8]
    assert sequence_tokens(wl, 2, 8, 5).tolist()[2:] == words[3:6].tolist()
    # a workload cut from the trace keeps its rows' tokens
    cut = select_rows(wl, [1, 4])
    assert cut.output_plan()[0].tolist() == [-1, 7]
    assert plan_offsets(np.array([0, 1, 0]), np.array([2, 3, 4]), np.array([False, False, False])).tolist() \
        == [0, 6, 2]
