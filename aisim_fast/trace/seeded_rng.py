"""The reference's seeded generator, bit for bit: ChaCha with 12 rounds seeded from a
``u64`` (Rust's ``rand`` 0.9 ``StdRng::seed_from_u64``), and its uniform ``f64``
draws. Synthetic arrivals (``trace.synthetic``) come from it, so a poisson load
with ``arrival_seed`` S arrives at exactly the reference's times.

What is reproduced:

* ``seed_from_u64``: the 32-byte key is eight outputs of a PCG32 step
  (multiplier 6364136223846793005, increment 11634580027462260723, XSH-RR output),
  little-endian;
* the ChaCha12 block: the "expand 32-byte k" constants, the key, a 64-bit block
  counter in words 12-13 from 0 and a zero 64-bit stream, 6 double rounds, the input
  added back;
* the buffer: four blocks (64 words) at a time, a ``u64`` read as two consecutive
  words low first, the one that straddles a refill taking the last word of the old
  buffer and the first of the new;
* ``random::<f64>()``: the top 53 bits of a ``u64`` times 2**-53, in [0, 1).

A test checks the first draws against the reference's poisson arrivals
(``tests/unit/test_synthetic_traffic.py``).
"""

from __future__ import annotations

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_BUFFER_WORDS = 64   # four blocks per refill
_DOUBLE_ROUNDS = 6   # ChaCha12


def _pcg32(state: int) -> tuple[int, int]:
    """One PCG32 step: (new state, the 32-bit output)."""
    state = (state * 6364136223846793005 + 11634580027462260723) & _M64
    xorshifted = (((state >> 18) ^ state) >> 27) & _M32
    rot = state >> 59
    return state, ((xorshifted >> rot) | (xorshifted << ((32 - rot) & 31))) & _M32


def _rotl(x: int, n: int) -> int:
    return ((x << n) | (x >> (32 - n))) & _M32


def _block(key: tuple, counter: int) -> list[int]:
    """The 16 output words of one ChaCha12 block."""
    start = [*_CONSTANTS, *key, counter & _M32, (counter >> 32) & _M32, 0, 0]
    x = list(start)

    def quarter(a, b, c, d):
        x[a] = (x[a] + x[b]) & _M32
        x[d] = _rotl(x[d] ^ x[a], 16)
        x[c] = (x[c] + x[d]) & _M32
        x[b] = _rotl(x[b] ^ x[c], 12)
        x[a] = (x[a] + x[b]) & _M32
        x[d] = _rotl(x[d] ^ x[a], 8)
        x[c] = (x[c] + x[d]) & _M32
        x[b] = _rotl(x[b] ^ x[c], 7)

    for _ in range(_DOUBLE_ROUNDS):
        quarter(0, 4, 8, 12)
        quarter(1, 5, 9, 13)
        quarter(2, 6, 10, 14)
        quarter(3, 7, 11, 15)
        quarter(0, 5, 10, 15)
        quarter(1, 6, 11, 12)
        quarter(2, 7, 8, 13)
        quarter(3, 4, 9, 14)
    return [(a + b) & _M32 for a, b in zip(x, start)]


class StdRng:
    """``StdRng::seed_from_u64(seed)`` and the draws the synthetic loads use."""

    def __init__(self, seed: int):
        state = int(seed) & _M64
        key = []
        for _ in range(8):
            state, word = _pcg32(state)
            key.append(word)
        self._key = tuple(key)
        self._counter = 0
        self._words: list[int] = []
        self._index = _BUFFER_WORDS  # empty: the first draw fills it

    def _refill(self) -> None:
        words = []
        for i in range(_BUFFER_WORDS // 16):
            words += _block(self._key, self._counter + i)
        self._counter += _BUFFER_WORDS // 16
        self._words = words

    def next_u64(self) -> int:
        i = self._index
        if i < _BUFFER_WORDS - 1:
            self._index += 2
            return self._words[i] | (self._words[i + 1] << 32)
        if i >= _BUFFER_WORDS:
            self._refill()
            self._index = 2
            return self._words[0] | (self._words[1] << 32)
        low = self._words[_BUFFER_WORDS - 1]
        self._refill()
        self._index = 1
        return low | (self._words[0] << 32)

    def random_f64(self) -> float:
        """A uniform draw in [0, 1): the top 53 bits of a ``u64`` times 2**-53."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))
