"""Randomized equivalence of the Numba kernels with the pure-Python oracle, pool
invariants of the kernel state, and unit tests of the block pool kernels.

Cases are small Mooncake-like traces (5-40 rows, short prompts sharing hash-id
prefixes so prefix caching, duplicates and eviction all happen) on random rank
configurations (pools tight enough to preempt, tiny token budgets, chunked
prefill off, zero-duration fixed timing, closed loop, sessions). The oracle
(tests/support/oracle.py) reproduces the reference goldens exactly, so any difference
in a per-request record is a kernel bug unless the oracle is shown wrong.

A failing example is printed by hypothesis as a ``Case`` whose repr holds the
trace rows and the execution payload: write the rows to a .jsonl file and feed
both to ``oracle.run`` and ``aisim_fast`` to reproduce.

AISIM_PROPERTY_EXAMPLES scales the number of examples (default 1.0 = the CI
budget; e.g. 20 for a long soak); AISIM_PROPERTY_SHRINK=0 skips shrinking.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pandas as pd
import pytest
from hypothesis import assume, given, settings, strategies as st

from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.build import build_state
from aisim_fast.engine.simulation import Simulation, SimulationError
from aisim_fast.kernels import invariants as D
from aisim_fast.kernels.kv.block_pool import (_evict_head, cache_copy, num_active, num_free, pool_reset,
                                              release_ref, reserve, table_find)
from aisim_fast.kernels.kv.lease import release_lease
from aisim_fast.kernels.schema import layout as L
from support.random_cases import (SETTINGS, Case, cases, check_case_against_oracle, describe, drained_codes,
                                  examples, frames_of, kernel_simulation, lease_codes, make_spec, pool_codes,
                                  run_kernel, run_oracle, run_state, write_trace)


# ------------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------------
@settings(max_examples=examples(500), **SETTINGS)
@given(cases())
def test_kernel_matches_oracle(case):
    check_case_against_oracle(case)


@st.composite
def tokenized_cases(draw):
    """A random vLLM case behind a tokenization pool per worker (kernels.loop.tokenization)."""
    case = draw(cases())
    assume(case.rank.get("backend", "vllm") == "vllm")
    base_ms = draw(st.sampled_from([0.0, 0.5, 3.0, 40.0]))
    per_token_ms = draw(st.sampled_from([0.0, 0.01, 0.25]) if base_ms else st.sampled_from([0.01, 0.25]))
    spec = dict(case.spec, tokenization={"workers": draw(st.integers(1, 3)), "base_ms": base_ms,
                                         "per_input_token_ms": per_token_ms})
    return Case(case.rows, spec)


@settings(max_examples=examples(120), **SETTINGS)
@given(tokenized_cases())
def test_kernel_matches_oracle_behind_a_tokenization_pool(case):
    """Placement at arrival, the pool's earliest free server, release to the scheduler
    when tokenized: the timelines, the passes and every ``tokenized_ms``."""
    check_case_against_oracle(case, extra_columns=("tokenized_ms",))


@settings(max_examples=examples(100), **SETTINGS)
@given(cases(max_rows=25))
def test_pool_invariants_between_passes(case):
    """Pool and lease invariants hold between every two passes, the pool is drained
    at the end, and stopping before every pass does not change the run."""
    failures = []

    def check(state):
        for what, codes in (("pool", pool_codes(state)), ("lease", lease_codes(state))):
            if codes:
                failures.append((what, codes))

    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(case.rows, tmp)
        sim = kernel_simulation(case, path)
        out = run_state([sim], per_pass_check=check)
        assert not failures, "invariant violations: %s" % failures[:3]
        try:
            ref = run_batch([sim]).check()
        except SimulationError:
            assert out == "dead_end"
            return
    assert out != "dead_end", "stepwise run dead-ended, run_batch completed"
    sims, state = out
    assert not pool_codes(state)
    assert not drained_codes(state), drained_codes(state)
    pd.testing.assert_frame_equal(frames_of(sims, state)[0], ref.requests[0], check_exact=True)


@settings(max_examples=examples(30), **SETTINGS)
@given(st.lists(cases(max_rows=20), min_size=2, max_size=4))
def test_batch_final_state(batch):
    """A batch of random simulations: every worker's pool is consistent and drained at
    the end, and each simulation's records equal its solo run."""
    with tempfile.TemporaryDirectory() as tmp:
        sims = []
        for i, case in enumerate(batch):
            sub = os.path.join(tmp, str(i))
            os.mkdir(sub)
            sims.append(kernel_simulation(case, write_trace(case.rows, sub)))
        solos = []
        for sim in sims:
            try:
                solos.append(run_batch([sim]).requests[0])
            except SimulationError:
                solos.append(None)
    live = [sim for sim, solo in zip(sims, solos) if solo is not None]
    expected = [solo for solo in solos if solo is not None]
    if not live:
        return
    out = run_state(live)
    assert out != "dead_end"
    live, state = out
    assert not pool_codes(state), pool_codes(state)
    assert not drained_codes(state), drained_codes(state)
    assert not lease_codes(state), lease_codes(state)
    for got, want in zip(frames_of(live, state), expected):
        pd.testing.assert_frame_equal(got, want, check_exact=True)


# Minimal cases found by the properties above, kept as fast deterministic regressions.
REGRESSIONS = {
    # A zero-duration pass (fixed prefill 0 ms, first tokens are free) ends A's turn 0.
    # The reference completes it inside the drive step and keeps driving: worker 0 starts
    # B's 5 ms decode pass before admission runs, so A's turn 1 (delay 0) arrives at 0
    # but is admitted at 5 and emits at 10. Admitting it into the 0 ms pass is wrong.
    "zero_duration_pass_then_next_turn": Case(
        [{"session_id": "A", "timestamp": 0, "input_length": 4, "output_length": 1,
          "hash_ids": [1]},
         {"session_id": "B", "timestamp": 0, "input_length": 4, "output_length": 3,
          "hash_ids": [3]},
         {"session_id": "A", "delay": 0, "input_length": 4, "output_length": 1,
          "hash_ids": [2]}],
        make_spec({"backend": "vllm", "block_size": 4, "num_gpu_blocks": 64,
                   "timing_model": {"type": "fixed", "prefill_ms": 0.0, "decode_ms": 5.0}},
                  workers=1, trace_block_size=4)),
    # Two workers with chains of zero-duration passes at t = 0: the reference drives the
    # lowest idle worker again after each zero-duration pass (0, 0, 0, 1, 1), it does not
    # alternate (0, 1, 0, 1, 0). Visible in the pass log order. Closed loop (all five
    # sessions at once), so the driver cannot split the workers into separate runs.
    "zero_duration_pass_order": Case(
        [{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [h]}
         for h in (1, 2, 2, 2, 2)],
        make_spec({"backend": "vllm", "block_size": 2, "num_gpu_blocks": 1, "max_num_seqs": 2,
                   "max_num_batched_tokens": 16, "enable_prefix_caching": False,
                   "timing_model": {"type": "fixed", "prefill_ms": 0.0, "decode_ms": 0.5}},
                  workers=2, concurrency=5, trace_block_size=4)),
    # Requests 1 (emits its only token) and 2 (no output) both end in the pass at 0-1 ms.
    # The reference releases the no-token terminal first, so the LRU holds 2's blocks
    # before 1's; request 3 evicts two blocks (2's), and request 4 reuses 1's prefix:
    # cached_tokens 8. Releasing in running-list order evicts 1's blocks instead (0).
    "no_token_terminals_release_first": Case(
        [{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
         {"timestamp": 0, "input_length": 8, "output_length": 0, "hash_ids": [3, 4]},
         {"timestamp": 10, "input_length": 8, "output_length": 0, "hash_ids": [5, 6]},
         {"timestamp": 20, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 7]}],
        make_spec({"backend": "vllm", "block_size": 4, "num_gpu_blocks": 4,
                   "timing_model": {"type": "fixed", "prefill_ms": 1.0, "decode_ms": 1.0}},
                  workers=1, trace_block_size=4)),
    # Request 2 is preempted at 9 ms with 5 tokens generated and recomputes 9 tokens
    # with a 4-token budget. The chunk [4, 8) lies past the prompt (an FPM "decode"
    # entry) but emits no token (a zero-duration pass at 15 ms): its
    # sum_decode_kv_tokens is the scheduled sequence length, 9. Only the pass log
    # is affected (the kernel logs prompt + generated - 1 = 8).
    "recompute_chunk_decode_kv": Case(
        [{"timestamp": 0, "input_length": 4, "output_length": 12, "hash_ids": [1]},
         {"timestamp": 0, "input_length": 4, "output_length": 12, "hash_ids": [2]}],
        make_spec({"backend": "vllm", "block_size": 4, "num_gpu_blocks": 5,
                   "max_num_batched_tokens": 4, "enable_prefix_caching": False,
                   "timing_model": {"type": "fixed", "prefill_ms": 1.0, "decode_ms": 1.0}},
                  workers=1, trace_block_size=4)),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression_cases(name):
    check_case_against_oracle(REGRESSIONS[name])


def test_zero_duration_pass_expected_values():
    """The reference timeline of the first regression, spelled out."""
    case = REGRESSIONS["zero_duration_pass_then_next_turn"]
    with tempfile.TemporaryDirectory() as tmp:
        status, frame, _ = run_kernel(case, write_trace(case.rows, tmp))
    assert status == "ok"
    row = frame.set_index(["request_id", "turn_index"]).loc[("A", 1)]
    assert (row["arrival_ms"], row["first_admit_ms"], row["first_token_ms"]) == (0.0, 5.0, 10.0)


@settings(max_examples=examples(30), **SETTINGS)
@given(cases(max_rows=20))
def test_arena_overflow_rerun_is_transparent(case):
    """A one-slot arena overflows at the first multi-block allocation; the driver must
    rerun with the full pool and produce exactly the normal result."""
    with tempfile.TemporaryDirectory() as tmp:
        sim = kernel_simulation(case, write_trace(case.rows, tmp))
        tiny = Simulation(sim.workload, sim.rank, sim.workers, sim.concurrency, arena_blocks=1)
        try:
            want = run_batch([sim]).check()
        except SimulationError:
            with pytest.raises(SimulationError):
                run_batch([tiny]).check()
            return
        got = run_batch([tiny])
    pd.testing.assert_frame_equal(got.requests[0], want.requests[0], check_exact=True)
    pd.testing.assert_frame_equal(got.passes[0], want.passes[0], check_exact=True)


def test_pass_log_flush_between_zero_duration_passes():
    """A full pass log pauses the kernel before a pass starts; resuming must continue
    the paused drive, not restart the instant (completing the zero-duration passes
    and admitting arrivals before the next worker's pass). Closed loop, two workers,
    zero-duration passes: stopping before every pass must not change the schedule."""
    rows = [{"input_length": 1, "output_length": o, "hash_ids": [1000], "timestamp": 0.0}
            for o in (0, 0, 0, 0, 0, 3, 0, 0, 0, 2)]
    case = Case(rows, make_spec(
        {"backend": "vllm", "block_size": 2, "num_gpu_blocks": 2, "max_num_seqs": 2,
         "max_num_batched_tokens": 16, "enable_prefix_caching": False,
         "timing_model": {"type": "fixed", "prefill_ms": 0.0, "decode_ms": 0.0}},
        workers=2, concurrency=2, trace_block_size=4))
    with tempfile.TemporaryDirectory() as tmp:
        sim = kernel_simulation(case, write_trace(case.rows, tmp))
        want = run_batch([sim])
        got = run_batch([sim], pass_log_rows=1)
    pd.testing.assert_frame_equal(got.requests[0], want.requests[0], check_exact=True)
    pd.testing.assert_frame_equal(got.passes[0], want.passes[0], check_exact=True)


def test_dead_end_agreement_example():
    """A request whose prompt fits but whose output outgrows the pool: vLLM admits it,
    preempts it and can never re-admit it; both sides stop with a dead end."""
    case = Case([{"timestamp": 0, "input_length": 300, "output_length": 200, "hash_ids": [1]}],
                make_spec({"backend": "vllm", "num_gpu_blocks": 6}))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(case.rows, tmp)
        assert run_oracle(case, path)[0] == "dead_end"
        assert run_kernel(case, path)[0] == "dead_end"


# ------------------------------------------------------------------------------------------------
# block pool kernels on a hand-built pool
# ------------------------------------------------------------------------------------------------
def make_pool(arena, tab_size=16, workers=1):
    """Pools laid out as replay.build_state does, ``arena`` slots per worker."""
    w64 = np.zeros((workers, L.PW_FIELDS), np.int64)
    w64[:, L.PW_BLK_OFF] = np.arange(workers) * arena
    w64[:, L.PW_BLK_LEN] = arena
    w64[:, L.PW_TAB_OFF] = np.arange(workers) * tab_size
    w64[:, L.PW_TAB_MASK] = tab_size - 1
    pool = L.Pool(w64=w64, b32=np.zeros((arena * workers, L.PB_FIELDS), np.int32),
                  blk_hash=np.zeros(arena * workers, np.uint64),
                  tab=np.empty(tab_size * workers, np.int32), evicted_hash=np.zeros(0, np.uint64))
    for w in range(workers):
        pool_reset(pool, w)
    return pool


def take(pool, capacity, n, hits=(), w=0):
    """reserve() n fresh copies (plus hits); returns (status, fresh copies)."""
    h = np.array(list(hits) + [0], np.int32)
    out = np.full(max(n, 1), -1, np.int32)
    res = reserve(pool, w, capacity, h, len(hits), n, out)
    return res, [int(b) for b in out[:n]]


def lru(pool, w=0):
    out = []
    b = pool.w64[w, L.PW_LRU_HEAD]
    while b != L.NO_BLOCK:
        out.append(int(b))
        b = pool.b32[b, L.PB_NEXT]
    return out


def ok(pool, capacity, w=0):
    code = D.check_pool(pool, w, capacity)
    assert code == 0, describe(code)


def u64(x):
    return np.uint64(x)


def lease_state(blocks, bs, capacity, worker=0):
    """cfg and rq for one request (q = 0) holding ``blocks`` as its lease."""
    cfg_i = np.zeros((worker + 1, L.CFG_I_FIELDS), np.int64)
    cfg_i[:, L.CFG_BLOCK_SIZE] = bs
    cfg_i[:, L.CFG_NUM_GPU_BLOCKS] = capacity
    cfg = L.RankConfig(i64=cfg_i, f64=np.zeros((worker + 1, L.CFG_F_FIELDS)))
    rq_i = np.zeros((1, L.RQ_I_FIELDS), np.int64)
    rq_i[0, L.RQ_PROMPT_LEN] = len(blocks) * bs
    rq_i[0, L.RQ_ALLOCATED] = len(blocks) * bs
    rq_i[0, L.RQ_NUM_COMPUTED] = len(blocks) * bs
    rq_i[0, L.RQ_NUM_HASHED] = len(blocks)
    rq_i[0, L.RQ_WORKER] = worker
    lease = np.array(blocks, np.int32)
    rq = L.Requests(i64=rq_i, f64=np.zeros((1, L.RQ_F_FIELDS)), lease=lease,
                    seq_hash=np.zeros(len(blocks), np.uint64))
    return cfg, rq


def test_pool_reserve_and_release_leaf_first():
    """A released lease enters the LRU tail first, so eviction takes a request's leaf
    before its parents and a shorter shared prefix survives."""
    cap = 6
    pool = make_pool(cap)
    res, blocks = take(pool, cap, 3)
    assert res == 1 and len(set(blocks)) == 3
    for i, b in enumerate(blocks):
        assert cache_copy(pool, 0, np.int32(b), u64(100 + i))
    cfg, rq = lease_state(blocks, 4, cap)
    rq.seq_hash[:] = [100, 101, 102]
    assert D.check_leases(pool, rq, 0, 0, 1, 4) == 0
    ok(pool, cap)
    release_lease(cfg, pool, rq, 0, 0)
    assert rq.i64[0, L.RQ_ALLOCATED] == 0 and np.all(rq.lease == L.NO_BLOCK)
    assert lru(pool) == blocks[::-1]
    ok(pool, cap)
    assert D.check_drained(pool, 0) == 0
    # 3 free + 4 needed: exactly one eviction, the leaf (hash 102)
    res, _ = take(pool, cap, 4)
    assert res == 1
    assert table_find(pool, 0, u64(102)) == L.NO_BLOCK
    assert table_find(pool, 0, u64(101)) == blocks[1]
    assert table_find(pool, 0, u64(100)) == blocks[0]
    assert lru(pool) == [blocks[1], blocks[0]]
    ok(pool, cap)
    assert D.check_drained(pool, 0) == D.DRAIN_PRIVATE


def test_pool_reserve_is_atomic_and_counts_inactive_hits():
    """A hit that sits in the LRU is pinned by the reservation, so it cannot also be
    evicted for it; an infeasible reservation changes nothing."""
    cap = 3
    pool = make_pool(cap)
    res, blocks = take(pool, cap, 3)
    for i, b in enumerate(blocks):
        cache_copy(pool, 0, np.int32(b), u64(7 + i))
    for b in blocks:
        release_ref(pool, 0, np.int32(b))
    assert len(lru(pool)) == 3 and num_free(pool, 0, cap) == 0
    before = (pool.w64.copy(), pool.b32.copy(), pool.tab.copy())
    # hit on block 0 + 3 fresh: 3 evictions needed, only 2 evictable
    res, _ = take(pool, cap, 3, hits=[blocks[0]])
    assert res == 0
    assert all(np.array_equal(x, y) for x, y in zip(before, (pool.w64, pool.b32, pool.tab)))
    res, fresh = take(pool, cap, 2, hits=[blocks[0]])
    assert res == 1
    assert pool.b32[blocks[0], L.PB_REF] == 1
    assert table_find(pool, 0, u64(7)) == blocks[0]
    assert num_active(pool, 0) == 3 and lru(pool) == []
    ok(pool, cap)


def test_pool_duplicate_copies_and_last_copy_eviction():
    """Two requests computing the same block make two copies of one hash: the first is
    the primary, the second a duplicate; evicting a copy reports the hash as removed
    only with its last copy, and the oldest duplicate is promoted."""
    cap = 4
    pool = make_pool(cap)
    _, (a,) = take(pool, cap, 1)
    _, (b,) = take(pool, cap, 1)
    _, (c,) = take(pool, cap, 1)
    assert cache_copy(pool, 0, np.int32(a), u64(42))
    assert not cache_copy(pool, 0, np.int32(b), u64(42))
    assert not cache_copy(pool, 0, np.int32(c), u64(42))
    assert table_find(pool, 0, u64(42)) == a
    assert pool.b32[a, L.PB_DUP] == b and pool.b32[b, L.PB_DUP] == c
    assert pool.b32[a, L.PB_DUP_TAIL] == c
    ok(pool, cap)
    # release the middle duplicate first, then the primary, then the newest
    for blk in (b, a, c):
        release_ref(pool, 0, np.int32(blk))
    ok(pool, cap)
    assert lru(pool) == [b, a, c]
    assert not _evict_head(pool, 0, np.int64(L.KV_FIRST))           # b: a duplicate, hash still resident
    assert table_find(pool, 0, u64(42)) == a and pool.b32[a, L.PB_DUP] == c
    ok(pool, cap)
    assert not _evict_head(pool, 0, np.int64(L.KV_FIRST))           # a: the primary, c is promoted
    assert table_find(pool, 0, u64(42)) == c
    ok(pool, cap)
    assert _evict_head(pool, 0, np.int64(L.KV_FIRST))               # c: the last copy
    assert table_find(pool, 0, u64(42)) == L.NO_BLOCK
    ok(pool, cap)
    assert pool.w64[0, L.PW_NUM_COPIES] == 0 and num_free(pool, 0, cap) == cap


def test_pool_table_deletion_keeps_probe_clusters():
    """Hashes below 2**29 land on slot ``h & mask``: several on one home slot form a
    probe cluster; deleting from its middle must keep the rest findable."""
    cap = 8
    pool = make_pool(cap, tab_size=16)
    hashes = [3, 19, 35, 4, 51, 20]   # homes 3, 3, 3, 4, 3, 4
    res, blocks = take(pool, cap, len(hashes))
    for b, h in zip(blocks, hashes):
        cache_copy(pool, 0, np.int32(b), u64(h))
    ok(pool, cap)
    for b in blocks:
        release_ref(pool, 0, np.int32(b))
    for i in range(len(hashes)):
        evicted = lru(pool)[0]
        assert _evict_head(pool, 0, np.int64(L.KV_FIRST))
        ok(pool, cap)
        for b, h in zip(blocks[i + 1:], hashes[i + 1:]):
            assert table_find(pool, 0, u64(h)) == b
        assert table_find(pool, 0, pool.blk_hash[evicted]) in (L.NO_BLOCK,)
    assert np.all(pool.tab == L.NO_BLOCK)


def test_pool_arena_exhaustion_is_reported():
    """Capacity larger than the arena: reserve reports -1 when slots run out."""
    pool = make_pool(2)
    res, _ = take(pool, 10, 3)
    assert res == -1


def test_pool_checks_detect_corruption():
    """Each check names the invariant a deliberate corruption breaks."""
    cap = 4

    def cached_pool():
        pool = make_pool(cap)
        _, blocks = take(pool, cap, 3)
        for i, b in enumerate(blocks):
            cache_copy(pool, 0, np.int32(b), u64(11 + i))
        release_ref(pool, 0, np.int32(blocks[2]))
        ok(pool, cap)
        return pool, blocks

    pool, blocks = cached_pool()
    assert D.check_pool(pool, 0, 2) == D.POOL_CONSERVATION
    pool.w64[0, L.PW_FREE_TOP] += 1
    assert D.check_pool(pool, 0, cap) == D.POOL_ARENA
    pool, blocks = cached_pool()
    pool.b32[blocks[0], L.PB_REF] = -1
    assert D.check_pool(pool, 0, cap) == D.POOL_NEGATIVE_COUNT
    pool, blocks = cached_pool()
    pool.b32[blocks[0], L.PB_REF] = 0         # unreferenced but not in the LRU
    assert D.check_pool(pool, 0, cap) == D.POOL_LRU_MEMBERSHIP
    pool, blocks = cached_pool()
    pool.w64[0, L.PW_LRU_LEN] = 2
    assert D.check_pool(pool, 0, cap) == D.POOL_LRU_LINKS
    pool, blocks = cached_pool()
    pool.blk_hash[blocks[1]] = u64(11)        # same key twice in the table
    assert D.check_pool(pool, 0, cap) in (D.POOL_TABLE_DUPLICATE, D.POOL_TABLE_PROBE)
    pool, blocks = cached_pool()
    pool.b32[blocks[0], L.PB_CACHED] = 0      # a private copy left in the table
    assert D.check_pool(pool, 0, cap) == D.POOL_TABLE_ENTRY
    pool, blocks = cached_pool()
    t = int(np.flatnonzero(pool.tab == blocks[1])[0])
    pool.tab[t] = L.NO_BLOCK                  # a cached copy nobody can find
    assert D.check_pool(pool, 0, cap) == D.POOL_UNREACHABLE
    pool, blocks = cached_pool()
    pool.b32[blocks[0], L.PB_DUP_TAIL] = blocks[1]
    assert D.check_pool(pool, 0, cap) == D.POOL_DUP_CHAIN
    pool, blocks = cached_pool()
    assert D.check_drained(pool, 0) == D.DRAIN_REFERENCED
    # a lease that claims a block its refs do not account for
    pool, blocks = cached_pool()
    cfg, rq = lease_state(blocks[:1], 4, cap)
    rq.seq_hash[0] = 11
    assert D.check_leases(pool, rq, 0, 0, 1, 4) == D.LEASE_REFS  # blocks[1] unheld
    rq.seq_hash[0] = 12
    assert D.check_request(pool, rq, 0, 4) == D.LEASE_HASH


def test_vectorized_pool_reset_matches_the_kernel():
    """build_state empties every pool at once with numpy; the kernels' per-worker
    pool_reset must give the same pool counters and table (arena slots are only
    initialized when first taken)."""
    from aisim_fast.engine.lowering import reset_pools

    rows = [{"timestamp": i, "input_length": 40 + 7 * i, "output_length": 5, "hash_ids": [i, i + 1]}
            for i in range(12)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(rows, tmp)
        sims = [kernel_simulation(Case(rows, make_spec({"backend": "vllm", "block_size": bs},
                                                         workers=w)), path)
                for bs, w in ((16, 3), (64, 1), (32, 2))]
        _, pool, *_ = build_state(sims)
    got = (pool.w64.copy(), pool.tab.copy())
    pool.tab[:] = 5
    pool.w64[:, [L.PW_LRU_LEN, L.PW_BUMP, L.PW_FREE_TOP]] = 3
    for w in range(len(pool.w64)):
        pool_reset(pool, w)
    np.testing.assert_array_equal(got[0], pool.w64)
    np.testing.assert_array_equal(got[1], pool.tab)
    reset_pools(pool)
    np.testing.assert_array_equal(got[0], pool.w64)
    np.testing.assert_array_equal(got[1], pool.tab)
