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

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.schema.layout import (EV_A, EV_B, EV_BLOCK, EV_C, EV_KIND, EV_KV_REMOVED,
                                               EV_KV_STORED, EV_REQUEST, EV_TIME_BITS, EV_TOKENS_HASH,
                                               EV_WORKER, EVH_CLOCK_BITS, EVH_KV, EVH_LEN, EVH_OUTPUTS,
                                               KV_FIRST, KV_NEXT, NO_BLOCK, PB_CACHED, PB_DUP, PB_DUP_PREV,
                                               PB_DUP_TAIL, PB_FREE_STACK, PB_NEXT, PB_PIN, PB_PREV,
                                               PB_PUB_PASS, PB_REF, PW_BLK_LEN, PW_BLK_OFF, PW_BUMP,
                                               PW_EVICTED_CAP, PW_EVICTED_LEN, PW_EVICTED_OFF,
                                               PW_EVICTED_PASS, PW_FREE_TOP, PW_LRU_HEAD, PW_LRU_LEN,
                                               PW_LRU_TAIL, PW_NUM_COPIES, PW_NUM_RESERVED, PW_PASS_NUM,
                                               PW_SIM, PW_TAB_MASK, PW_TAB_OFF)

PASS_NUM_MASK = 0x7FFFFFFF  # PB_PUB_PASS / PW_EVICTED_PASS keep the low 31 bits of a pass number
NO_PASS = -1  # PW_PASS_NUM of an attention-DP rank that sits out its group's pass


@kernel(cache=True, _nrt=False)
def _mix(h):
    # The keys are already XXH3 outputs; fold the high bits in so masks of any
    # size see them.
    return h ^ (h >> np.uint64(29))


@njit(cache=True, _nrt=False, inline="always")
def table_find(p, w, h):
    """Primary copy of hash ``h`` on worker ``w``, or NO_BLOCK."""
    off = p.w64[w, PW_TAB_OFF]
    mask = p.w64[w, PW_TAB_MASK]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        b = p.tab[off + i]
        if b == NO_BLOCK:
            return NO_BLOCK
        if p.blk_hash[b] == h:
            return b
        i = (i + 1) & mask


@kernel(cache=True, _nrt=False)
def _table_set(p, w, h, b):
    """Point hash ``h`` at copy ``b`` (insert or replace)."""
    off = p.w64[w, PW_TAB_OFF]
    mask = p.w64[w, PW_TAB_MASK]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        cur = p.tab[off + i]
        if cur == NO_BLOCK or p.blk_hash[cur] == h:
            p.tab[off + i] = b
            return
        i = (i + 1) & mask


@kernel(cache=True, _nrt=False)
def _table_delete(p, w, h):
    """Remove hash ``h``; shift the rest of its probe cluster back (no tombstones)."""
    off = p.w64[w, PW_TAB_OFF]
    mask = p.w64[w, PW_TAB_MASK]
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


@njit(cache=True, _nrt=False, inline="always")
def num_active(p, w):
    """Blocks counted as in use: copies not in the inactive LRU, plus reservations."""
    return p.w64[w, PW_NUM_COPIES] - p.w64[w, PW_LRU_LEN] + p.w64[w, PW_NUM_RESERVED]


@njit(cache=True, _nrt=False, inline="always")
def num_free(p, w, capacity):
    return capacity - p.w64[w, PW_NUM_COPIES] - p.w64[w, PW_NUM_RESERVED]


@kernel(cache=True, _nrt=False, inline="always")
def _lru_unlink(p, w, b):
    prv = p.b32[b, PB_PREV]
    nxt = p.b32[b, PB_NEXT]
    if prv == NO_BLOCK:
        p.w64[w, PW_LRU_HEAD] = nxt
    else:
        p.b32[prv, PB_NEXT] = nxt
    if nxt == NO_BLOCK:
        p.w64[w, PW_LRU_TAIL] = prv
    else:
        p.b32[nxt, PB_PREV] = prv
    p.b32[b, PB_PREV] = NO_BLOCK
    p.b32[b, PB_NEXT] = NO_BLOCK
    p.w64[w, PW_LRU_LEN] -= 1


@kernel(cache=True, _nrt=False, inline="always")
def _lru_push_tail(p, w, b):
    tail = p.w64[w, PW_LRU_TAIL]
    p.b32[b, PB_PREV] = tail
    p.b32[b, PB_NEXT] = NO_BLOCK
    if tail == NO_BLOCK:
        p.w64[w, PW_LRU_HEAD] = b
    else:
        p.b32[tail, PB_NEXT] = b
    p.w64[w, PW_LRU_TAIL] = b
    p.w64[w, PW_LRU_LEN] += 1


@kernel(cache=True, _nrt=False, inline="always")
def _take_slot(p, w):
    """A free arena slot: the last one given back, else the next never-used slot
    (initialized now, so an arena costs nothing until it is used); NO_BLOCK when
    the arena is exhausted."""
    top = p.w64[w, PW_FREE_TOP]
    if top > 0:
        top -= 1
        p.w64[w, PW_FREE_TOP] = top
        return p.b32[p.w64[w, PW_BLK_OFF] + top, PB_FREE_STACK]
    used = p.w64[w, PW_BUMP]
    if used == p.w64[w, PW_BLK_LEN]:
        return NO_BLOCK
    p.w64[w, PW_BUMP] = used + 1
    b = p.w64[w, PW_BLK_OFF] + used
    p.b32[b, PB_REF] = 0
    p.b32[b, PB_PIN] = 0
    p.b32[b, PB_CACHED] = 0
    p.b32[b, PB_PREV] = NO_BLOCK
    p.b32[b, PB_NEXT] = NO_BLOCK
    p.b32[b, PB_DUP] = NO_BLOCK
    p.b32[b, PB_DUP_PREV] = NO_BLOCK
    p.b32[b, PB_DUP_TAIL] = NO_BLOCK
    p.blk_hash[b] = 0
    return np.int32(b)


@kernel(cache=True, _nrt=False, inline="always")
def _give_slot(p, w, b):
    p.b32[b, PB_REF] = 0
    p.b32[b, PB_PIN] = 0
    p.b32[b, PB_CACHED] = 0
    p.b32[b, PB_DUP] = NO_BLOCK
    p.b32[p.w64[w, PW_BLK_OFF] + p.w64[w, PW_FREE_TOP], PB_FREE_STACK] = b
    p.w64[w, PW_FREE_TOP] += 1


@kernel(cache=True, _nrt=False, inline="always")
def event_log_on(p):
    return p.event_log.shape[1] > 1


@kernel(cache=True, _nrt=False, inline="always")
def event_set_clock(p, s, t_ms):
    """The time of simulation s's KV events from now on (logging on)."""
    p.event_log[s, 0, EVH_CLOCK_BITS] = np.float64(t_ms).view(np.int64)


@kernel(cache=True, _nrt=False, inline="always")
def outputs_logged(p, s):
    """Whether simulation s logs every output token (EV_OUTPUT)."""
    return p.event_log.shape[1] > 1 and p.event_log[s, 0, EVH_OUTPUTS] != 0


@kernel(cache=True, _nrt=False, inline="always")
def kv_events_logged(p, w):
    """Whether worker w's simulation logs KV Stored / Removed facts (a log of engine
    facts only, e.g. pressure events, leaves them out)."""
    return p.event_log.shape[1] > 1 and p.event_log[p.w64[w, PW_SIM], 0, EVH_KV] != 0


@kernel(cache=True, _nrt=False)
def note_event_at(p, w, kind, a, b, c, time_bits):
    """Append an engine event of worker w (``EV_*`` of layout, int64 values, the time as
    float64 bits) to its simulation's log, when logging is on. A full log counts the
    event without writing it: the event loop then has the simulation rerun with a
    larger log (SIM_EVENTS_FULL)."""
    if p.event_log.shape[1] > 1:
        log_row(p.event_log, p.w64[w, PW_SIM], w, kind, a, b, c, time_bits)


@kernel(cache=True, _nrt=False)
def log_row(event_log, s, w, kind, a, b, c, time_bits):
    """``note_event_at`` on simulation s's log itself (logging on); returns the row
    written (0: the log is full, the event only counted)."""
    n = event_log[s, 0, EVH_LEN]
    event_log[s, 0, EVH_LEN] = n + 1
    if n + 1 >= event_log.shape[1]:
        return 0
    row = event_log[s, n + 1]
    row[EV_KIND] = kind
    row[EV_WORKER] = w
    row[EV_A] = a
    row[EV_B] = b
    row[EV_C] = c
    row[EV_TIME_BITS] = time_bits
    row[EV_TOKENS_HASH] = 0
    row[EV_REQUEST] = 0
    row[EV_BLOCK] = 0
    return n + 1


@kernel(cache=True, _nrt=False)
def note_event(p, w, kind, a, b, c):
    """``note_event_at`` at the simulation's event clock (the instant being drained)."""
    if p.event_log.shape[1] > 1:
        note_event_at(p, w, kind, a, b, c, p.event_log[p.w64[w, PW_SIM], 0, EVH_CLOCK_BITS])


@kernel(cache=True, _nrt=False)
def note_kv_stored(p, w, block_hash, parent_hash, group, tokens_hash, q, i):
    """A KV_STORED row (layout): block i of request q became visible on worker w;
    ``group`` is KV_FIRST / KV_FIRST_WITH_PARENT / KV_NEXT."""
    s = p.w64[w, PW_SIM]
    n = p.event_log[s, 0, EVH_LEN]
    note_event(p, w, EV_KV_STORED, block_hash, parent_hash, group)
    if n + 1 < p.event_log.shape[1]:
        row = p.event_log[s, n + 1]
        row[EV_TOKENS_HASH] = tokens_hash
        row[EV_REQUEST] = q
        row[EV_BLOCK] = i


@kernel(cache=True, _nrt=False)
def kv_events_visible_at(p, s, first_row, t_ms):
    """The KV rows of simulation s logged since ``first_row`` (a value of its log length)
    become visible at ``t_ms``: the end of the pass that logged them."""
    n = min(p.event_log[s, 0, EVH_LEN], p.event_log.shape[1] - 1)
    bits = np.float64(t_ms).view(np.int64)
    for r in range(first_row + 1, n + 1):
        if p.event_log[s, r, EV_KIND] <= EV_KV_REMOVED:
            p.event_log[s, r, EV_TIME_BITS] = bits


@kernel(cache=True, _nrt=False)
def _note_evicted(p, w, b, h):
    """Primary copy ``b`` of hash ``h`` is evicted by the pass running: if h was in the
    table when that pass started (b published before it; a copy that took b's place
    by then had its eviction noted already), the KV router still sees h until the pass
    ends (it learns the removal with the pass's events)."""
    current = p.w64[w, PW_PASS_NUM] & PASS_NUM_MASK
    if p.b32[b, PB_PUB_PASS] == current:
        return
    if p.w64[w, PW_EVICTED_PASS] != current:
        p.w64[w, PW_EVICTED_PASS] = current
        p.w64[w, PW_EVICTED_LEN] = 0
    n = p.w64[w, PW_EVICTED_LEN]
    p.evicted_hash[p.w64[w, PW_EVICTED_OFF] + n] = h
    p.w64[w, PW_EVICTED_LEN] = n + 1


@kernel(cache=True, _nrt=False)
def evicted_in_flight(p, w, h):
    """Whether the pass of worker ``w`` now running (numbered PW_PASS_NUM) evicted hash
    ``h`` from the table, which held it when the pass started (``_note_evicted``)."""
    if p.w64[w, PW_EVICTED_PASS] != p.w64[w, PW_PASS_NUM] & PASS_NUM_MASK:
        return False
    off = p.w64[w, PW_EVICTED_OFF]
    for i in range(p.w64[w, PW_EVICTED_LEN]):
        if p.evicted_hash[off + i] == h:
            return True
    return False


@njit(cache=True, _nrt=False)
def _evict_head(p, w, group):
    """Evict the LRU head. Returns True if it was the last copy of its hash
    (the reference reports a ``Removed`` event only then; ``group``: the row's
    KV_FIRST / KV_NEXT)."""
    b = p.w64[w, PW_LRU_HEAD]
    _lru_unlink(p, w, b)
    h = p.blk_hash[b]
    primary = table_find(p, w, h)
    last_copy = False
    nxt = p.b32[b, PB_DUP]
    if primary == b:
        if p.w64[w, PW_EVICTED_CAP] > 0:
            _note_evicted(p, w, b, h)
        if nxt == NO_BLOCK:
            _table_delete(p, w, h)
            last_copy = True
        else:
            # the oldest duplicate becomes the primary
            _table_set(p, w, h, nxt)
            p.b32[nxt, PB_DUP_PREV] = NO_BLOCK
            p.b32[nxt, PB_DUP_TAIL] = p.b32[b, PB_DUP_TAIL]
    else:
        prv = p.b32[b, PB_DUP_PREV]
        p.b32[prv, PB_DUP] = nxt
        if nxt == NO_BLOCK:
            p.b32[primary, PB_DUP_TAIL] = prv
        else:
            p.b32[nxt, PB_DUP_PREV] = prv
    p.w64[w, PW_NUM_COPIES] -= 1
    _give_slot(p, w, b)
    if last_copy and kv_events_logged(p, w):
        note_event(p, w, EV_KV_REMOVED, np.int64(h), np.int64(0), group)
    return last_copy


@njit(cache=True, _nrt=False)
def cache_copy(p, w, b, h):
    """Make private copy ``b`` (referenced by its owner) visible under hash ``h``.
    Returns True if the hash became visible (no resident copy before)."""
    p.blk_hash[b] = h
    p.b32[b, PB_CACHED] = 1
    p.b32[b, PB_DUP] = NO_BLOCK
    p.b32[b, PB_PUB_PASS] = np.int32(p.w64[w, PW_PASS_NUM] & PASS_NUM_MASK)
    primary = table_find(p, w, h)
    if primary == NO_BLOCK:
        _table_set(p, w, h, b)
        p.b32[b, PB_DUP_PREV] = NO_BLOCK
        p.b32[b, PB_DUP_TAIL] = b
        return True
    tail = p.b32[primary, PB_DUP_TAIL]
    p.b32[tail, PB_DUP] = b
    p.b32[b, PB_DUP_PREV] = tail
    p.b32[primary, PB_DUP_TAIL] = b
    return False


@njit(cache=True, _nrt=False, inline="always")
def release_ref(p, w, b):
    """Drop one lease reference: a private copy is freed at once, a cached copy
    enters the LRU tail when nothing references or pins it any more."""
    if p.b32[b, PB_CACHED]:
        p.b32[b, PB_REF] -= 1
        if p.b32[b, PB_REF] == 0 and p.b32[b, PB_PIN] == 0:
            _lru_push_tail(p, w, b)
    else:
        p.w64[w, PW_NUM_COPIES] -= 1
        _give_slot(p, w, b)


@njit(cache=True, _nrt=False)
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
            if p.b32[b, PB_REF] == 0 and p.b32[b, PB_PIN] == 0:
                # count distinct copies only: a copy listed twice is pinned once
                dup = False
                for j in range(i):
                    if hits[j] == b:
                        dup = True
                        break
                if not dup:
                    inactive_hits += 1
        if needed_evictions > p.w64[w, PW_LRU_LEN] - inactive_hits:
            return 0
    else:
        needed_evictions = 0
    for i in range(n_hits):
        b = hits[i]
        if p.b32[b, PB_REF] == 0 and p.b32[b, PB_PIN] == 0:
            _lru_unlink(p, w, b)
        p.b32[b, PB_REF] += 1
    group = np.int64(KV_FIRST)  # a reservation's evictions are one Removed event
    for _ in range(needed_evictions):
        if _evict_head(p, w, group):
            group = np.int64(KV_NEXT)
    for i in range(n_fresh):
        b = _take_slot(p, w)
        if b == NO_BLOCK:
            return -1
        p.b32[b, PB_REF] = 1
        p.b32[b, PB_CACHED] = 0
        p.b32[b, PB_DUP] = NO_BLOCK
        p.w64[w, PW_NUM_COPIES] += 1
        out_fresh[i] = b
    return 1


@njit(cache=True, _nrt=False)
def reserve_blocks(p, w, capacity, n):
    """Set ``n`` fresh blocks aside (counted in use until taken with ``take_reserved``
    or given back with ``cancel_reserved``), evicting from the LRU head as needed:
    a speculative verify pass's lookahead. False (nothing changed) when capacity is
    exhausted."""
    needed_evictions = n - num_free(p, w, capacity)
    if needed_evictions > 0:
        if needed_evictions > p.w64[w, PW_LRU_LEN]:
            return False
        group = np.int64(KV_FIRST)  # a reservation's evictions are one Removed event
        for _ in range(needed_evictions):
            if _evict_head(p, w, group):
                group = np.int64(KV_NEXT)
    p.w64[w, PW_NUM_RESERVED] += n
    return True


@njit(cache=True, _nrt=False)
def take_reserved(p, w, reserved):
    """One block of the reservation (``reserved``; else of the free capacity, which
    the caller knows holds it) as a new private copy (one reference); NO_BLOCK when
    the arena has no slot left (a sizing error)."""
    b = _take_slot(p, w)
    if b == NO_BLOCK:
        return NO_BLOCK
    p.b32[b, PB_REF] = 1
    p.b32[b, PB_CACHED] = 0
    p.b32[b, PB_DUP] = NO_BLOCK
    p.w64[w, PW_NUM_COPIES] += 1
    if reserved:
        p.w64[w, PW_NUM_RESERVED] -= 1
    return b


@njit(cache=True, _nrt=False, inline="always")
def cancel_reserved(p, w, n):
    """Give ``n`` reserved blocks that were not taken back to the free capacity."""
    p.w64[w, PW_NUM_RESERVED] -= n


@njit(cache=True, _nrt=False)
def pool_reset(p, w):
    """Empty worker ``w``'s pool: no arena slot used yet, empty table and LRU."""
    p.w64[w, PW_FREE_TOP] = 0
    p.w64[w, PW_BUMP] = 0
    p.w64[w, PW_NUM_COPIES] = 0
    p.w64[w, PW_NUM_RESERVED] = 0
    p.w64[w, PW_LRU_HEAD] = NO_BLOCK
    p.w64[w, PW_LRU_TAIL] = NO_BLOCK
    p.w64[w, PW_LRU_LEN] = 0
    t0 = p.w64[w, PW_TAB_OFF]
    for i in range(p.w64[w, PW_TAB_MASK] + 1):
        p.tab[t0 + i] = NO_BLOCK
