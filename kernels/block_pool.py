"""Paged G1 block pool of one worker (vLLM / TRT-LLM), mirroring the reference's
``cache/vllm_block_pool.rs`` accounting.

Capacity ``C = num_gpu_blocks`` is split as ``copies + reserved + free``. A copy is
private (owned by one request, invisible to lookups) or cached (visible under its
sequence hash, with references and pins). A cached copy with no references and
no pins sits in the inactive LRU; eviction takes the LRU head, lazily, only when
a reservation needs more than the free capacity. Several copies of one hash may
exist: the prefix table maps a hash to its primary copy and ``blk_dup`` chains the
others oldest first, so the oldest duplicate is promoted when the primary goes.

Physical copies live in a per-worker arena of slots (``blk_len`` may be smaller
than ``C``: capacity is an accounting number, slots are only what is resident);
running out of arena slots is reported to the caller, never silently ignored.

The prefix table is open addressing with linear probing over ``int32`` slots that
hold a block index; the key is read from ``blk_hash`` (no separate key array) and
deletion shifts the following cluster back, so no tombstones accumulate.
"""

import numpy as np
from numba import njit

from .layout import NO_BLOCK


@njit(cache=True, inline="always")
def _mix(h):
    # The keys are already XXH3 outputs; fold the high bits in so masks of any
    # size see them.
    return h ^ (h >> np.uint64(29))


@njit(cache=True)
def table_find(p, w, h):
    """Primary copy of hash ``h`` on worker ``w``, or NO_BLOCK."""
    off = p.tab_off[w]
    mask = p.tab_mask[w]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        b = p.tab[off + i]
        if b == NO_BLOCK:
            return NO_BLOCK
        if p.blk_hash[b] == h:
            return b
        i = (i + 1) & mask


@njit(cache=True)
def _table_set(p, w, h, b):
    """Point hash ``h`` at copy ``b`` (insert or replace)."""
    off = p.tab_off[w]
    mask = p.tab_mask[w]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        cur = p.tab[off + i]
        if cur == NO_BLOCK or p.blk_hash[cur] == h:
            p.tab[off + i] = b
            return
        i = (i + 1) & mask


@njit(cache=True)
def _table_delete(p, w, h):
    """Remove hash ``h``; shift the rest of its probe cluster back (no tombstones)."""
    off = p.tab_off[w]
    mask = p.tab_mask[w]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        cur = p.tab[off + i]
        if cur == NO_BLOCK:
            return
        if p.blk_hash[cur] == h:
            break
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        cur = p.tab[off + j]
        if cur == NO_BLOCK:
            break
        home = np.int64(_mix(p.blk_hash[cur]) & np.uint64(mask))
        # Move cur into the hole at i unless its home lies cyclically in (i, j].
        if i <= j:
            stays = i < home <= j
        else:
            stays = home > i or home <= j
        if not stays:
            p.tab[off + i] = cur
            i = j
    p.tab[off + i] = NO_BLOCK


@njit(cache=True)
def num_active(p, w):
    """Blocks counted as in use: copies not in the inactive LRU, plus reservations."""
    return p.num_copies[w] - p.lru_len[w] + p.num_reserved[w]


@njit(cache=True)
def num_free(p, w, capacity):
    return capacity - p.num_copies[w] - p.num_reserved[w]


@njit(cache=True)
def _lru_unlink(p, w, b):
    prv = p.blk_prev[b]
    nxt = p.blk_next[b]
    if prv == NO_BLOCK:
        p.lru_head[w] = nxt
    else:
        p.blk_next[prv] = nxt
    if nxt == NO_BLOCK:
        p.lru_tail[w] = prv
    else:
        p.blk_prev[nxt] = prv
    p.blk_prev[b] = NO_BLOCK
    p.blk_next[b] = NO_BLOCK
    p.lru_len[w] -= 1


@njit(cache=True)
def _lru_push_tail(p, w, b):
    tail = p.lru_tail[w]
    p.blk_prev[b] = tail
    p.blk_next[b] = NO_BLOCK
    if tail == NO_BLOCK:
        p.lru_head[w] = b
    else:
        p.blk_next[tail] = b
    p.lru_tail[w] = b
    p.lru_len[w] += 1


@njit(cache=True)
def _take_slot(p, w):
    """A free arena slot, or NO_BLOCK when the arena is exhausted."""
    top = p.free_top[w]
    if top == 0:
        return NO_BLOCK
    top -= 1
    p.free_top[w] = top
    return p.free_stack[p.blk_off[w] + top]


@njit(cache=True)
def _give_slot(p, w, b):
    p.blk_ref[b] = 0
    p.blk_pin[b] = 0
    p.blk_cached[b] = False
    p.blk_dup[b] = NO_BLOCK
    p.free_stack[p.blk_off[w] + p.free_top[w]] = b
    p.free_top[w] += 1


@njit(cache=True)
def _evict_head(p, w):
    """Evict the LRU head. Returns True if it was the last copy of its hash
    (the reference reports a ``Removed`` event only then)."""
    b = p.lru_head[w]
    _lru_unlink(p, w, b)
    h = p.blk_hash[b]
    primary = table_find(p, w, h)
    last_copy = False
    if primary == b:
        nxt = p.blk_dup[b]
        if nxt == NO_BLOCK:
            _table_delete(p, w, h)
            last_copy = True
        else:
            _table_set(p, w, h, nxt)
    else:
        cur = primary
        while p.blk_dup[cur] != b:
            cur = p.blk_dup[cur]
        p.blk_dup[cur] = p.blk_dup[b]
    p.num_copies[w] -= 1
    _give_slot(p, w, b)
    return last_copy


@njit(cache=True)
def cache_copy(p, w, b, h):
    """Make private copy ``b`` (referenced by its owner) visible under hash ``h``.
    Returns True if the hash became visible (no resident copy before)."""
    p.blk_hash[b] = h
    p.blk_cached[b] = True
    primary = table_find(p, w, h)
    if primary == NO_BLOCK:
        _table_set(p, w, h, b)
        return True
    cur = primary
    while p.blk_dup[cur] != NO_BLOCK:
        cur = p.blk_dup[cur]
    p.blk_dup[cur] = b
    return False


@njit(cache=True)
def release_ref(p, w, b):
    """Drop one lease reference: a private copy is freed at once, a cached copy
    enters the LRU tail when nothing references or pins it any more."""
    if p.blk_cached[b]:
        p.blk_ref[b] -= 1
        if p.blk_ref[b] == 0 and p.blk_pin[b] == 0:
            _lru_push_tail(p, w, b)
    else:
        p.num_copies[w] -= 1
        _give_slot(p, w, b)


@njit(cache=True)
def reserve(p, w, capacity, hits, n_hits, n_fresh, out_fresh):
    """Atomically pin ``hits[:n_hits]`` (resident cached copies) and take ``n_fresh``
    new private copies into ``out_fresh`` (each with one reference), evicting from
    the LRU head as needed. Returns 1 on success, 0 when capacity is exhausted
    (nothing changed) and -1 when the arena has no slot left (a sizing error).

    Feasibility is the reference's: ``fresh - free <= |LRU| - distinct inactive hits``.
    Hits are referenced directly (pins -> refs happens inside the same call in the
    reference's allocation path)."""
    free = num_free(p, w, capacity)
    needed_evictions = n_fresh - free
    if needed_evictions > 0:
        inactive_hits = 0
        for i in range(n_hits):
            b = hits[i]
            if p.blk_ref[b] == 0 and p.blk_pin[b] == 0:
                # count distinct copies only: a copy listed twice is pinned once
                dup = False
                for j in range(i):
                    if hits[j] == b:
                        dup = True
                        break
                if not dup:
                    inactive_hits += 1
        if needed_evictions > p.lru_len[w] - inactive_hits:
            return 0
    else:
        needed_evictions = 0
    for i in range(n_hits):
        b = hits[i]
        if p.blk_ref[b] == 0 and p.blk_pin[b] == 0:
            _lru_unlink(p, w, b)
        p.blk_ref[b] += 1
    for _ in range(needed_evictions):
        _evict_head(p, w)
    for i in range(n_fresh):
        b = _take_slot(p, w)
        if b == NO_BLOCK:
            return -1
        p.blk_ref[b] = 1
        p.blk_cached[b] = False
        p.blk_dup[b] = NO_BLOCK
        p.num_copies[w] += 1
        out_fresh[i] = b
    return 1


@njit(cache=True)
def pool_reset(p, w):
    """Empty worker ``w``'s pool: all arena slots free, empty table and LRU."""
    off = p.blk_off[w]
    n = p.blk_len[w]
    for i in range(n):
        b = off + i
        p.free_stack[off + i] = n - 1 - i + off
        p.blk_ref[b] = 0
        p.blk_pin[b] = 0
        p.blk_cached[b] = False
        p.blk_prev[b] = NO_BLOCK
        p.blk_next[b] = NO_BLOCK
        p.blk_dup[b] = NO_BLOCK
        p.blk_hash[b] = 0
    p.free_top[w] = n
    p.num_copies[w] = 0
    p.num_reserved[w] = 0
    p.lru_head[w] = NO_BLOCK
    p.lru_tail[w] = NO_BLOCK
    p.lru_len[w] = 0
    t0 = p.tab_off[w]
    for i in range(p.tab_mask[w] + 1):
        p.tab[t0 + i] = NO_BLOCK
