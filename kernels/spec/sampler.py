"""The acceptance draw of a speculative verify pass, as the reference draws it
(``common/speculative.rs``): one sampler per rank, rand's ``StdRng`` seeded with
``aic_mtp_seed + worker_id * dp_size + dp_rank``; per ready request, the tokens a
verify pass yields are 1 plus the leading drafts accepted, each drawn as
``Bernoulli(rate_i)`` in order until the first rejection.

rand 0.9's Bernoulli: a rate of exactly 1 is always true and draws nothing; any
other rate ``p`` draws one ``u64`` and accepts when it is below ``floor(p * 2**64)``
(the threshold the driver stores in ``CFG_SPEC_ACCEPT_*``, ``accept_thresholds``).
A ``u64`` of ``StdRng`` is two consecutive words of its ChaCha12 stream, low first,
wherever its 64-word buffer is refilled, so the stream position is a word counter
(``WK_SPEC_WORD``) and the worker keeps only the 16-word block in use
(``wk.spec_rng``).
"""

import numpy as np

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import CFG_SPEC_ACCEPT_0, CFG_SPEC_NEXTN, WK_SPEC_BLOCK, WK_SPEC_WORD
from aisim_fast.kernels.trace.output_plan import chacha12_block, seed_key

ALWAYS = -1  # the threshold of a rate of 1 (u64::MAX): accepted without a draw
_TWO_64 = 18446744073709551616.0


def accept_thresholds(rates) -> list[int]:
    """rand's Bernoulli thresholds of these rates as int64 bit patterns (the driver's
    side: ``CFG_SPEC_ACCEPT_*``)."""
    out = []
    for rate in rates:
        rate = float(rate)
        value = (1 << 64) - 1 if rate == 1.0 else min(int(rate * _TWO_64), (1 << 64) - 1)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


def stream_key(seed: int) -> np.ndarray:
    """The ChaCha key of a rank's sampler seeded ``seed`` (wrapping to 64 bits)."""
    return seed_key(int(seed) % (1 << 64))


@kernel(cache=True, _nrt=False)
def _next_u64(wk, w):
    word = wk.i64[w, WK_SPEC_WORD]
    block = word // 16
    if wk.i64[w, WK_SPEC_BLOCK] != block:
        words = chacha12_block(wk.spec_rng[w, :8], block)
        for k in range(16):
            wk.spec_rng[w, 8 + k] = words[k]
        wk.i64[w, WK_SPEC_BLOCK] = block
    j = 8 + word % 16  # even: both words of a u64 are in one block
    wk.i64[w, WK_SPEC_WORD] = word + 2
    return np.uint64(wk.spec_rng[w, j]) | (np.uint64(wk.spec_rng[w, j + 1]) << np.uint64(32))


@kernel(cache=True, _nrt=False)
def accepted_tokens(cfg, wk, w):
    """Tokens worker w's next verify pass yields for one request: 1 + the leading
    drafts accepted (before any clamp to what the request has left)."""
    out = np.int64(1)
    for i in range(cfg.i64[w, CFG_SPEC_NEXTN]):
        threshold = cfg.i64[w, CFG_SPEC_ACCEPT_0 + i]
        if threshold != ALWAYS and not _next_u64(wk, w) < np.uint64(threshold):
            break
        out += 1
    return out
