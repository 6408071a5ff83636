"""The replay's output plan: the token ids every request emits.

The reference draws every planned output token of a workload from one random
stream: rand's ``StdRng`` (ChaCha with 12 rounds, 64-bit block counter, stream 0)
seeded by ``seed_from_u64(SYNTHETIC_OUTPUT_SEED)``, one full 32-bit word per token,
rows taking consecutive slices in session-major order (sessions by first
appearance, turns in file order); rows with authored ``output_token_ids`` take
none. ChaCha is a counter-mode generator, so word n of the stream is word n % 16 of
block n // 16: a row needs only the offset of its slice (``plan_offsets``), and a
kernel computes any token on demand without the plan ever being materialised
(a million-request trace would need gigabytes for it).
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.jit import kernel

SYNTHETIC_OUTPUT_SEED = 0xD37A0A7E5EED
_M64 = (1 << 64) - 1


def seed_key(seed: int) -> np.ndarray:
    """The 8 ChaCha key words of ``seed_from_u64(seed)`` (rand_core: a PCG32 stream,
    one output word per 4 key bytes, little-endian)."""
    state = seed & _M64
    key = np.empty(8, np.uint32)
    for i in range(8):
        state = (state * 6364136223846793005 + 11634580027462260723) & _M64
        x = ((state ^ (state >> 18)) >> 27) & 0xFFFFFFFF
        r = state >> 59
        key[i] = ((x >> r) | (x << ((32 - r) & 31))) & 0xFFFFFFFF
    return key


PLAN_KEY = seed_key(SYNTHETIC_OUTPUT_SEED)   # a module constant to the kernels
_SIGMA = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], np.uint32)


@kernel(cache=True, _nrt=False, inline="always")
def _rotl(x, n):
    # Numba widens uint32 arithmetic to 64 bits: every result is cut back to 32
    return np.uint32(((x << np.uint32(n)) | (x >> np.uint32(32 - n))) & np.uint32(0xFFFFFFFF))


@kernel(cache=True, _nrt=False, inline="always")
def _quarter(a, b, c, d):
    a = np.uint32(a + b)
    d = _rotl(np.uint32(d ^ a), 16)
    c = np.uint32(c + d)
    b = _rotl(np.uint32(b ^ c), 12)
    a = np.uint32(a + b)
    d = _rotl(np.uint32(d ^ a), 8)
    c = np.uint32(c + d)
    b = _rotl(np.uint32(b ^ c), 7)
    return a, b, c, d


@kernel(cache=True, _nrt=False)
def chacha12_block(key, counter):
    """Block ``counter`` of the ChaCha12 stream of ``key`` (stream id 0): its 16
    words as a tuple (scalars, so the kernels allocate nothing)."""
    i0, i1, i2, i3 = _SIGMA[0], _SIGMA[1], _SIGMA[2], _SIGMA[3]
    i4, i5, i6, i7 = key[0], key[1], key[2], key[3]
    i8, i9, i10, i11 = key[4], key[5], key[6], key[7]
    c = np.uint64(counter)
    i12 = np.uint32(c & np.uint64(0xFFFFFFFF))
    i13 = np.uint32(c >> np.uint64(32))
    i14 = np.uint32(0)
    i15 = np.uint32(0)
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, i12, i13, i14, i15
    for _ in range(6):  # 12 rounds = 6 double rounds: columns, then diagonals
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    u = np.uint32
    return (u(x0 + i0), u(x1 + i1), u(x2 + i2), u(x3 + i3), u(x4 + i4), u(x5 + i5),
            u(x6 + i6), u(x7 + i7), u(x8 + i8), u(x9 + i9), u(x10 + i10), u(x11 + i11),
            u(x12 + i12), u(x13 + i13), u(x14 + i14), u(x15 + i15))


@njit(cache=True, _nrt=False)
def plan_words(first_word, n, out, j0):
    """Words [first_word, first_word + n) of the plan stream into out[j0:j0 + n]."""
    stream_words(PLAN_KEY, first_word, n, out, j0)


@njit(cache=True, _nrt=False)
def stream_words(key, first_word, n, out, j0):
    """Words [first_word, first_word + n) of the ChaCha12 stream of ``key`` (``seed_key``)
    into out[j0:j0 + n], one block per 16 words: any ``StdRng::seed_from_u64`` stream
    (the plan's; a synthetic load's arrivals, ``trace.seeded_rng``)."""
    word = np.int64(first_word)
    end = word + n
    j = j0
    while word < end:
        block = chacha12_block(key, word // 16)
        stop = min(end, (word // 16 + 1) * 16)
        for k in range(word % 16, word % 16 + (stop - word)):
            out[j] = block[k]
            j += 1
        word = stop


@njit(cache=True, _nrt=False)
def output_token_ids(out_plan, out_authored, row, ordinal, n, out, j0):
    """Tokens ``ordinal`` .. ``ordinal + n - 1`` of trace row ``row``'s output into
    out[j0:j0 + n]: its authored ids, or its slice of the plan stream.

    ``out_plan[row]`` >= 0 is the stream word of the row's first token; < 0 means
    authored ids from ``out_authored[-1 - out_plan[row]]`` on."""
    off = out_plan[row]
    if off >= 0:
        plan_words(off + ordinal, n, out, j0)
    else:
        a0 = -1 - off + ordinal
        for k in range(n):
            out[j0 + k] = out_authored[a0 + k]


def plan_offsets(session: np.ndarray, output_len: np.ndarray, authored: np.ndarray) -> np.ndarray:
    """int64[row]: the stream word of each row's first planned token. Rows take turns
    session-major (``session`` is dense by first appearance; rows of a session are in
    turn order), each ``output_len`` words; ``authored`` rows draw none (their entry
    is meaningless and set to -1)."""
    rows = np.argsort(session, kind="stable")  # session-major, turns in file order
    drawn = np.where(authored[rows], 0, output_len[rows]).astype(np.int64)
    first = np.empty(len(rows), np.int64)
    first[rows] = np.cumsum(drawn) - drawn
    first[authored] = -1
    return first


@njit(cache=True, _nrt=False)
def output_tokens_at(out_plan, out_authored, rows, ordinals, out):
    """out[k] = token ``ordinals[k]`` (from 0) of trace row ``rows[k]``'s output."""
    for k in range(rows.shape[0]):
        output_token_ids(out_plan, out_authored, rows[k], ordinals[k], 1, out, k)
