"""Token-level report accumulators: Welford moments plus a fixed-range DDSketch.

The reference collector keeps every inter-token gap in two pooled streams per run:

* ITL: every gap ``max(t[k+1] - t[k], 0)`` in ms (zero gaps included);
* per-user rate: ``1000 / gap`` in tokens/s, for gaps > 0 only.

Each stream reports exact count/mean/std/min/max (streaming Welford, population std) and
percentiles from a DDSketch with relative accuracy 0.001 (the ``ddsketchy`` crate, see
spec replay.md section 12.4). A batch kernel simulates many runs at once and cannot keep
every token time, so each simulation owns one row of two plain arrays:

* ``stat[s, :]`` float64, ``TOKEN_STAT_WIDTH`` wide: the ITL stream's fields start at
  ``ITL_STAT_BASE`` and the rate stream's at ``RATE_STAT_BASE``; inside a stream the fields
  sit at ``STAT_COUNT``, ``STAT_MEAN``, ``STAT_M2``, ``STAT_MIN``, ``STAT_MAX``,
  ``STAT_ZERO_COUNT``. Counts are float64 (exact up to 2**53 samples).
* ``hist[s, :]`` int64, ``TOKEN_HIST_WIDTH`` wide: the ITL stream's sketch bins start at
  ``ITL_HIST_BASE`` and the rate stream's at ``RATE_HIST_BASE``; each block holds
  ``SKETCH_NUM_BINS`` counters, bin ``i`` holding sketch key ``i - SKETCH_KEY_OFFSET``.

Bin mapping, bit for bit as in the reference:
``key(x) = ceil(ln(x) * inv)`` with ``inv = 1 / log1p(2a / (1 - a))`` and
``value(k) = exp(k * (1 / inv)) * (2 / (1 + g))`` with ``g = 1 + 2a / (1 - a)``.
``1 / inv`` is used rather than ``log1p(...)`` itself because the reference does so and the
two may differ in the last bit (they happen to agree for a = 0.001, but the form is kept).

Fixed range: keys ``-SKETCH_KEY_OFFSET .. SKETCH_NUM_BINS - 1 - SKETCH_KEY_OFFSET`` cover
values in about [9.90e-8, 2.18e9]. That spans ITL gaps from a float-noisy 1 ns
(~1e-6 ms, which can come out a few percent low at large clock values) to ~25 days, and
per-user rates up to 1e9 tok/s. Values outside are CLAMPED into the first or last bin, so a
percentile that lands on such a sample reports that end bin's value instead of a 0.1 %
estimate; count, mean, std, min and max stay exact. The reference store instead grows to
32 768 bins and collapses the lowest ones, which only matters past a dynamic range of
~1e28, so within the range above the two agree exactly.

All functions are ``@njit(cache=True)`` and take only arrays and scalars, so a simulation
kernel can call ``fold_gap`` directly; the Python side (``aisim_fast.report.metrics``) turns one
simulation's rows into the summary keys.
"""

import math

import numpy as np
from numba import njit

from aisim_fast.kernels.jit import kernel

# ---------------------------------------------------------------------------------------
# Sketch mapping constants (ddsketchy's DDSketch::new, evaluated in the same order).
# ---------------------------------------------------------------------------------------
SKETCH_ALPHA = 0.001
SKETCH_GAMMA = 1.0 + (2.0 * SKETCH_ALPHA) / (1.0 - SKETCH_ALPHA)
SKETCH_GAMMA_LN = math.log1p((2.0 * SKETCH_ALPHA) / (1.0 - SKETCH_ALPHA))
SKETCH_INV_GAMMA_LN = 1.0 / SKETCH_GAMMA_LN
# value(k) multiplies k by 1/inv, not by SKETCH_GAMMA_LN (the reference passes
# inv_ln_gamma.recip() to key_to_value).
SKETCH_VALUE_LN_STEP = 1.0 / SKETCH_INV_GAMMA_LN
# Bin representative scale, computed before multiplying as in key_to_value:
# exp(...) * (2 / (1 + g)); (exp(...) * 2) / (1 + g) can differ in the last bit.
SKETCH_VALUE_SCALE = 2.0 / (1.0 + SKETCH_GAMMA)
# Smallest value that gets a key; smaller (non-negative) values go to the zero bucket.
# Reference: max(exp(i32::MIN / inv + 1), f64::MIN_POSITIVE * gamma); the first term
# underflows to 0 for a = 0.001, leaving ~2.23e-308.
SKETCH_MIN_INDEXABLE = max(
    math.exp(-2147483648.0 / SKETCH_INV_GAMMA_LN + 1.0), 2.2250738585072014e-308 * SKETCH_GAMMA
)

# Fixed bin range: key(1e-7) = -8059 and key(2e9) = 10709; rounded out to whole
# 128-bin chunks (8064 + 10752 = 147 * 128). See the module docstring for clamping.
SKETCH_KEY_OFFSET = 8064
SKETCH_NUM_BINS = 18816

# ---------------------------------------------------------------------------------------
# Accumulator layout.
# ---------------------------------------------------------------------------------------
STAT_COUNT = 0  # samples folded, zero bucket included
STAT_MEAN = 1  # Welford running mean
STAT_M2 = 2  # Welford sum of squared deviations
STAT_MIN = 3  # exact min (+inf while empty)
STAT_MAX = 4  # exact max (-inf while empty)
STAT_ZERO_COUNT = 5  # samples below SKETCH_MIN_INDEXABLE (the sketch's zero bucket)
STREAM_STAT_WIDTH = 6

ITL_STAT_BASE = 0
RATE_STAT_BASE = STREAM_STAT_WIDTH
TOKEN_STAT_WIDTH = 2 * STREAM_STAT_WIDTH

ITL_HIST_BASE = 0
RATE_HIST_BASE = SKETCH_NUM_BINS
TOKEN_HIST_WIDTH = 2 * SKETCH_NUM_BINS

# tokens/s per (1 / gap in ms)
MS_PER_S = 1000.0


@njit(cache=True, _nrt=False)
def sketch_key(x):
    """Reference sketch key of a positive value: ``ceil(ln(x) * inv)``.

    Reads: nothing. Returns: int64 key (unclamped).
    """
    return np.int64(math.ceil(math.log(x) * SKETCH_INV_GAMMA_LN))


@njit(cache=True, _nrt=False)
def sketch_value(key):
    """Representative value of sketch key ``key``: ``exp(key * (1/inv)) * (2/(1+g))``.

    Mirrors ddsketchy mapping::key_to_value (key converted to f64 first).
    """
    return math.exp(np.float64(key) * SKETCH_VALUE_LN_STEP) * SKETCH_VALUE_SCALE


@njit(cache=True, _nrt=False)
def sketch_bin(x):
    """Histogram bin index of a value >= SKETCH_MIN_INDEXABLE, clamped to the fixed range."""
    b = sketch_key(x) + SKETCH_KEY_OFFSET
    if b < 0:
        return np.int64(0)
    if b >= SKETCH_NUM_BINS:
        return np.int64(SKETCH_NUM_BINS - 1)
    return b


@njit(cache=True)
def add_hist_rows(dst, dst_row, stat, hist):
    """``dst[dst_row[u]] += hist[u]`` for every row u of ``hist`` (parts of one run
    merged into its row), reading only the bins each stream of u can have touched:
    those between the bins of its exact min and max (the bin mapping is monotone).
    A run's gaps span a few hundred of the 18 816 bins, so this reads a few KiB
    per row instead of 301 KiB."""
    for u in range(hist.shape[0]):
        r = dst_row[u]
        for stream in range(2):
            stat_base = ITL_STAT_BASE if stream == 0 else RATE_STAT_BASE
            hist_base = ITL_HIST_BASE if stream == 0 else RATE_HIST_BASE
            if stat[u, stat_base + STAT_COUNT] - stat[u, stat_base + STAT_ZERO_COUNT] <= 0:
                continue  # nothing in the bins
            lo = sketch_bin(max(stat[u, stat_base + STAT_MIN], SKETCH_MIN_INDEXABLE))
            hi = sketch_bin(stat[u, stat_base + STAT_MAX])
            for i in range(hist_base + lo, hist_base + hi + 1):
                dst[r, i] += hist[u, i]


@njit(cache=True)
def percentile_rank(n, p):
    """0-based rank of percentile ``p`` (in percent) among ``n`` sorted samples.

    ``r = min(round((n - 1) * p / 100), n - 1)`` with Rust's f64::round (half away from
    zero), i.e. nearest rank with ties rounded UP for these non-negative values; Python's
    round-half-to-even fails the n = 6 median and n = 7 p75 goldens (spec 12.3).
    ``floor(x + 0.5)`` would differ only at x = 0.49999999999999994, so the exact form is
    used. Returns 0 for n <= 0.
    """
    if n <= 0:
        return np.int64(0)
    x = np.float64(n - 1) * p / 100.0
    x_floor = math.floor(x)
    # x - floor(x) is exact for |x| < 2**52
    r = np.int64(x_floor) + (1 if x - x_floor >= 0.5 else 0)
    if r > n - 1:
        r = np.int64(n - 1)
    return r


def token_stats_new(num_sims):
    """Allocate empty accumulators for ``num_sims`` simulations (plain numpy: the
    zeroed histogram pages are only touched where a simulation bins a gap).

    Returns: (stat float64[num_sims, TOKEN_STAT_WIDTH], hist int64[num_sims, TOKEN_HIST_WIDTH])
    with counts 0, min +inf and max -inf in both streams.
    """
    stat = np.zeros((num_sims, TOKEN_STAT_WIDTH), np.float64)
    hist = np.zeros((num_sims, TOKEN_HIST_WIDTH), np.int64)
    for base in (ITL_STAT_BASE, RATE_STAT_BASE):
        stat[:, base + STAT_MIN] = np.inf
        stat[:, base + STAT_MAX] = -np.inf
    return stat, hist


@njit(cache=True, _nrt=False)
def fold_value(stat, hist, s, stat_base, hist_base, x):
    """Fold one finite sample ``x >= 0`` into one stream of simulation ``s``.

    Reads/Writes: stat[s, stat_base : stat_base + STREAM_STAT_WIDTH],
                  hist[s, hist_base : hist_base + SKETCH_NUM_BINS]
    Welford: mean += (x - mean) / n; M2 += (x - mean_old) * (x - mean_new).
    """
    n = stat[s, stat_base + STAT_COUNT] + 1.0
    stat[s, stat_base + STAT_COUNT] = n
    mean_old = stat[s, stat_base + STAT_MEAN]
    mean_new = mean_old + (x - mean_old) / n
    stat[s, stat_base + STAT_MEAN] = mean_new
    stat[s, stat_base + STAT_M2] += (x - mean_old) * (x - mean_new)
    if x < stat[s, stat_base + STAT_MIN]:
        stat[s, stat_base + STAT_MIN] = x
    if x > stat[s, stat_base + STAT_MAX]:
        stat[s, stat_base + STAT_MAX] = x
    if x >= SKETCH_MIN_INDEXABLE:
        hist[s, hist_base + sketch_bin(x)] += 1
    else:
        stat[s, stat_base + STAT_ZERO_COUNT] += 1.0


@njit(cache=True, _nrt=False)
def fold_gap(stat, hist, s, gap_ms):
    """Fold one inter-token gap of simulation ``s`` into both token streams.

    A negative gap is clamped to 0 (the reference uses max(t[k+1] - t[k], 0)). The gap
    always enters the ITL stream; ``1000 / gap`` enters the rate stream only for gap > 0,
    and only when finite (a subnormal gap would give +inf, which the reference sketch
    ignores; it never happens with ns-quantized clocks).
    Reads/Writes: stat[s, :], hist[s, :]

    Fold order: the reference folds a request's gaps when the request terminates, and only
    if it completed after an admission. Folding at emission instead gives the same
    histogram, min and max, and mean/std equal up to summation order (~1e-14 rel), but it
    also counts gaps of requests that never complete (left in flight by a time cap,
    cancelled), which the reference leaves out.
    """
    if gap_ms < 0.0:
        gap_ms = 0.0
    fold_value(stat, hist, s, ITL_STAT_BASE, ITL_HIST_BASE, gap_ms)
    if gap_ms > 0.0:
        rate_tok_s = MS_PER_S / gap_ms
        if rate_tok_s < np.inf:
            fold_value(stat, hist, s, RATE_STAT_BASE, RATE_HIST_BASE, rate_tok_s)


@kernel(cache=True, _nrt=False)
def fold_value_run(stat, hist, s, stat_base, hist_base, x, count):
    """Fold ``count`` identical samples ``x >= 0`` at once (Chan's merge of a run of
    equal values: mean and M2 as if folded one by one, up to rounding)."""
    n_old = stat[s, stat_base + STAT_COUNT]
    n = n_old + count
    stat[s, stat_base + STAT_COUNT] = n
    mean_old = stat[s, stat_base + STAT_MEAN]
    delta = x - mean_old
    stat[s, stat_base + STAT_MEAN] = mean_old + delta * count / n
    stat[s, stat_base + STAT_M2] += delta * delta * n_old * count / n
    if x < stat[s, stat_base + STAT_MIN]:
        stat[s, stat_base + STAT_MIN] = x
    if x > stat[s, stat_base + STAT_MAX]:
        stat[s, stat_base + STAT_MAX] = x
    if x >= SKETCH_MIN_INDEXABLE:
        hist[s, hist_base + sketch_bin(x)] += count
    else:
        stat[s, stat_base + STAT_ZERO_COUNT] += count


@kernel(cache=True, _nrt=False)
def fold_gap_run(stat, hist, s, gap_ms, count):
    """Fold ``count`` equal inter-token gaps of simulation ``s`` into both streams.

    In one pass every request that also emitted in the previous pass of its worker
    sees the same gap, so the kernel folds runs of equal gaps: one sketch key (two
    logarithms) per run instead of per token."""
    if count <= 0:
        return
    if gap_ms < 0.0:
        gap_ms = 0.0
    fold_value_run(stat, hist, s, ITL_STAT_BASE, ITL_HIST_BASE, gap_ms, count)
    if gap_ms > 0.0:
        rate_tok_s = MS_PER_S / gap_ms
        if rate_tok_s < np.inf:
            fold_value_run(stat, hist, s, RATE_STAT_BASE, RATE_HIST_BASE, rate_tok_s, count)


@kernel(cache=True)
def fold_token_times(stat, hist, s, token_times_ms):
    """Fold all gaps of one request's token times (in emission order) into simulation s.

    Convenience for callers that hold a request's token times at termination, which is
    the order the reference folds in (spec 12.4).
    """
    for k in range(token_times_ms.shape[0] - 1):
        fold_gap(stat, hist, s, token_times_ms[k + 1] - token_times_ms[k])


@njit(cache=True)
def sketch_quantile_value(hist_row, zero_count, n, p, min_value):
    """Sketch estimate of percentile ``p`` (percent) of one stream.

    hist_row:   int64[SKETCH_NUM_BINS], the stream's bin counts
    zero_count: samples in the zero bucket
    n:          total samples (zero bucket included)
    min_value:  exact min of the stream; with a single sample the reference returns it
    Returns the representative value of the bin holding the r-th smallest sample,
    r = percentile_rank(n, p); 0.0 if that sample is in the zero bucket or n == 0.

    Mirrors the reference collector's StreamingDistribution::percentile: it asks the
    sketch for q = (r + 0.5) / (n - 1) (1.0 when r >= n - 1) and the sketch walks to
    rank floor(q * (n - 1)), which is r again; the round trip is kept literally.
    """
    n = np.int64(n)
    if n <= 0:
        return 0.0
    if n == 1:
        return min_value
    span = n - 1
    r = percentile_rank(n, p)
    if r >= span:
        q = 1.0
    else:
        q = (np.float64(r) + 0.5) / np.float64(span)
    rank = np.int64(q * np.float64(span))
    zeros = np.int64(zero_count)
    if rank < zeros:
        return 0.0
    rank_in_bins = rank - zeros
    seen = np.int64(0)
    for b in range(hist_row.shape[0]):
        seen += hist_row[b]
        if seen > rank_in_bins:
            return sketch_value(np.int64(b) - SKETCH_KEY_OFFSET)
    # Unreachable when n matches the bins; the reference store falls back to its max key.
    for b in range(hist_row.shape[0] - 1, -1, -1):
        if hist_row[b] > 0:
            return sketch_value(np.int64(b) - SKETCH_KEY_OFFSET)
    return 0.0
