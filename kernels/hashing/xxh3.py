"""XXH3-64 (the 64-bit variant of XXH3, with seed) as Numba kernels.

The functions here reproduce the XXH3 algorithm of the reference xxHash
library (xxhash.h, version 0.8.x) bit for bit: every input length class
(0, 1-3, 4-8, 9-16, 17-128, 129-240 and the striped long path above 240
bytes) and every 64-bit seed, including the seed-derived secret that the
long path uses for a non-zero seed (XXH3_initCustomSecret).  The `xxhash`
PyPI package (`xxhash.xxh3_64_intdigest`) is the test oracle.

All arithmetic is uint64 with wrap-around.  The 64x64->128 bit product that
XXH3 folds into 64 bits is computed from 32-bit halves because Numba has no
128-bit integer type.

Performance notes:
  * The core works on raw byte addresses and reads input and secret with
    unaligned native loads (`_load64`, `_load32`, `_load8`).  Passing Numba
    arrays between non-inlined functions costs an atomic reference-count
    increment and decrement at every call boundary, which dominated the
    cost of short inputs; addresses are plain integers.  The public
    functions take arrays, keep them alive for the whole call and check
    the requested range (IndexError) before any raw read.
  * A uint32 token buffer is hashed in place: its memory already holds the
    little-endian bytes XXH3 must see, so nothing is copied.
  * Nothing is allocated per call except for long inputs with a seed other
    than 0 or XXH3_SEED: the default secret and the secret for XXH3_SEED are
    module constants, and the eight long-path accumulators are a tuple of
    scalars.
XXH3 reads little-endian words, which native loads provide only on
little-endian hosts; the module refuses to import elsewhere.
"""

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from aisim_fast.kernels.jit import kernel

if sys.byteorder != "little":
    raise ImportError("kernels.hashing.xxh3 reads words with native loads and needs a little-endian host")

# ---------------------------------------------------------------------------
# Constants of the XXH3 specification.
# ---------------------------------------------------------------------------

PRIME32_1 = np.uint64(0x9E3779B1)
PRIME32_2 = np.uint64(0x85EBCA77)
PRIME32_3 = np.uint64(0xC2B2AE3D)
PRIME64_1 = np.uint64(0x9E3779B185EBCA87)
PRIME64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
PRIME64_3 = np.uint64(0x165667B19E3779F9)
PRIME64_4 = np.uint64(0x85EBCA77C2B2AE63)
PRIME64_5 = np.uint64(0x27D4EB2F165667C5)
PRIME_MX1 = np.uint64(0x165667919E3779F9)
PRIME_MX2 = np.uint64(0x9FB21C651E98DF25)

_MASK32 = np.uint64(0xFFFFFFFF)
_MASK8 = np.uint64(0xFF)
_ZERO = np.uint64(0)

SECRET_SIZE = 192
_STRIPE_LEN = 64
_SECRET_CONSUME_RATE = 8
_STRIPES_PER_BLOCK = (SECRET_SIZE - _STRIPE_LEN) // _SECRET_CONSUME_RATE  # 16
_BLOCK_LEN = _STRIPE_LEN * _STRIPES_PER_BLOCK  # 1024
_SCRAMBLE_SECRET_OFFSET = SECRET_SIZE - _STRIPE_LEN  # 128
_LAST_STRIPE_SECRET_OFFSET = SECRET_SIZE - _STRIPE_LEN - 7  # 121
_MERGE_SECRET_OFFSET = 11
_MIDSIZE_START_OFFSET = 3
_MIDSIZE_LAST_SECRET_OFFSET = 136 - 17  # XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET

# Seed the simulator uses for prefix-cache block hashes.
XXH3_SEED = np.uint64(1337)

# XXH3_kSecret: the default 192-byte secret.
DEFAULT_SECRET = np.array([
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
], dtype=np.uint8)
DEFAULT_SECRET.setflags(write=False)


def _derive_secret_numpy(seed):
    """XXH3_initCustomSecret in plain numpy, used to build module constants
    without compiling anything at import time."""
    words = DEFAULT_SECRET.view("<u8").copy()
    seed = np.uint64(seed)
    # numpy array arithmetic on uint64 wraps silently, as the spec requires.
    words[0::2] += seed
    words[1::2] -= seed
    secret = words.view(np.uint8).copy()
    secret.setflags(write=False)
    return secret


# Secret for the simulator's seed, so the hot long path never derives one.
SECRET_1337 = _derive_secret_numpy(XXH3_SEED)


def _le64_of(secret, offset):
    return int.from_bytes(bytes(secret[offset:offset + 8]), "little")


# The 16-byte chain hash always runs the 9-16 byte path with seed 1337 and
# the default secret, so its two key words are folded into constants here.
_CHAIN_BITFLIP_LO = np.uint64(
    ((_le64_of(DEFAULT_SECRET, 24) ^ _le64_of(DEFAULT_SECRET, 32)) + 1337) & 0xFFFFFFFFFFFFFFFF)
_CHAIN_BITFLIP_HI = np.uint64(
    ((_le64_of(DEFAULT_SECRET, 40) ^ _le64_of(DEFAULT_SECRET, 48)) - 1337) & 0xFFFFFFFFFFFFFFFF)
# The 24-byte synthetic-token hash (seed 0) reads secret words 0, 8, 16, 24.
_SECRET_W0 = np.uint64(_le64_of(DEFAULT_SECRET, 0))
_SECRET_W8 = np.uint64(_le64_of(DEFAULT_SECRET, 8))
_SECRET_W16 = np.uint64(_le64_of(DEFAULT_SECRET, 16))
_SECRET_W24 = np.uint64(_le64_of(DEFAULT_SECRET, 24))
_LEN24_TIMES_PRIME64_1 = np.uint64((24 * 0x9E3779B185EBCA87) & 0xFFFFFFFFFFFFFFFF)
_LEN16 = np.uint64(16)

# ---------------------------------------------------------------------------
# Raw memory access.  Addresses are intp; callers guarantee the bytes exist
# and that the owning array outlives the call.
# ---------------------------------------------------------------------------


def _make_address_of(dtypes):
    allowed = ", ".join(str(dtype) for dtype in dtypes)

    @intrinsic
    def address_of(typingctx, array):
        # Raw addresses are only meaningful for contiguous 1-d arrays whose
        # items are the bytes or words the caller's offsets count.
        if not (isinstance(array, types.Array) and array.ndim == 1
                and array.layout == "C" and array.dtype in dtypes):
            raise TypingError(f"expected a C-contiguous 1-d array of {allowed}, got {array}")

        def codegen(context, builder, signature, args):
            array_struct = context.make_array(signature.args[0])(context, builder, value=args[0])
            return builder.ptrtoint(array_struct.data, context.get_value_type(types.intp))

        return types.intp(array), codegen

    address_of.__doc__ = f"Byte address (intp) of the first item of a C-contiguous {allowed} array."
    return address_of


_address_of_bytes = _make_address_of((types.uint8,))
_address_of_words = _make_address_of((types.uint32,))


def _make_loader(bits):
    @intrinsic
    def load(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            value = builder.load(pointer, align=1)
            return value if bits == 64 else builder.zext(value, ir.IntType(64))

        return types.uint64(address), codegen

    load.__doc__ = f"Unsigned {bits}-bit little-endian value at `address`, as uint64."
    return load


_load64 = _make_loader(64)
_load32 = _make_loader(32)
_load8 = _make_loader(8)


# ---------------------------------------------------------------------------
# Scalar building blocks (uint64 in, uint64 out).
# ---------------------------------------------------------------------------


@kernel(cache=True)
def _swap32(x):
    """Byte-reverse the low 32 bits of x (x < 2**32)."""
    return (((x & np.uint64(0x000000FF)) << 24)
            | ((x & np.uint64(0x0000FF00)) << 8)
            | ((x >> 8) & np.uint64(0x0000FF00))
            | ((x >> 24) & np.uint64(0x000000FF)))


@kernel(cache=True)
def _swap64(x):
    return (_swap32(x & _MASK32) << 32) | _swap32(x >> 32)


@kernel(cache=True)
def _mul128_fold64(lhs, rhs):
    """XOR of the high and low halves of the 128-bit product lhs*rhs.

    Schoolbook multiplication on 32-bit limbs; `cross` cannot overflow
    because it sums two values below 2**32 and one product of two 32-bit
    values, which is at most (2**32-1)**2.
    """
    lhs_lo = lhs & _MASK32
    lhs_hi = lhs >> 32
    rhs_lo = rhs & _MASK32
    rhs_hi = rhs >> 32
    lo_lo = lhs_lo * rhs_lo
    hi_lo = lhs_hi * rhs_lo
    lo_hi = lhs_lo * rhs_hi
    hi_hi = lhs_hi * rhs_hi
    cross = (lo_lo >> 32) + (hi_lo & _MASK32) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
    lower = (cross << 32) | (lo_lo & _MASK32)
    return lower ^ upper


@kernel(cache=True)
def _xxh64_avalanche(h):
    h ^= h >> 33
    h *= PRIME64_2
    h ^= h >> 29
    h *= PRIME64_3
    h ^= h >> 32
    return h


@kernel(cache=True)
def _xxh3_avalanche(h):
    h ^= h >> 37
    h *= PRIME_MX1
    h ^= h >> 32
    return h


@kernel(cache=True)
def _rrmxmx(h, length):
    """Stronger avalanche of the 4-8 byte path (length as uint64)."""
    h ^= ((h << 49) | (h >> 15)) ^ ((h << 24) | (h >> 40))
    h *= PRIME_MX2
    h ^= (h >> 35) + length
    h *= PRIME_MX2
    h ^= h >> 28
    return h


@kernel(cache=True)
def _mix16_words(input_lo, input_hi, secret_lo, secret_hi, seed):
    return _mul128_fold64(input_lo ^ (secret_lo + seed), input_hi ^ (secret_hi - seed))


@kernel(cache=True)
def _mix16b(input_address, secret_address, seed):
    """Keyed fold of 16 input bytes against 16 secret bytes."""
    return _mix16_words(_load64(input_address), _load64(input_address + 8),
                        _load64(secret_address), _load64(secret_address + 8), seed)


@kernel(cache=True)
def _len_9to16_words(input_lo, input_hi, length, bitflip_lo, bitflip_hi):
    """9-16 byte path given the first and last 8 input bytes as words."""
    keyed_lo = input_lo ^ bitflip_lo
    keyed_hi = input_hi ^ bitflip_hi
    acc = length + _swap64(keyed_lo) + keyed_hi + _mul128_fold64(keyed_lo, keyed_hi)
    return _xxh3_avalanche(acc)


# ---------------------------------------------------------------------------
# Length classes up to 240 bytes.  They always use the default secret; the
# seed enters arithmetically.  `data` is the input's byte address.
# ---------------------------------------------------------------------------


@kernel(cache=True)
def _hash_len_0to16(data, length, seed):
    secret = _address_of_bytes(DEFAULT_SECRET)
    length_u = np.uint64(length)
    if length > 8:
        bitflip_lo = (_load64(secret + 24) ^ _load64(secret + 32)) + seed
        bitflip_hi = (_load64(secret + 40) ^ _load64(secret + 48)) - seed
        return _len_9to16_words(_load64(data), _load64(data + length - 8),
                                length_u, bitflip_lo, bitflip_hi)
    if length >= 4:
        # As in the reference, the byte-swapped low half of the seed is
        # XORed into its high half, so the seed keys both 32-bit input words.
        seed_mirrored = seed ^ (_swap32(seed & _MASK32) << 32)
        first = _load32(data)
        last = _load32(data + length - 4)
        bitflip = (_load64(secret + 8) ^ _load64(secret + 16)) - seed_mirrored
        return _rrmxmx((last + (first << 32)) ^ bitflip, length_u)
    if length > 0:
        first = _load8(data)
        middle = _load8(data + (length >> 1))
        last = _load8(data + length - 1)
        combined = (first << 16) | (middle << 24) | last | (length_u << 8)
        bitflip = (_load32(secret) ^ _load32(secret + 4)) + seed
        return _xxh64_avalanche(combined ^ bitflip)
    return _xxh64_avalanche(seed ^ _load64(secret + 56) ^ _load64(secret + 64))


@kernel(cache=True)
def _hash_len_17to128(data, length, seed):
    secret = _address_of_bytes(DEFAULT_SECRET)
    # 16-byte lanes are taken pairwise from both ends, so every byte is
    # covered without a length-dependent loop.
    acc = np.uint64(length) * PRIME64_1
    end = data + length
    if length > 32:
        if length > 64:
            if length > 96:
                acc += _mix16b(data + 48, secret + 96, seed)
                acc += _mix16b(end - 64, secret + 112, seed)
            acc += _mix16b(data + 32, secret + 64, seed)
            acc += _mix16b(end - 48, secret + 80, seed)
        acc += _mix16b(data + 16, secret + 32, seed)
        acc += _mix16b(end - 32, secret + 48, seed)
    acc += _mix16b(data, secret, seed)
    acc += _mix16b(end - 16, secret + 16, seed)
    return _xxh3_avalanche(acc)


@kernel(cache=True)
def _hash_len_129to240(data, length, seed):
    secret = _address_of_bytes(DEFAULT_SECRET)
    acc = np.uint64(length) * PRIME64_1
    for lane in range(8):
        acc += _mix16b(data + 16 * lane, secret + 16 * lane, seed)
    # The first 128 bytes are avalanched before the rest is added; lanes
    # past 128 bytes reuse the secret from a 3-byte offset.
    acc = _xxh3_avalanche(acc)
    tail = _mix16b(data + length - 16, secret + _MIDSIZE_LAST_SECRET_OFFSET, seed)
    for lane in range(8, length // 16):
        tail += _mix16b(data + 16 * lane, secret + 16 * (lane - 8) + _MIDSIZE_START_OFFSET, seed)
    return _xxh3_avalanche(acc + tail)


# ---------------------------------------------------------------------------
# Long inputs (> 240 bytes): 64-byte stripes feed eight accumulators, which
# are scrambled after every 1024-byte block and merged at the end.
# ---------------------------------------------------------------------------


@kernel(cache=True)
def _accumulate_stripe(acc, stripe, secret):
    """XXH3_accumulate_512 (scalar form) for the 64 bytes at `stripe`."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    d0 = _load64(stripe)
    d1 = _load64(stripe + 8)
    d2 = _load64(stripe + 16)
    d3 = _load64(stripe + 24)
    d4 = _load64(stripe + 32)
    d5 = _load64(stripe + 40)
    d6 = _load64(stripe + 48)
    d7 = _load64(stripe + 56)
    k0 = d0 ^ _load64(secret)
    k1 = d1 ^ _load64(secret + 8)
    k2 = d2 ^ _load64(secret + 16)
    k3 = d3 ^ _load64(secret + 24)
    k4 = d4 ^ _load64(secret + 32)
    k5 = d5 ^ _load64(secret + 40)
    k6 = d6 ^ _load64(secret + 48)
    k7 = d7 ^ _load64(secret + 56)
    # Each lane adds its raw data to its pair lane (i ^ 1) and the 32x32
    # product of its keyed halves to itself.
    return (a0 + d1 + (k0 & _MASK32) * (k0 >> 32),
            a1 + d0 + (k1 & _MASK32) * (k1 >> 32),
            a2 + d3 + (k2 & _MASK32) * (k2 >> 32),
            a3 + d2 + (k3 & _MASK32) * (k3 >> 32),
            a4 + d5 + (k4 & _MASK32) * (k4 >> 32),
            a5 + d4 + (k5 & _MASK32) * (k5 >> 32),
            a6 + d7 + (k6 & _MASK32) * (k6 >> 32),
            a7 + d6 + (k7 & _MASK32) * (k7 >> 32))


@kernel(cache=True)
def _scramble_lane(acc, key):
    acc ^= acc >> 47
    acc ^= key
    return acc * PRIME32_1


@kernel(cache=True)
def _scramble(acc, secret):
    """XXH3_scrambleAcc with the 64 secret bytes at `secret`."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    return (_scramble_lane(a0, _load64(secret)),
            _scramble_lane(a1, _load64(secret + 8)),
            _scramble_lane(a2, _load64(secret + 16)),
            _scramble_lane(a3, _load64(secret + 24)),
            _scramble_lane(a4, _load64(secret + 32)),
            _scramble_lane(a5, _load64(secret + 40)),
            _scramble_lane(a6, _load64(secret + 48)),
            _scramble_lane(a7, _load64(secret + 56)))


@kernel(cache=True)
def _merge_accs(acc, secret, start):
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    result = start
    result += _mul128_fold64(a0 ^ _load64(secret), a1 ^ _load64(secret + 8))
    result += _mul128_fold64(a2 ^ _load64(secret + 16), a3 ^ _load64(secret + 24))
    result += _mul128_fold64(a4 ^ _load64(secret + 32), a5 ^ _load64(secret + 40))
    result += _mul128_fold64(a6 ^ _load64(secret + 48), a7 ^ _load64(secret + 56))
    return _xxh3_avalanche(result)


@kernel(cache=True)
def _hash_long(data, length, secret):
    """Long path at address `data` with the (seed-adjusted) secret at
    address `secret`."""
    acc = (PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
           PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1)
    # The last byte always belongs to the final, possibly overlapping,
    # stripe, which is handled after the loop; hence the (length - 1).
    # Full 1024-byte blocks are scrambled after their 16th stripe; a partial
    # last block has at most 15 stripes and is not scrambled.  One loop with
    # a conditional scramble (instead of a loop per block) also keeps LLVM
    # from vectorizing across stripes with slow gathers.
    n_stripes = (length - 1) // _STRIPE_LEN
    for stripe in range(n_stripes):
        in_block = stripe % _STRIPES_PER_BLOCK
        acc = _accumulate_stripe(acc, data + stripe * _STRIPE_LEN,
                                 secret + in_block * _SECRET_CONSUME_RATE)
        if in_block == _STRIPES_PER_BLOCK - 1:
            acc = _scramble(acc, secret + _SCRAMBLE_SECRET_OFFSET)
    acc = _accumulate_stripe(acc, data + length - _STRIPE_LEN,
                             secret + _LAST_STRIPE_SECRET_OFFSET)
    return _merge_accs(acc, secret + _MERGE_SECRET_OFFSET, np.uint64(length) * PRIME64_1)


@kernel(cache=True)
def _hash_long_secret_array(data, length, secret):
    # Taking the secret as an array argument keeps it alive for the call.
    return _hash_long(data, length, _address_of_bytes(secret))


@njit(cache=True)
def make_secret(seed):
    """XXH3_initCustomSecret: the 192-byte secret the long path uses for a
    non-zero seed (allocates the returned array)."""
    seed_u = np.uint64(seed)
    default = _address_of_bytes(DEFAULT_SECRET)
    secret = np.empty(SECRET_SIZE, dtype=np.uint8)
    for pair in range(SECRET_SIZE // 16):
        lo = _load64(default + 16 * pair) + seed_u
        hi = _load64(default + 16 * pair + 8) - seed_u
        for k in range(8):
            secret[16 * pair + k] = np.uint8((lo >> (8 * k)) & _MASK8)
            secret[16 * pair + 8 + k] = np.uint8((hi >> (8 * k)) & _MASK8)
    return secret


@kernel(cache=True)
def _xxh3_64_at(data, length, seed):
    """XXH3-64 of `length` bytes at address `data` (seed: uint64)."""
    if length <= 16:
        return _hash_len_0to16(data, length, seed)
    if length <= 128:
        return _hash_len_17to128(data, length, seed)
    if length <= 240:
        return _hash_len_129to240(data, length, seed)
    if seed == _ZERO:
        return _hash_long(data, length, _address_of_bytes(DEFAULT_SECRET))
    if seed == XXH3_SEED:
        return _hash_long(data, length, _address_of_bytes(SECRET_1337))
    # Uncommon seed: derive its secret (the only allocating path).
    return _hash_long_secret_array(data, length, make_secret(seed))


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


@kernel(cache=True, _nrt=False)
def xxh3_64_u32_seed1337(tokens, start, count):
    """``xxh3_64_u32(tokens, start, count, XXH3_SEED)`` for the engine's block hashes:
    the reference's seed has a precomputed secret, so this has no allocating path and
    compiles the same under any caller (the general entry's uncommon-seed branch
    allocates, which a caller compiled without Numba's runtime cannot type). The
    caller guarantees the range."""
    address = _address_of_words(tokens) + np.intp(4) * np.intp(start)
    length = np.intp(4) * np.intp(count)
    if length <= 16:
        return _hash_len_0to16(address, length, XXH3_SEED)
    if length <= 128:
        return _hash_len_17to128(address, length, XXH3_SEED)
    if length <= 240:
        return _hash_len_129to240(address, length, XXH3_SEED)
    return _hash_long(address, length, _address_of_bytes(SECRET_1337))



@kernel(cache=True)
def _xxh3_64_checked(address, size, start, length, item_size, seed):
    """_xxh3_64_at for items [start, start+length) of a buffer of `size`
    items of `item_size` bytes at `address`, after a range check.

    Takes scalars only: an array argument would cost reference counting
    around the call, and the raising branch would keep it from being pruned.
    """
    if start < 0 or length < 0 or start > size - length:
        raise IndexError("xxh3: range outside the buffer")
    return _xxh3_64_at(address + item_size * start, item_size * length, np.uint64(seed))


@njit(cache=True)
def xxh3_64_bytes(buf, start, length, seed):
    """XXH3-64 of buf[start:start+length] (buf: C-contiguous uint8 array).

    Pass the seed as np.uint64: Numba types a Python int as int64, which
    cannot hold seeds of 2**63 and above.
    """
    return _xxh3_64_checked(_address_of_bytes(buf), len(buf), np.intp(start), np.intp(length),
                            1, seed)


@njit(cache=True)
def xxh3_64_u32(tokens, start, count, seed):
    """XXH3-64 of tokens[start:start+count] taken as 4*count little-endian
    bytes (tokens: C-contiguous uint32 array), hashed in place; seed as in
    xxh3_64_bytes."""
    return _xxh3_64_checked(_address_of_words(tokens), len(tokens), np.intp(start),
                            np.intp(count), 4, seed)


@njit(cache=True)
def hash_long_with_secret(buf, start, length, secret):
    """XXH3-64 long path of buf[start:start+length] (uint8, length > 240)
    with an explicit 192-byte secret: DEFAULT_SECRET for seed 0, or
    make_secret(seed), which then equals xxh3_64_bytes with that seed."""
    if start < 0 or length < 0 or start > len(buf) - length:
        raise IndexError("xxh3: range outside the buffer")
    if length <= 240:
        raise ValueError("xxh3: the long path needs more than 240 bytes")
    if len(secret) < SECRET_SIZE:
        raise ValueError("xxh3: the secret must hold 192 bytes")
    return _hash_long(_address_of_bytes(buf) + np.intp(start), np.intp(length),
                      _address_of_bytes(secret))


@njit(cache=True)
def hash_chain(parent, local):
    """XXH3-64, seed 1337, of the 16 bytes u64le(parent) || u64le(local)."""
    return _len_9to16_words(np.uint64(parent), np.uint64(local), _LEN16,
                            _CHAIN_BITFLIP_LO, _CHAIN_BITFLIP_HI)


@njit(cache=True)
def hash_token_blocks(tokens, block_size, out_local, out_seq):
    """Hash each complete block of `block_size` tokens.

    out_local[i] is the seed-1337 hash of block i alone; out_seq[i] chains
    it onto the previous block's sequence hash, so out_seq[i] identifies the
    whole prefix tokens[:(i+1)*block_size].  Returns the number of complete
    blocks written.
    """
    n_blocks = len(tokens) // block_size
    if len(out_local) < n_blocks or len(out_seq) < n_blocks:
        raise ValueError("hash_token_blocks: output arrays shorter than the block count")
    parent = _ZERO
    for block in range(n_blocks):
        local = xxh3_64_u32(tokens, block * block_size, block_size, XXH3_SEED)
        out_local[block] = local
        parent = local if block == 0 else hash_chain(parent, local)
        out_seq[block] = parent
    return n_blocks


@njit(cache=True)
def synthetic_output_token(uuid_hi, uuid_lo, ordinal):
    """Deterministic token id for output position `ordinal` of a request.

    Low 32 bits of XXH3-64 (seed 0) over 24 bytes: the 16 UUID bytes in
    RFC (big-endian) order followed by u64le(ordinal).
    """
    # Read as little-endian words, the big-endian UUID halves are
    # byte-swapped.
    word0 = _swap64(np.uint64(uuid_hi))
    word1 = _swap64(np.uint64(uuid_lo))
    word2 = np.uint64(ordinal)
    # 17-128 byte path for length 24: lanes at byte 0 and byte 8 (= len - 16).
    acc = _LEN24_TIMES_PRIME64_1
    acc += _mix16_words(word0, word1, _SECRET_W0, _SECRET_W8, _ZERO)
    acc += _mix16_words(word1, word2, _SECRET_W16, _SECRET_W24, _ZERO)
    return np.uint32(_xxh3_avalanche(acc) & _MASK32)


@njit(cache=True)
def synthetic_output_tokens(uuid_hi, uuid_lo, count):
    """``synthetic_output_token`` of ordinals 0 .. count - 1 (a request's outputs)."""
    out = np.empty(count, np.uint32)
    for k in range(count):
        out[k] = synthetic_output_token(uuid_hi, uuid_lo, np.uint64(k))
    return out
