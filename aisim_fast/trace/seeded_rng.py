"""The reference's seeded generator as its synthetic loads draw from it: Rust's
``rand`` 0.9 ``StdRng::seed_from_u64`` (ChaCha with 12 rounds; the stream itself is
``kernels.trace.output_plan``'s, the one the output plan draws from) read as rand reads
it, so a poisson load with ``arrival_seed`` S arrives at exactly the reference's times.

What this adds to the stream:

* the buffer: four blocks (64 words) at a time, a ``u64`` read as two consecutive
  words low first, the one that straddles a refill taking the last word of the old
  buffer and the first of the new;
* ``random::<f64>()``: the top 53 bits of a ``u64`` times 2**-53, in [0, 1);
* ``random_range(0..n)`` for ``n`` below 2**32: Canon's widening multiply, a second
  word drawn only when the first product's low half could carry.

A test checks the draws against the reference's poisson arrivals
(``tests/golden/test_synthetic_traffic.py``).
"""

from __future__ import annotations

import numpy as np

from aisim_fast.kernels.trace.output_plan import seed_key, stream_words

_BUFFER_WORDS = 64  # four blocks per refill


class StdRng:
    """``StdRng::seed_from_u64(seed)`` and the draws the synthetic loads use."""

    def __init__(self, seed: int):
        self._key = seed_key(int(seed))
        self._next_word = 0  # of the stream: the next refill starts here
        self._words = np.zeros(_BUFFER_WORDS, np.uint32)
        self._index = _BUFFER_WORDS  # empty: the first draw fills it

    def _refill(self) -> None:
        stream_words(self._key, self._next_word, _BUFFER_WORDS, self._words, 0)
        self._next_word += _BUFFER_WORDS

    def next_u32(self) -> int:
        if self._index >= _BUFFER_WORDS:
            self._refill()
            self._index = 0
        self._index += 1
        return int(self._words[self._index - 1])

    def random_range(self, n: int) -> int:
        """A uniform draw in [0, n) as rand 0.9 ``random_range(0..n)`` makes it for
        ``n`` < 2**32 (Canon's method, no rejection): the high half of ``x * n``, plus
        the carry of its low half and the high half of a second ``x2 * n`` when that
        low half exceeds ``2**32 - n``. Tested against the reference's prefix-group
        draws in ``tests/golden/test_synthetic_traffic.py``."""
        if not 0 < n < (1 << 32):
            raise ValueError(f"random_range needs 0 < n < 2**32, got {n}")
        m = self.next_u32() * n
        hi, lo = m >> 32, m & 0xFFFFFFFF
        if lo > (1 << 32) - n:
            hi2 = (self.next_u32() * n) >> 32
            if lo + hi2 >= (1 << 32):
                hi += 1
        return hi

    def next_u64(self) -> int:
        i = self._index
        words = self._words
        if i < _BUFFER_WORDS - 1:
            self._index += 2
            return int(words[i]) | (int(words[i + 1]) << 32)
        if i >= _BUFFER_WORDS:
            self._refill()
            self._index = 2
            return int(words[0]) | (int(words[1]) << 32)
        low = int(words[_BUFFER_WORDS - 1])
        self._refill()
        self._index = 1
        return low | (int(words[0]) << 32)

    def random_f64(self) -> float:
        """A uniform draw in [0, 1): the top 53 bits of a ``u64`` times 2**-53."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))
