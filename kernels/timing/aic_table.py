"""AIC (op-level) timing tables: exact per-key durations served to the kernels.

A worker timed by AIC (``cfg.i64[w, CFG_TIMING] == TIMING_AIC``) reads the raw
duration of a timing key from two open-addressing hash tables in ``cfg.aic_key`` /
``cfg.aic_ms`` (``cfg.aic_meta[t]`` gives each table's slots):

* ``CFG_AIC_SHARED``: every key its timing config knew before the run, one table
  per config for the whole batch, read only while kernels run;
* ``CFG_AIC_LOCAL``: the keys this simulation met that the shared table lacked.
  A key in neither is computed through ``objmode`` by the driver's provider
  (``set_provider``) and put here.

Only the simulation's own thread writes its local table (under the GIL, in
``objmode``), so simulations running concurrently share no written memory.
Keys are the reference's integer arguments packed into one int64: prefill
``(b, mean_isl, mean_prefix)`` and decode ``(b, mean_ctx)``.
"""

import numpy as np
from numba import njit, objmode

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import (AIC_EMPTY, AICM_COUNT, AICM_FIELDS, AICM_MASK, AICM_OFF,
                                               AICM_TIMING, CFG_AIC_LOCAL, CFG_AIC_SHARED)

KIND_PREFILL = 0
KIND_DECODE = 1
_B_BITS = 14
_X_BITS = 24
_Y_BITS = 24
_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: Fibonacci hashing
MAX_LOAD = 0.75  # past this share of a table's slots in use, misses are computed, not kept


@kernel(cache=True, _nrt=False)
def pack_key(kind, b, x, y):
    """The table key of a timing query, or AIC_EMPTY when a value does not fit its
    bits (the query then goes to the provider every time: correct, only slower)."""
    if b < 0 or b >= (1 << _B_BITS) or x < 0 or x >= (1 << _X_BITS) or y < 0 or y >= (1 << _Y_BITS):
        return np.int64(AIC_EMPTY)
    return np.int64(kind | (b << 1) | (x << (1 + _B_BITS)) | (y << (1 + _B_BITS + _X_BITS)))


def pack_keys_np(kind: int, b, x, y) -> np.ndarray:
    """``pack_key`` over arrays (the driver packs what it knows into tables)."""
    b, x, y = (np.asarray(v, np.int64) for v in (b, x, y))
    fits = (b >= 0) & (b < 1 << _B_BITS) & (x >= 0) & (x < 1 << _X_BITS) & (y >= 0) & (y < 1 << _Y_BITS)
    packed = kind | (b << 1) | (x << (1 + _B_BITS)) | (y << (1 + _B_BITS + _X_BITS))
    return np.where(fits, packed, AIC_EMPTY).astype(np.int64)


@kernel(cache=True, _nrt=False)
def _home_slot(key, mask):
    """Home slot of a key: the high bits of its Fibonacci hash."""
    return np.int64((np.uint64(key) * _FIB) >> np.uint64(33)) & mask


@kernel(cache=True, _nrt=False)
def _find(keys, vals, meta, t, key):
    """Slot of ``key`` in table t, or -1."""
    off = meta[t, AICM_OFF]
    mask = meta[t, AICM_MASK]
    h = _home_slot(key, mask)
    while True:
        k = keys[off + h]
        if k == key:
            return off + h
        if k == AIC_EMPTY:
            return np.int64(-1)
        h = (h + 1) & mask


def new_tables(slots_per_table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty tables of at least the given slot counts (rounded up to powers of two):
    ``(keys, vals, meta)`` for ``RankConfig.aic_key / aic_ms / aic_meta``; the caller
    sets each table's AICM_TIMING."""
    sizes = [1 << max(3, int(n - 1).bit_length()) for n in slots_per_table]
    meta = np.zeros((len(sizes), AICM_FIELDS), np.int64)
    meta[:, AICM_MASK] = np.array(sizes, np.int64) - 1
    meta[:, AICM_OFF] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sum(sizes))
    return np.full(total, AIC_EMPTY, np.int64), np.zeros(total, np.float64), meta


_PROVIDER = [None]


def set_provider(fn) -> None:
    """``fn(timing_id, kind, b, x, y) -> raw ms``: the driver's source of values."""
    _PROVIDER[0] = fn


def fill_miss(kind, b, x, y, key, keys, vals, meta, t):
    """A key neither table has: its value from the provider, kept in table t (under
    the GIL, the only writer of that table)."""
    ms = float(_PROVIDER[0](int(meta[t, AICM_TIMING]), int(kind), int(b), int(x), int(y)))
    insert_many(keys, vals, meta, int(t), np.array([key], np.int64), np.array([ms]))
    return ms


@kernel(cache=True, _nrt=False)
def aic_raw_ms(cfg, w, kind, b, x, y):
    """Raw (unscaled) duration of a timing key on worker w."""
    keys = cfg.aic_key
    vals = cfg.aic_ms
    meta = cfg.aic_meta
    local = cfg.i64[w, CFG_AIC_LOCAL]
    key = pack_key(kind, b, x, y)
    if key != AIC_EMPTY:
        at = _find(keys, vals, meta, cfg.i64[w, CFG_AIC_SHARED], key)
        if at < 0:
            at = _find(keys, vals, meta, local, key)
        if at >= 0:
            return vals[at]
    with objmode(ms="float64"):
        ms = fill_miss(kind, b, x, y, key, keys, vals, meta, local)
    return ms


@njit(cache=True, _nrt=False)
def insert_many(keys, vals, meta, t, new_keys, new_vals):
    """Put ``new_keys -> new_vals`` into table t: the value is written before the key,
    a slot in use is never overwritten, and a table at MAX_LOAD takes no more."""
    off = meta[t, AICM_OFF]
    mask = meta[t, AICM_MASK]
    limit = MAX_LOAD * (mask + 1)
    for i in range(new_keys.shape[0]):
        key = new_keys[i]
        if key == AIC_EMPTY or meta[t, AICM_COUNT] >= limit:
            continue
        h = _home_slot(key, mask)
        while True:
            k = keys[off + h]
            if k == key:
                break
            if k == AIC_EMPTY:
                vals[off + h] = new_vals[i]
                keys[off + h] = key
                meta[t, AICM_COUNT] += 1
                break
            h = (h + 1) & mask
