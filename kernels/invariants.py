"""Consistency checks of the kernel state, for tests and debugging.

Every check is a compiled function over the state arrays that returns 0 (``OK``)
when the invariants hold and otherwise the code of the first violated one (the
constants below; codes are distinct across checks). They never raise or print,
so they can run from other kernels, between passes, and on a state that is
already corrupt: every index is range-checked before use and every list walk is
bounded, so a check reports the bug instead of crashing on it.

* ``check_pool(p, w, capacity)``: worker w's block pool (accounting, free stack,
  LRU, prefix table, duplicate chains).
* ``check_drained(p, w)``: nothing referenced, pinned, private or reserved (the
  state every worker must be in after a completed run).
* ``check_request(p, rq, q, bs)`` / ``check_leases(p, rq, w, q_lo, q_hi, bs)``: lease
  rows against the pool, including exact reference counts.

Indexing follows layout.py (owner-major matrices: ``p.w64[w, PW_*]``,
``p.b32[b, PB_*]``, ``rq.i64[q, RQ_*]``).
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import _mix
from aisim_fast.kernels.schema.layout import (NO_BLOCK, PB_CACHED, PB_DUP, PB_DUP_PREV, PB_DUP_TAIL,
                                              PB_FREE_STACK, PB_NEXT, PB_PIN, PB_PREV, PB_REF, PW_BLK_LEN,
                                              PW_BLK_OFF, PW_BUMP, PW_FREE_TOP, PW_LRU_HEAD, PW_LRU_LEN,
                                              PW_LRU_TAIL, PW_NUM_COPIES, PW_NUM_RESERVED, PW_TAB_MASK,
                                              PW_TAB_OFF, RQ_ALLOCATED, RQ_GENERATED, RQ_LEASE_OFF,
                                              RQ_MAX_OUTPUT, RQ_NUM_COMPUTED, RQ_NUM_HASHED, RQ_PROMPT_LEN,
                                              RQ_STATUS, RQ_WORKER, RS_DONE)

OK = 0

# --- check_pool -----------------------------------------------------------------------
POOL_CONSERVATION = 1      # copies / reserved negative, or copies + reserved > capacity
POOL_ARENA = 2             # free slots + resident copies != arena length, or a bad free stack
POOL_NEGATIVE_COUNT = 3    # a resident copy with refs < 0 or pins < 0
POOL_FREE_SLOT_DIRTY = 4   # a free slot still carries refs, pins or the cached flag
POOL_PRIVATE_REFS = 5      # a private copy not held by exactly one reference
POOL_LRU_LINKS = 6         # LRU list broken: bad head/tail/prev/next, cycle, length mismatch
POOL_LRU_MEMBERSHIP = 7    # LRU member not (cached, refs == 0, pins == 0) or vice versa
POOL_TABLE_ENTRY = 8       # table slot points outside the arena, to a free or private copy
POOL_TABLE_DUPLICATE = 9   # two table slots (or the same slot twice) for one hash
POOL_TABLE_PROBE = 10      # an entry that linear probing from its home slot cannot find
POOL_DUP_CHAIN = 11        # duplicate chain links inconsistent (prev/next/tail, other hash)
POOL_UNREACHABLE = 12      # a cached copy not reachable from the table under its hash

# --- check_drained ----------------------------------------------------------------------
DRAIN_RESERVED = 21        # reservations outstanding
DRAIN_PRIVATE = 22         # a private copy still resident
DRAIN_REFERENCED = 23      # a cached copy still referenced or pinned
DRAIN_LRU = 24             # resident copies != inactive LRU length

# --- check_leases / check_request -----------------------------------------------------------
LEASE_SHAPE = 31           # entries [0, ceil(allocated/bs)) not all set, or a set entry past them
LEASE_BAD_BLOCK = 32       # a lease entry outside the worker's arena or on a free slot
LEASE_REFS = 33            # a copy's refs differ from the number of lease entries holding it
LEASE_HASH = 34            # a cached copy in a lease under a different hash than the entry
LEASE_PROGRESS = 35        # live request computed > allocated, allocated > length, or >row hashes
LEASE_WORKER = 36          # a request holding blocks is not placed on this worker


@kernel(cache=True)
def _home(h, mask):
    # the table's own slot function, so a change of hashing stays in sync
    return np.int64(_mix(h) & np.uint64(mask))


@kernel(cache=True)
def _resident_flags(p, w):
    """(flags, ok): per arena slot of worker w 1 = resident, 0 = on the free stack,
    2 = never used (past PW_BUMP, contents undefined); ok is False when the free
    stack is malformed (out of range, past the used slots, a slot twice)."""
    off = p.w64[w, PW_BLK_OFF]
    n = p.w64[w, PW_BLK_LEN]
    top = p.w64[w, PW_FREE_TOP]
    used = p.w64[w, PW_BUMP]
    flags = np.ones(n, np.int8)
    if used < 0 or used > n or top < 0 or top > used:
        return flags, False
    flags[used:] = 2
    for i in range(top):
        b = np.int64(p.b32[off + i, PB_FREE_STACK])
        if b < off or b >= off + used or flags[b - off] == 0:
            return flags, False  # out of range or listed twice
        flags[b - off] = 0
    return flags, True


@njit(cache=True)
def check_pool(p, w, capacity):
    """0 when worker w's pool is consistent, else the POOL_* code of the first
    violated invariant (checked in the order of the constants)."""
    off = p.w64[w, PW_BLK_OFF]
    n = p.w64[w, PW_BLK_LEN]
    copies = p.w64[w, PW_NUM_COPIES]
    reserved = p.w64[w, PW_NUM_RESERVED]
    # capacity = copies + reserved + free with every term non-negative
    if copies < 0 or reserved < 0 or copies + reserved > capacity:
        return POOL_CONSERVATION
    flags, stack_ok = _resident_flags(p, w)
    if not stack_ok or p.w64[w, PW_FREE_TOP] + copies != p.w64[w, PW_BUMP]:
        return POOL_ARENA
    n_cached = 0
    n_inactive = 0
    for i in range(n):
        b = off + i
        if flags[i] == 2:
            continue
        if flags[i] == 0:
            if p.b32[b, PB_REF] != 0 or p.b32[b, PB_PIN] != 0 or p.b32[b, PB_CACHED] != 0:
                return POOL_FREE_SLOT_DIRTY
            continue
        if p.b32[b, PB_REF] < 0 or p.b32[b, PB_PIN] < 0:
            return POOL_NEGATIVE_COUNT
    for i in range(n):
        b = off + i
        if flags[i] != 1:
            continue
        if p.b32[b, PB_CACHED] == 0:
            # a private copy belongs to the one request that allocated it
            if p.b32[b, PB_REF] != 1 or p.b32[b, PB_PIN] != 0:
                return POOL_PRIVATE_REFS
        else:
            n_cached += 1
            if p.b32[b, PB_REF] == 0 and p.b32[b, PB_PIN] == 0:
                n_inactive += 1

    # LRU: a well-linked list from head to tail of exactly PW_LRU_LEN members
    in_lru = np.zeros(n, np.int8)
    length = p.w64[w, PW_LRU_LEN]
    if length < 0 or length > n:
        return POOL_LRU_LINKS
    prev = np.int64(NO_BLOCK)
    b = p.w64[w, PW_LRU_HEAD]
    count = 0
    while b != NO_BLOCK:
        if b < off or b >= off + n or count >= length or in_lru[b - off] != 0:
            return POOL_LRU_LINKS
        if p.b32[b, PB_PREV] != prev:
            return POOL_LRU_LINKS
        in_lru[b - off] = 1
        count += 1
        prev = b
        b = np.int64(p.b32[b, PB_NEXT])
    if count != length or p.w64[w, PW_LRU_TAIL] != prev:
        return POOL_LRU_LINKS
    for i in range(n):
        b = off + i
        inactive = flags[i] == 1 and p.b32[b, PB_CACHED] != 0 and p.b32[b, PB_REF] == 0 \
            and p.b32[b, PB_PIN] == 0
        if inactive != (in_lru[i] != 0):
            return POOL_LRU_MEMBERSHIP
    if length != n_inactive:
        return POOL_LRU_MEMBERSHIP

    # prefix table: primaries of distinct hashes, each findable by probing
    t0 = p.w64[w, PW_TAB_OFF]
    mask = p.w64[w, PW_TAB_MASK]
    seen = np.zeros(n, np.int8)   # copy reached through the table (primary or chain)
    n_reached = 0
    for t in range(mask + 1):
        b = np.int64(p.tab[t0 + t])
        if b == NO_BLOCK:
            continue
        if b < off or b >= off + n or flags[b - off] != 1 or p.b32[b, PB_CACHED] == 0:
            return POOL_TABLE_ENTRY
        h = p.blk_hash[b]
        # linear probing from the home slot must reach t before any empty slot, and
        # no other slot on the way may hold the same hash
        i = _home(h, mask)
        steps = 0
        while i != t:
            c = np.int64(p.tab[t0 + i])
            if c == NO_BLOCK or steps > mask:
                return POOL_TABLE_PROBE
            if c >= off and c < off + n and p.blk_hash[c] == h:
                return POOL_TABLE_DUPLICATE
            i = (i + 1) & mask
            steps += 1
        # walk the duplicate chain of this primary, oldest first
        if p.b32[b, PB_DUP_PREV] != NO_BLOCK:
            return POOL_DUP_CHAIN
        c = b
        last = b
        while c != NO_BLOCK:
            if c < off or c >= off + n or flags[c - off] != 1 or p.b32[c, PB_CACHED] == 0:
                return POOL_DUP_CHAIN
            if p.blk_hash[c] != h:
                return POOL_DUP_CHAIN
            if seen[c - off] != 0:
                # reached twice: a cycle, or a copy in two chains / the table twice
                return POOL_TABLE_DUPLICATE if c == b else POOL_DUP_CHAIN
            seen[c - off] = 1
            n_reached += 1
            nxt = np.int64(p.b32[c, PB_DUP])
            if nxt != NO_BLOCK:
                if nxt < off or nxt >= off + n or p.b32[nxt, PB_DUP_PREV] != c:
                    return POOL_DUP_CHAIN
            last = c
            c = nxt
        if p.b32[b, PB_DUP_TAIL] != last:
            return POOL_DUP_CHAIN
    if n_reached != n_cached:
        return POOL_UNREACHABLE
    return OK


@njit(cache=True)
def check_drained(p, w):
    """0 when nothing on worker w is referenced, pinned, private or reserved: every
    resident copy is an inactive cached block in the LRU (the state after a run)."""
    off = p.w64[w, PW_BLK_OFF]
    n = p.w64[w, PW_BLK_LEN]
    if p.w64[w, PW_NUM_RESERVED] != 0:
        return DRAIN_RESERVED
    flags, stack_ok = _resident_flags(p, w)
    if not stack_ok:
        return POOL_ARENA
    for i in range(n):
        if flags[i] != 1:
            continue
        b = off + i
        if p.b32[b, PB_CACHED] == 0:
            return DRAIN_PRIVATE
        if p.b32[b, PB_REF] != 0 or p.b32[b, PB_PIN] != 0:
            return DRAIN_REFERENCED
    if p.w64[w, PW_LRU_LEN] != p.w64[w, PW_NUM_COPIES]:
        return DRAIN_LRU
    return OK


@kernel(cache=True)
def _ceil_div(a, b):
    return (a + b - 1) // b


@njit(cache=True)
def check_request(p, rq, q, bs):
    """Lease shape of one request: entries [0, ceil(allocated / bs)) hold resident
    blocks of its worker's arena, later entries of its row are empty, progress
    counters are ordered, and a cached block sits under the entry's own hash."""
    k0 = rq.i64[q, RQ_LEASE_OFF]
    row = _ceil_div(rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_MAX_OUTPUT], bs)
    allocated = rq.i64[q, RQ_ALLOCATED]
    length = rq.i64[q, RQ_PROMPT_LEN] + rq.i64[q, RQ_GENERATED]
    held = _ceil_div(allocated, bs)
    if allocated < 0 or allocated > length or held > row or rq.i64[q, RQ_NUM_HASHED] > row:
        return LEASE_PROGRESS
    # a finished request keeps its computed count after releasing its lease
    if rq.i64[q, RQ_STATUS] != RS_DONE and rq.i64[q, RQ_NUM_COMPUTED] > allocated:
        return LEASE_PROGRESS
    for k in range(row):
        b = np.int64(rq.lease[k0 + k])
        if (b != NO_BLOCK) != (k < held):
            return LEASE_SHAPE
    if held == 0:
        return OK
    w = rq.i64[q, RQ_WORKER]
    if w < 0 or w >= p.w64.shape[0]:
        return LEASE_WORKER
    off = p.w64[w, PW_BLK_OFF]
    n = p.w64[w, PW_BLK_LEN]
    for k in range(held):
        b = np.int64(rq.lease[k0 + k])
        if b < off or b >= off + n:
            return LEASE_BAD_BLOCK
        if p.b32[b, PB_REF] < 1:
            return LEASE_REFS
        if p.b32[b, PB_CACHED] != 0:
            if k >= rq.i64[q, RQ_NUM_HASHED] or p.blk_hash[b] != rq.seq_hash[k0 + k]:
                return LEASE_HASH
    return OK


@njit(cache=True)
def check_leases(p, rq, w, q_lo, q_hi, bs):
    """Every request in [q_lo, q_hi) passes check_request, and on worker w each
    resident copy's refs equal the number of lease entries holding it (exactly one
    for a private copy): no leaked and no double-counted reference."""
    off = p.w64[w, PW_BLK_OFF]
    n = p.w64[w, PW_BLK_LEN]
    holders = np.zeros(n, np.int64)
    for q in range(q_lo, q_hi):
        code = check_request(p, rq, q, bs)
        if code != OK:
            return code
        held = _ceil_div(rq.i64[q, RQ_ALLOCATED], bs)
        if held == 0:
            continue
        k0 = rq.i64[q, RQ_LEASE_OFF]
        for k in range(held):
            b = np.int64(rq.lease[k0 + k])
            if b >= off and b < off + n:
                if rq.i64[q, RQ_WORKER] != w:
                    return LEASE_WORKER
                holders[b - off] += 1
    flags, stack_ok = _resident_flags(p, w)
    if not stack_ok:
        return POOL_ARENA
    for i in range(n):
        b = off + i
        if flags[i] != 1:
            if holders[i] != 0:
                return LEASE_BAD_BLOCK
            continue
        if p.b32[b, PB_REF] != holders[i]:
            return LEASE_REFS
    return OK
