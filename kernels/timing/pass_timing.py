"""Forward-pass timing models: ``polynomial`` (the reference's built-in fallback),
``fixed`` and op-level ``aic`` tables (kernels.timing.aic_table), with the reference's nanosecond quantization and speedup scaling.

Every modeled duration goes through a nanosecond duration type in the reference
(Rust ``Duration::from_secs_f64``: round to the nearest ns, computed exactly from
the f64 value) and back to f64 milliseconds as ``(secs + nanos / 1e9) * 1000``.
Pass ends are running f64 sums ``(start + prefill) + decode``; reproducing that
float sequence is what makes per-request times match the reference bit for bit.
"""

import math

import numpy as np
from numba import njit

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import (CFG_TIMING, CFGF_DECODE_SPEEDUP_RATIO, CFGF_FIXED_DECODE_MS,
                                              CFGF_FIXED_PREFILL_MS, CFGF_SPEEDUP_RATIO, TIMING_AIC,
                                              TIMING_FIXED)
from aisim_fast.kernels.timing.aic_table import KIND_DECODE, KIND_PREFILL, aic_raw_ms

NS_PER_S = 1_000_000_000
_SPLIT = 134217729.0  # 2**27 + 1, Veltkamp splitter for an exact f64 product


@kernel(cache=True, _nrt=False, inline="always")
def _two_product(a, b):
    """(p, e) with p = fl(a*b) and a*b = p + e exactly (Dekker)."""
    p = a * b
    ca = _SPLIT * a
    a_hi = ca - (ca - a)
    a_lo = a - a_hi
    cb = _SPLIT * b
    b_hi = cb - (cb - b)
    b_lo = b - b_hi
    e = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    return p, e


@njit(cache=True, _nrt=False)
def secs_to_ns(secs):
    """Nearest whole nanoseconds of ``secs`` (f64 seconds, >= 0), from the exact value
    of the f64 rather than from a rounded ``secs * 1e9``."""
    p, e = _two_product(secs, 1e9)
    whole = math.floor(p)
    frac = (p - whole) + e
    ns = np.int64(whole)
    if frac >= 0.5:
        ns += 1
    elif frac < -0.5:
        ns -= 1
    return ns


@kernel(cache=True, _nrt=False)
def ns_to_ms(ns):
    """Milliseconds of a nanosecond count, as the reference converts a Duration."""
    secs = float(ns // NS_PER_S) + float(ns % NS_PER_S) / 1e9
    return secs * 1000.0


# Below this many ns a Duration survives the trip to f64 seconds and back unchanged:
# whole seconds < 2**22 keep the fraction's error under 2**-31 s, well inside the
# half nanosecond that rounding to the nearest ns forgives.
EXACT_ROUND_TRIP_NS = (1 << 22) * NS_PER_S


@njit(cache=True, _nrt=False)
def modeled_ns(raw_ms, ratio):
    """Nanoseconds of a modeled latency ``raw_ms`` divided by ``ratio``: quantized once,
    then (ratio > 0 and duration > 0) divided in seconds and quantized again. A ratio
    of 1 divides exactly, and the round trip of a duration under 48 days is the
    identity (EXACT_ROUND_TRIP_NS), so that common case skips the second step."""
    ns = secs_to_ns(raw_ms / 1000.0)
    if ratio > 0.0 and ns > 0 and not (ratio == 1.0 and ns < EXACT_ROUND_TRIP_NS):
        secs = float(ns // NS_PER_S) + float(ns % NS_PER_S) / 1e9
        ns = secs_to_ns(secs / ratio)
    return ns


@kernel(cache=True, _nrt=False)
def polynomial_prefill_ms(batch, total_isl, total_prefix):
    """Prefill latency of a batch. The polynomial's argument uses floored integer
    means, ``T = b * (floor(isl/b) - floor(prefix/b))``, not the true total."""
    if batch == 0:
        return 0.0
    mean_isl = total_isl // batch
    mean_prefix = total_prefix // batch
    if mean_isl <= mean_prefix:
        return 0.0
    t = float(batch * (mean_isl - mean_prefix))
    # the reference squares with powi(2): a * (T * T), then the linear term, then the constant
    return 4.209989e-07 * (t * t) + 1.518344e-02 * t + 16.50142


@kernel(cache=True, _nrt=False)
def polynomial_decode_ms(batch, active_kv_tokens, total_kv_tokens):
    """Decode latency: a function of KV utilisation of the configured capacity."""
    if batch == 0:
        return 0.0
    if total_kv_tokens == 0:
        u = 1.0
    else:
        u = min(1.0, float(active_kv_tokens) / float(total_kv_tokens))
    return max(1.0, -25.74 * (u * u) + 54.01 * u + 5.74)


# op-level timing behind the aic feature gate (kernels.features): a batch without AIC
# workers compiles none of kernels.timing.aic_table
_aic_raw_ms = gate("aic", aic_raw_ms, 0.0)


@kernel(cache=True, _nrt=False)
def prefill_ns(cfg, w, batch, total_isl, total_prefix):
    """Quantized prefill duration of a pass on worker w (0 when no request computed
    prompt tokens or the floored means say everything was cached)."""
    if batch == 0 or total_isl // batch <= total_prefix // batch:
        return np.int64(0)
    timing = cfg.i64[w, CFG_TIMING]
    if timing == TIMING_FIXED:
        raw = cfg.f64[w, CFGF_FIXED_PREFILL_MS]
    elif timing == TIMING_AIC:
        raw = max(0.0, _aic_raw_ms(cfg.features, cfg, w, KIND_PREFILL, batch, total_isl // batch,
                                  total_prefix // batch))
    else:
        raw = polynomial_prefill_ms(batch, total_isl, total_prefix)
    return modeled_ns(raw, cfg.f64[w, CFGF_SPEEDUP_RATIO])


@kernel(cache=True, _nrt=False)
def decode_ns(cfg, w, batch, active_kv_tokens, total_kv_tokens):
    """Quantized decode duration of a pass on worker w over its decode batch
    (``active_kv_tokens``: the batch's tokens before this pass's; AIC keys on their
    floored mean, the polynomial on their share of ``total_kv_tokens``)."""
    if batch == 0:
        return np.int64(0)
    timing = cfg.i64[w, CFG_TIMING]
    if timing == TIMING_FIXED:
        raw = cfg.f64[w, CFGF_FIXED_DECODE_MS]
    elif timing == TIMING_AIC:
        raw = _aic_raw_ms(cfg.features, cfg, w, KIND_DECODE, batch, active_kv_tokens // batch, np.int64(0))
    else:
        raw = polynomial_decode_ms(batch, active_kv_tokens, total_kv_tokens)
    return modeled_ns(raw, cfg.f64[w, CFGF_SPEEDUP_RATIO] * cfg.f64[w, CFGF_DECODE_SPEEDUP_RATIO])
