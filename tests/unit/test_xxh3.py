"""Tests for kernels/hashing/xxh3.py: the Numba XXH3-64 kernels must agree bit for
bit with the `xxhash` package (`xxhash.xxh3_64_intdigest`), the reference
implementation used as oracle throughout.

Coverage: every input length from 0 to 600 bytes (all short and mid-size
length classes and the first long-path stripe counts), long inputs up to
5000 bytes (several 1024-byte blocks, lengths on and off stripe and block
boundaries), seeds 0, 1337 and arbitrary 64-bit values, every public
function, and the acceptance values the simulator depends on.
"""

import json
import os
import struct
import subprocess
import sys
import uuid

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st
from numba.core.errors import TypingError

from aisim_fast.kernels.hashing import xxh3
from support.paths import REPO_DIR

U64_MAX = 2**64 - 1
# 0 and 1337 select precomputed secrets for long inputs; the others take the
# derived-secret path (1 and U64_MAX probe the wrap-around of seed +/-).
SEEDS = [0, 1337, 1, 0x9E3779B97F4A7C15, U64_MAX]


def oracle(data, seed):
    return xxhash.xxh3_64_intdigest(bytes(data), seed=seed)


def u32_bytes(tokens):
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(20240611)


# ---------------------------------------------------------------------------
# xxh3_64_bytes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_bytes_every_length_up_to_600(rng, seed):
    pool = rng.integers(0, 256, 700, dtype=np.uint8)
    for length in range(601):
        # A moving start exercises unaligned reads as well.
        start = length % 13
        got = xxh3.xxh3_64_bytes(pool, start, length, np.uint64(seed))
        assert int(got) == oracle(pool[start:start + length], seed), (length, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_bytes_long_inputs_across_blocks(rng, seed):
    # Around stripe (64) and block (1024) boundaries, plus random lengths.
    lengths = [1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 3072, 3073,
               4095, 4096, 4097, 4999, 5000]
    lengths += [int(n) for n in rng.integers(601, 5001, 20)]
    pool = rng.integers(0, 256, 5010, dtype=np.uint8)
    for length in lengths:
        start = length % 7
        got = xxh3.xxh3_64_bytes(pool, start, length, np.uint64(seed))
        assert int(got) == oracle(pool[start:start + length], seed), (length, seed)


def test_bytes_accepts_python_int_arguments(rng):
    # Python ints type as int64 in Numba, so seeds of 2**63 and above must be
    # passed as np.uint64 (as everywhere else in these tests).
    pool = rng.integers(0, 256, 300, dtype=np.uint8)
    for length in (0, 3, 8, 16, 100, 200, 300):
        for seed in (0, 1337, 2**63 - 1):
            assert xxh3.xxh3_64_bytes(pool, 0, length, seed) == oracle(pool[:length], seed)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=1200), seed=st.integers(0, U64_MAX), pad=st.integers(0, 9))
def test_bytes_property(data, seed, pad):
    buf = np.frombuffer(bytes(pad) + data + bytes(3), dtype=np.uint8)
    assert int(xxh3.xxh3_64_bytes(buf, pad, len(data), np.uint64(seed))) == oracle(data, seed)


def test_bytes_rejects_out_of_range():
    buf = np.zeros(10, dtype=np.uint8)
    for start, length in ((0, 11), (5, 6), (-1, 2), (3, -1)):
        with pytest.raises(IndexError):
            xxh3.xxh3_64_bytes(buf, start, length, np.uint64(0))
    # The full buffer and an empty range at the end are valid.
    assert xxh3.xxh3_64_bytes(buf, 0, 10, np.uint64(0)) == oracle(bytes(10), 0)
    assert xxh3.xxh3_64_bytes(buf, 10, 0, np.uint64(0)) == oracle(b"", 0)


def test_rejects_wrong_dtype_or_layout():
    with pytest.raises(TypingError):
        xxh3.xxh3_64_bytes(np.zeros(8, dtype=np.int64), 0, 8, np.uint64(0))
    with pytest.raises(TypingError):
        xxh3.xxh3_64_bytes(np.zeros(16, dtype=np.uint8)[::2], 0, 8, np.uint64(0))
    with pytest.raises(TypingError):
        xxh3.xxh3_64_u32(np.zeros(8, dtype=np.uint8), 0, 2, np.uint64(0))


# ---------------------------------------------------------------------------
# xxh3_64_u32
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_u32_matches_little_endian_bytes(rng, seed):
    tokens = rng.integers(0, 2**32, 1400, dtype=np.uint32)
    # Every count up to 160 (0..640 bytes) plus long and multi-block counts.
    counts = list(range(161)) + [255, 256, 257, 512, 1000, 1024, 1250]
    for count in counts:
        start = count % 5
        got = xxh3.xxh3_64_u32(tokens, start, count, np.uint64(seed))
        assert int(got) == oracle(u32_bytes(tokens[start:start + count]), seed), (count, seed)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
       seed=st.sampled_from([0, 1337]) | st.integers(0, U64_MAX))
def test_u32_property(tokens, seed):
    words = np.array(tokens, dtype=np.uint32)
    got = xxh3.xxh3_64_u32(words, 0, len(words), np.uint64(seed))
    assert int(got) == oracle(u32_bytes(words), seed)


def test_u32_rejects_out_of_range():
    tokens = np.zeros(4, dtype=np.uint32)
    with pytest.raises(IndexError):
        xxh3.xxh3_64_u32(tokens, 1, 4, np.uint64(1337))


# ---------------------------------------------------------------------------
# Secrets and the explicit-secret long path
# ---------------------------------------------------------------------------


def test_make_secret_matches_module_constants():
    assert np.array_equal(xxh3.make_secret(np.uint64(0)), xxh3.DEFAULT_SECRET)
    assert np.array_equal(xxh3.make_secret(xxh3.XXH3_SEED), xxh3.SECRET_1337)
    assert xxh3.DEFAULT_SECRET.shape == (192,) and xxh3.DEFAULT_SECRET.dtype == np.uint8


@pytest.mark.parametrize("seed", SEEDS)
def test_hash_long_with_secret_equals_seeded_hash(rng, seed):
    secret = xxh3.make_secret(np.uint64(seed))
    pool = rng.integers(0, 256, 3000, dtype=np.uint8)
    for length in (241, 256, 300, 1024, 1025, 2999):
        got = xxh3.hash_long_with_secret(pool, 1, length, secret)
        assert int(got) == oracle(pool[1:1 + length], seed), (length, seed)


def test_hash_long_with_secret_rejects_short_input():
    with pytest.raises(ValueError):
        xxh3.hash_long_with_secret(np.zeros(300, np.uint8), 0, 240, xxh3.make_secret(0))


# ---------------------------------------------------------------------------
# hash_chain and hash_token_blocks
# ---------------------------------------------------------------------------


def chain_oracle(parent, local):
    return oracle(struct.pack("<QQ", parent, local), 1337)


def test_hash_chain(rng):
    pairs = [(0, 0), (U64_MAX, U64_MAX), (1, 2**63)]
    pairs += [(int(a), int(b)) for a, b in rng.integers(0, 2**64, (200, 2), dtype=np.uint64)]
    for parent, local in pairs:
        got = xxh3.hash_chain(np.uint64(parent), np.uint64(local))
        assert int(got) == chain_oracle(parent, local), (parent, local)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64])
def test_hash_token_blocks(rng, block_size):
    for n_tokens in (0, block_size - 1, block_size, 5 * block_size + 3, 12 * block_size):
        tokens = rng.integers(0, 2**32, n_tokens, dtype=np.uint32)
        n_expected = n_tokens // block_size
        out_local = np.zeros(n_expected + 1, dtype=np.uint64)
        out_seq = np.zeros(n_expected + 1, dtype=np.uint64)
        n_blocks = xxh3.hash_token_blocks(tokens, block_size, out_local, out_seq)
        assert n_blocks == n_expected
        parent = None
        for i in range(n_blocks):
            local = oracle(u32_bytes(tokens[i * block_size:(i + 1) * block_size]), 1337)
            parent = local if i == 0 else chain_oracle(parent, local)
            assert int(out_local[i]) == local
            assert int(out_seq[i]) == parent
        # Entries past the complete blocks are left untouched.
        assert out_local[n_blocks] == 0 and out_seq[n_blocks] == 0


def test_hash_token_blocks_acceptance():
    tokens = np.arange(8, dtype=np.uint32)
    out_local = np.zeros(2, dtype=np.uint64)
    out_seq = np.zeros(2, dtype=np.uint64)
    assert xxh3.hash_token_blocks(tokens, 4, out_local, out_seq) == 2
    assert out_seq[0] == out_local[0]
    assert out_seq[1] == xxh3.hash_chain(out_seq[0], out_local[1])
    assert out_seq[1] != out_local[1]


def test_hash_token_blocks_rejects_short_outputs():
    tokens = np.arange(8, dtype=np.uint32)
    with pytest.raises(ValueError):
        xxh3.hash_token_blocks(tokens, 4, np.zeros(1, np.uint64), np.zeros(2, np.uint64))


# ---------------------------------------------------------------------------
# synthetic_output_token
# ---------------------------------------------------------------------------


def synthetic_oracle(request_uuid, ordinal):
    digest = oracle(request_uuid.bytes + struct.pack("<Q", ordinal), 0)
    return digest & 0xFFFFFFFF


def split_uuid(request_uuid):
    return np.uint64(request_uuid.int >> 64), np.uint64(request_uuid.int & U64_MAX)


def test_synthetic_output_token_acceptance():
    hi, lo = split_uuid(uuid.UUID(int=1))
    assert [int(xxh3.synthetic_output_token(hi, lo, np.uint64(k))) for k in range(4)] == [
        2515880452, 3600266899, 2716793611, 2249174135]
    hi, lo = split_uuid(uuid.UUID(int=2))
    assert int(xxh3.synthetic_output_token(hi, lo, np.uint64(0))) == 1927195132


def test_synthetic_output_token_matches_oracle(rng):
    for _ in range(50):
        request_uuid = uuid.UUID(bytes=rng.bytes(16))
        hi, lo = split_uuid(request_uuid)
        for ordinal in (0, 1, 17, int(rng.integers(0, 2**63)), U64_MAX):
            got = xxh3.synthetic_output_token(hi, lo, np.uint64(ordinal))
            assert int(got) == synthetic_oracle(request_uuid, ordinal)


# ---------------------------------------------------------------------------
# No heap allocation in the hot paths
# ---------------------------------------------------------------------------

# Runs in a fresh interpreter because Numba counts allocations only when
# NUMBA_NRT_STATS is set before it starts.  Hashing is driven from jitted
# loops: boxing arrays at a Python call allocates by itself.
ALLOCATION_PROBE = r"""
import json, sys
import numpy as np
from numba import njit
from numba.core.runtime import rtsys
from aisim_fast.kernels.hashing import xxh3

@njit
def hash_many(tokens, data, n_rounds):
    acc = np.uint64(0)
    for i in range(n_rounds):
        start = i % 8
        for count in (0, 1, 2, 3, 4, 16, 32, 40, 60, 64, 300):
            acc ^= xxh3.xxh3_64_u32(tokens, start, count, xxh3.XXH3_SEED)
            acc ^= xxh3.xxh3_64_u32(tokens, start, count, np.uint64(0))
            acc ^= xxh3.xxh3_64_bytes(data, start, 4 * count + 1, xxh3.XXH3_SEED)
        acc ^= xxh3.hash_chain(acc, np.uint64(i))
        acc ^= np.uint64(xxh3.synthetic_output_token(acc, np.uint64(i), np.uint64(i)))
    return acc

@njit
def hash_blocks_many(tokens, out_local, out_seq, n_rounds):
    total = 0
    for _ in range(n_rounds):
        total += xxh3.hash_token_blocks(tokens, 16, out_local, out_seq)
    return total

tokens = np.arange(2000, dtype=np.uint32)
data = tokens.view(np.uint8)
out_local = np.zeros(200, np.uint64)
out_seq = np.zeros(200, np.uint64)

def allocations(run):
    before = rtsys.get_allocation_stats().alloc
    run()
    return rtsys.get_allocation_stats().alloc - before

hash_many(tokens, data, 1)
hash_blocks_many(tokens, out_local, out_seq, 1)
print(json.dumps({
    "hash_few": allocations(lambda: hash_many(tokens, data, 1)),
    "hash_lots": allocations(lambda: hash_many(tokens, data, 500)),
    "blocks_few": allocations(lambda: hash_blocks_many(tokens, out_local, out_seq, 1)),
    "blocks_lots": allocations(lambda: hash_blocks_many(tokens, out_local, out_seq, 500)),
}))
"""


def test_hot_paths_do_not_allocate():
    repo_root = str(REPO_DIR)
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    result = subprocess.run([sys.executable, "-c", ALLOCATION_PROBE, repo_root],
                            env=env, capture_output=True, text=True, check=True)
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    # Allocations may happen once per jitted call (argument boxing) but must
    # not grow with the number of hashes computed.
    assert counts["hash_lots"] == counts["hash_few"], counts
    assert counts["blocks_lots"] == counts["blocks_few"], counts
