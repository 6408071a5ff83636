"""SGLang's radix (prefix-tree) KV cache over token pages, as the reference models it
(spec/sglang.md §3, verified rule by rule against the released reference).

One tree per worker, over pages of ``page_size`` tokens (SGLang's page size, default
1): each node holds an edge of page keys and the physical pages that store them, a
lock count (requests whose matched path runs through it) and a last-access time
from a logical clock. Eviction takes the unlocked leaf with the oldest access time
and cuts its newest pages first.

Layout (``schema.layout.Radix``, sliced per worker by ``RW_*_OFF``):

* pages: ``pg32[b, RP_*]`` and ``pg_key[b]``. A node's edge is a doubly linked
  chain of its pages, oldest position first, so a split, an append or a tail
  eviction relinks pages and moves no keys. The page pool of a worker is
  ``RW_PAGE_LEN`` slots (``num_gpu_blocks`` pages); free slots are a stack.
* runs: the pages of an edge fall into runs of equal keys (a prompt's trace block
  is one key over its tokens with one-token pages), each page knowing its run's
  last page and how many pages are left to it (``RP_RUN_LAST``, ``RP_RUN_LEFT``).
  Matching compares a run's key once and steps over the run, so a prefix hit costs
  a walk over runs, not a pointer chase per token. Runs are formed when pages are
  appended, cut where a split or a tail eviction cuts the edge, and need not be
  maximal (two adjacent runs may share a key: only a longer walk).
* nodes: ``nd[n, RN_*]``; slot ``RW_NODE_OFF`` is the root (no edge, never
  locked, never evicted). Children are found through one open-addressing table per
  worker keyed by (parent, first key of the child's edge); the key of an entry is
  read back from the child node itself, so the table stores node numbers only.
* evictable leaves: a binary min-heap of (time, node) entries, updated lazily: an
  entry is pushed whenever a node becomes an evictable leaf or its time changes
  while it is one, and checked when it reaches the top (a node is an evictable
  leaf when it is not the root, has no children and no lock; its entry is current
  when the times agree - times are unique clock reads).

Counters follow the reference: ``RW_EVICTABLE`` tokens in unlocked nodes,
``RW_PROTECTED`` in locked ones, ``available = free pages x page_size``.

KV events (opt-in, ``kv_logged``): the tree's pages are the reference's KV blocks. A
page that enters the tree gets its sequence hash (``pg_hash``: the tokens-only hash
of the page chained to its parent page's, as vLLM's blocks) and the pages one insert
adds form one Stored event (``log_inserted``); evicted pages are Removed rows, each
leaf's in position order (oldest first). The reference buffers these facts and
reports them at some passes only (``sglang.core.run_pass`` says which): ``report_kv``
then logs a report row that gives the worker's rows since its last report its time.
Within one report a worker's consecutive Removed rows form one event, and an insert
chained to the previous Stored event's last block extends that event unless either
belongs to a session turn (a trace row with a ``session_id``).

Every function takes the bundle and the worker; keys and pages of a request come
in as slices of caller arrays (``keys[k0 : k0 + n]``, ``pages[p0 : p0 + n]``).
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.hashing.xxh3 import hash_chain, xxh3_64_u32_seed1337
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import log_row
from aisim_fast.kernels.schema.layout import (EV_BLOCK, EV_KV_REMOVED, EV_KV_REPORTED, EV_KV_STORED,
                                              EV_REQUEST, EVH_CLOCK_BITS, EVH_KV, KV_FIRST,
                                              KV_FIRST_WITH_PARENT, KV_NEXT, KV_RUN_NONE, KV_RUN_REMOVED,
                                              KV_RUN_STORED, RADIX_N, RADIX_W, RN_CHILDREN, RN_FIELDS,
                                              RN_FREE_STACK, RN_HEAD, RN_LEN, RN_LOCK, RN_PARENT, RN_TAIL,
                                              RN_TIME, RP_FIELDS, RP_FREE_STACK, RP_IN_TREE, RP_NEXT, RP_PREV,
                                              RP_RUN_LAST, RP_RUN_LEFT, RW_CLOCK, RW_EVICTABLE, RW_HEAP_CAP,
                                              RW_HEAP_LEN, RW_HEAP_OFF, RW_INSERT_SHARED, RW_KV_RUN,
                                              RW_KV_TAIL_HASH, RW_KV_UNREPORTED, RW_NODE_BUMP,
                                              RW_NODE_FREE_TOP, RW_NODE_LEN, RW_NODE_OFF, RW_PAGE_BUMP,
                                              RW_PAGE_CAP, RW_PAGE_FREE_TOP, RW_PAGE_LEN, RW_PAGE_OFF,
                                              RW_PAGE_SIZE, RW_PAGES_USED, RW_PROTECTED, RW_SIM, RW_TAB_MASK,
                                              RW_TAB_OFF, Radix)

NO_NODE = -1
NO_PAGE = np.int32(-1)


# ---------------------------------------------------------------------------------
# clock, pages, nodes
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def clock(r, w):
    """A new access time, larger than every earlier one."""
    r.w64[w, RW_CLOCK] += 1
    return r.w64[w, RW_CLOCK]


@njit(cache=True, _nrt=False, inline="always")
def free_pages(r, w):
    return r.w64[w, RW_PAGE_CAP] - r.w64[w, RW_PAGES_USED]


@njit(cache=True, _nrt=False, inline="always")
def available_tokens(r, w):
    """Tokens of the free pages (the reference's ``available``)."""
    return free_pages(r, w) * r.w64[w, RW_PAGE_SIZE]


@njit(cache=True, _nrt=False)
def page_alloc(r, w):
    """A free page (not in the tree, unlinked), or NO_PAGE when the worker's page
    slots are exhausted (callers check the pool's free pages first)."""
    top = r.w64[w, RW_PAGE_FREE_TOP]
    if top > 0:
        top -= 1
        r.w64[w, RW_PAGE_FREE_TOP] = top
        b = r.pg32[r.w64[w, RW_PAGE_OFF] + top, RP_FREE_STACK]
    else:
        used = r.w64[w, RW_PAGE_BUMP]
        if used == r.w64[w, RW_PAGE_LEN]:
            return NO_PAGE
        r.w64[w, RW_PAGE_BUMP] = used + 1
        b = np.int32(r.w64[w, RW_PAGE_OFF] + used)
    r.pg32[b, RP_NEXT] = NO_PAGE
    r.pg32[b, RP_PREV] = NO_PAGE
    r.pg32[b, RP_IN_TREE] = 0
    r.w64[w, RW_PAGES_USED] += 1
    return b


@njit(cache=True, _nrt=False)
def page_free(r, w, b):
    r.pg32[b, RP_IN_TREE] = 0
    r.pg32[b, RP_NEXT] = NO_PAGE
    r.pg32[b, RP_PREV] = NO_PAGE
    r.pg32[r.w64[w, RW_PAGE_OFF] + r.w64[w, RW_PAGE_FREE_TOP], RP_FREE_STACK] = b
    r.w64[w, RW_PAGE_FREE_TOP] += 1
    r.w64[w, RW_PAGES_USED] -= 1


@kernel(cache=True, _nrt=False)
def _node_new(r, w):
    """A fresh node slot, or NO_NODE when the worker's node slots are exhausted."""
    top = r.w64[w, RW_NODE_FREE_TOP]
    if top > 0:
        top -= 1
        r.w64[w, RW_NODE_FREE_TOP] = top
        n = r.nd[r.w64[w, RW_NODE_OFF] + top, RN_FREE_STACK]
    else:
        used = r.w64[w, RW_NODE_BUMP]
        if used == r.w64[w, RW_NODE_LEN]:
            return NO_NODE
        r.w64[w, RW_NODE_BUMP] = used + 1
        n = r.w64[w, RW_NODE_OFF] + used
    r.nd[n, RN_PARENT] = NO_NODE
    r.nd[n, RN_HEAD] = NO_PAGE
    r.nd[n, RN_TAIL] = NO_PAGE
    r.nd[n, RN_LEN] = 0
    r.nd[n, RN_LOCK] = 0
    r.nd[n, RN_TIME] = 0
    r.nd[n, RN_CHILDREN] = 0
    return n


@kernel(cache=True, _nrt=False)
def _node_free(r, w, n):
    r.nd[n, RN_LEN] = 0
    r.nd[n, RN_TIME] = -1  # its heap entries are stale from now on
    r.nd[n, RN_PARENT] = NO_NODE
    r.nd[r.w64[w, RW_NODE_OFF] + r.w64[w, RW_NODE_FREE_TOP], RN_FREE_STACK] = n
    r.w64[w, RW_NODE_FREE_TOP] += 1


@njit(cache=True, _nrt=False, inline="always")
def root(r, w):
    return r.w64[w, RW_NODE_OFF]


@kernel(cache=True, _nrt=False, inline="always")
def _first_key(r, n):
    return r.pg_key[r.nd[n, RN_HEAD]]


@kernel(cache=True, _nrt=False, inline="always")
def is_evictable_leaf(r, w, n):
    return n != r.w64[w, RW_NODE_OFF] and r.nd[n, RN_LEN] > 0 and r.nd[n, RN_CHILDREN] == 0 \
        and r.nd[n, RN_LOCK] == 0


# ---------------------------------------------------------------------------------
# the child table: (parent, first key of the child's edge) -> child
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _home(r, w, parent, key):
    h = key * np.uint64(0x9E3779B97F4A7C15) + np.uint64(parent) * np.uint64(0xC2B2AE3D27D4EB4F)
    h ^= h >> np.uint64(31)
    return np.int64(h & np.uint64(r.w64[w, RW_TAB_MASK]))


@kernel(cache=True, _nrt=False)
def child_find(r, w, parent, key):
    """The child of ``parent`` whose edge starts with ``key``, or NO_NODE."""
    off = r.w64[w, RW_TAB_OFF]
    mask = r.w64[w, RW_TAB_MASK]
    i = _home(r, w, parent, key)
    while True:
        c = r.tab[off + i]
        if c < 0:
            return NO_NODE
        if r.nd[c, RN_PARENT] == parent and _first_key(r, c) == key:
            return np.int64(c)
        i = (i + 1) & mask


@kernel(cache=True, _nrt=False)
def _child_put(r, w, parent, key, child):
    """Point (parent, key) at ``child``: replaces the entry of that key if present
    (a split's upper node taking its lower node's place), else inserts."""
    off = r.w64[w, RW_TAB_OFF]
    mask = r.w64[w, RW_TAB_MASK]
    i = _home(r, w, parent, key)
    while True:
        c = r.tab[off + i]
        if c < 0 or (r.nd[c, RN_PARENT] == parent and _first_key(r, c) == key):
            r.tab[off + i] = child
            return
        i = (i + 1) & mask


@kernel(cache=True, _nrt=False)
def _child_delete(r, w, parent, key):
    """Remove (parent, key); the rest of its probe cluster shifts back (no tombstones)."""
    off = r.w64[w, RW_TAB_OFF]
    mask = r.w64[w, RW_TAB_MASK]
    i = _home(r, w, parent, key)
    while True:
        c = r.tab[off + i]
        if c < 0:
            return
        if r.nd[c, RN_PARENT] == parent and _first_key(r, c) == key:
            break
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        c = r.tab[off + j]
        if c < 0:
            break
        home = _home(r, w, r.nd[c, RN_PARENT], _first_key(r, c))
        if i <= j:
            stays = i < home <= j
        else:
            stays = home > i or home <= j
        if not stays:
            r.tab[off + i] = c
            i = j
    r.tab[off + i] = -1


# ---------------------------------------------------------------------------------
# the evictable-leaf heap (lazy)
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _entry_current(r, w, t, n):
    return is_evictable_leaf(r, w, n) and r.nd[n, RN_TIME] == t


@kernel(cache=True, _nrt=False, inline="always")
def _before(r, i, j):
    ti, tj = r.heap_time[i], r.heap_time[j]
    return ti < tj or (ti == tj and r.heap_node[i] < r.heap_node[j])


@kernel(cache=True, _nrt=False)
def _sift_up(r, off, i):
    while i > 0:
        parent = (i - 1) // 2
        if _before(r, off + i, off + parent):
            r.heap_time[off + i], r.heap_time[off + parent] = r.heap_time[off + parent], r.heap_time[off + i]
            r.heap_node[off + i], r.heap_node[off + parent] = r.heap_node[off + parent], r.heap_node[off + i]
            i = parent
        else:
            return


@kernel(cache=True, _nrt=False)
def _sift_down(r, off, n, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _before(r, off + c + 1, off + c):
            c += 1
        if _before(r, off + c, off + i):
            r.heap_time[off + i], r.heap_time[off + c] = r.heap_time[off + c], r.heap_time[off + i]
            r.heap_node[off + i], r.heap_node[off + c] = r.heap_node[off + c], r.heap_node[off + i]
            i = c
        else:
            return


@kernel(cache=True, _nrt=False)
def _heap_compact(r, w):
    """Drop stale entries and rebuild the heap (when it is full)."""
    off = r.w64[w, RW_HEAP_OFF]
    n = r.w64[w, RW_HEAP_LEN]
    keep = 0
    for i in range(n):
        t, node = r.heap_time[off + i], r.heap_node[off + i]
        if _entry_current(r, w, t, node):
            r.heap_time[off + keep] = t
            r.heap_node[off + keep] = node
            keep += 1
    r.w64[w, RW_HEAP_LEN] = keep
    for i in range(keep // 2 - 1, -1, -1):
        _sift_down(r, off, keep, i)


@kernel(cache=True, _nrt=False)
def _note_leaf(r, w, n):
    """Push n's current (time, node) if n is an evictable leaf. Returns False when
    the heap has no room even after dropping stale entries (sizing bug)."""
    if not is_evictable_leaf(r, w, n):
        return True
    if r.w64[w, RW_HEAP_LEN] == r.w64[w, RW_HEAP_CAP]:
        _heap_compact(r, w)
        if r.w64[w, RW_HEAP_LEN] == r.w64[w, RW_HEAP_CAP]:
            return False
    off = r.w64[w, RW_HEAP_OFF]
    i = r.w64[w, RW_HEAP_LEN]
    r.w64[w, RW_HEAP_LEN] = i + 1
    r.heap_time[off + i] = r.nd[n, RN_TIME]
    r.heap_node[off + i] = n
    _sift_up(r, off, i)
    return True


@kernel(cache=True, _nrt=False)
def _oldest_leaf(r, w):
    """The evictable leaf with the oldest access time (stale entries dropped on the
    way), left in the heap; NO_NODE when there is none."""
    off = r.w64[w, RW_HEAP_OFF]
    while r.w64[w, RW_HEAP_LEN] > 0:
        t, n = r.heap_time[off], r.heap_node[off]
        if _entry_current(r, w, t, n):
            return n
        last = r.w64[w, RW_HEAP_LEN] - 1
        r.heap_time[off] = r.heap_time[off + last]
        r.heap_node[off] = r.heap_node[off + last]
        r.w64[w, RW_HEAP_LEN] = last
        _sift_down(r, off, last, 0)
    return NO_NODE


@kernel(cache=True, _nrt=False, inline="always")
def _touch(r, w, n, now):
    r.nd[n, RN_TIME] = now
    return _note_leaf(r, w, n)


# ---------------------------------------------------------------------------------
# locks
# ---------------------------------------------------------------------------------
@njit(cache=True, _nrt=False)
def inc_lock(r, w, n):
    """Lock n's whole path to the root (nodes going 0 -> 1 become protected)."""
    ps = r.w64[w, RW_PAGE_SIZE]
    top = r.w64[w, RW_NODE_OFF]
    while n != top and n != NO_NODE:
        if r.nd[n, RN_LOCK] == 0:
            tokens = r.nd[n, RN_LEN] * ps
            r.w64[w, RW_EVICTABLE] -= tokens
            r.w64[w, RW_PROTECTED] += tokens
        r.nd[n, RN_LOCK] += 1
        n = r.nd[n, RN_PARENT]


@njit(cache=True, _nrt=False)
def dec_lock(r, w, n):
    """Release one lock on n's path; a node reaching 0 is evictable again (and an
    evictable leaf if it has no children, keeping its time). Returns False on a heap
    sizing failure."""
    ps = r.w64[w, RW_PAGE_SIZE]
    top = r.w64[w, RW_NODE_OFF]
    ok = True
    while n != top and n != NO_NODE:
        r.nd[n, RN_LOCK] -= 1
        if r.nd[n, RN_LOCK] == 0:
            tokens = r.nd[n, RN_LEN] * ps
            r.w64[w, RW_PROTECTED] -= tokens
            r.w64[w, RW_EVICTABLE] += tokens
            ok = _note_leaf(r, w, n) and ok
        n = r.nd[n, RN_PARENT]
    return ok


# ---------------------------------------------------------------------------------
# split, match, insert
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _page_at(r, b, steps):
    """The page ``steps`` pages after b in its edge (which has them), run by run."""
    while steps > 0:
        ahead = r.pg32[b, RP_RUN_LEFT] - 1  # pages after b in its run
        if ahead >= steps:
            if ahead == steps:
                return r.pg32[b, RP_RUN_LAST]
            for _ in range(steps):
                b = r.pg32[b, RP_NEXT]
            return b
        steps -= ahead + 1
        b = r.pg32[r.pg32[b, RP_RUN_LAST], RP_NEXT]
    return b


@kernel(cache=True, _nrt=False)
def _end_run_at(r, b):
    """The edge now ends at page b (a split or a tail eviction cut what followed): the
    pages of b's run up to b get b as their run's last page."""
    if r.pg32[b, RP_RUN_LEFT] == 1:
        return  # b ends its run already
    last = r.pg32[b, RP_RUN_LAST]
    end = b
    left = np.int32(1)
    while b != NO_PAGE and r.pg32[b, RP_RUN_LAST] == last:
        r.pg32[b, RP_RUN_LAST] = end
        r.pg32[b, RP_RUN_LEFT] = left
        left += 1
        b = r.pg32[b, RP_PREV]


@kernel(cache=True, _nrt=False)
def _split(r, w, x, k):
    """Split node x after its first k pages (0 < k < len): a new upper node U takes
    those pages, x's parent, lock and old time; x keeps the suffix, becomes U's only
    child and gets a fresh access time (sglang.md §3.2). Returns U (NO_NODE when no
    node slot is left)."""
    u = _node_new(r, w)
    if u == NO_NODE:
        return NO_NODE
    parent = r.nd[x, RN_PARENT]
    head = r.nd[x, RN_HEAD]
    cut = _page_at(r, head, k - 1)
    lower = r.pg32[cut, RP_NEXT]
    _end_run_at(r, cut)  # the upper edge ends at cut, and so does its last run
    r.nd[u, RN_PARENT] = parent
    r.nd[u, RN_HEAD] = head
    r.nd[u, RN_TAIL] = cut
    r.nd[u, RN_LEN] = k
    r.nd[u, RN_LOCK] = r.nd[x, RN_LOCK]
    r.nd[u, RN_TIME] = r.nd[x, RN_TIME]
    r.nd[u, RN_CHILDREN] = 1
    # U takes x's entry under (parent, first key), which U's edge still starts with
    _child_put(r, w, parent, r.pg_key[head], u)
    r.pg32[cut, RP_NEXT] = NO_PAGE
    r.pg32[lower, RP_PREV] = NO_PAGE
    r.nd[x, RN_HEAD] = lower
    r.nd[x, RN_LEN] -= k
    r.nd[x, RN_PARENT] = u
    _child_put(r, w, u, r.pg_key[lower], x)
    r.nd[x, RN_TIME] = clock(r, w)
    _note_leaf(r, w, x)
    return u


@kernel(cache=True, _nrt=False)
def _common(r, n, keys, k0, n_keys):
    """Pages of n's edge that equal keys[k0:], at most n_keys."""
    b = r.nd[n, RN_HEAD]
    m = 0
    limit = min(r.nd[n, RN_LEN], n_keys)
    while m < limit:
        key = r.pg_key[b]
        if key != keys[k0 + m]:
            break
        # b's run holds ``run`` more pages of this key: compare the keys alone (a
        # sequential scan) instead of following the pages one by one
        run = min(np.int64(r.pg32[b, RP_RUN_LEFT]), limit - m)
        j = 1
        while j < run and keys[k0 + m + j] == key:
            j += 1
        m += j
        if j < r.pg32[b, RP_RUN_LEFT]:
            break  # the keys left the run (a mismatch next) or a limit was reached
        b = r.pg32[r.pg32[b, RP_RUN_LAST], RP_NEXT]
    return m


@njit(cache=True, _nrt=False)
def match_readonly(r, w, keys, k0, n_keys):
    """Pages of keys[k0 : k0 + n_keys] found in the tree from the root; no change."""
    node = r.w64[w, RW_NODE_OFF]
    i = 0
    while i < n_keys:
        c = child_find(r, w, node, keys[k0 + i])
        if c == NO_NODE:
            break
        m = _common(r, c, keys, k0 + i, n_keys - i)
        i += m
        if m < r.nd[c, RN_LEN]:
            break
        node = c
    return i


@njit(cache=True, _nrt=False)
def match_lock(r, w, keys, k0, n_keys):
    """The locking match (sglang.md §3.1): one clock read; every fully matched edge
    gets that time; a partial match splits its node, the upper part ending the
    match; the terminal node's path is locked. Returns (pages matched, terminal
    node); the terminal node is the root when nothing matched, NO_NODE when a split
    found no node slot."""
    now = clock(r, w)
    node = r.w64[w, RW_NODE_OFF]
    i = 0
    while i < n_keys:
        c = child_find(r, w, node, keys[k0 + i])
        if c == NO_NODE:
            break
        m = _common(r, c, keys, k0 + i, n_keys - i)
        i += m
        if m < r.nd[c, RN_LEN]:
            node = _split(r, w, c, m)
            if node == NO_NODE:
                return i, NO_NODE
            break
        _touch(r, w, c, now)
        node = c
    inc_lock(r, w, node)
    return i, node


@kernel(cache=True, _nrt=False)
def match_lock_known(r, w, keys, k0, n_keys):
    """``match_lock`` of keys[k0 : k0 + n_keys] that a read-only match just found in
    full (nothing changed the tree since): the same times, split and locks, reached
    node by node without comparing the pages again."""
    now = clock(r, w)
    node = r.w64[w, RW_NODE_OFF]
    i = 0
    while i < n_keys:
        c = child_find(r, w, node, keys[k0 + i])
        length = r.nd[c, RN_LEN]
        if i + length > n_keys:
            node = _split(r, w, c, n_keys - i)
            if node == NO_NODE:
                return n_keys, NO_NODE
            break
        i += length
        _touch(r, w, c, now)
        node = c
    inc_lock(r, w, node)
    return n_keys, node


@kernel(cache=True, _nrt=False)
def _link_new_pages(r, w, n, pages, p0, count, keys, k0):
    """Append pages[p0 : p0 + count] (keys keys[k0 :]) to the tail of n's edge."""
    tail = r.nd[n, RN_TAIL]
    for j in range(count):
        b = pages[p0 + j]
        r.pg_key[b] = keys[k0 + j]
        r.pg32[b, RP_IN_TREE] = 1
        r.pg32[b, RP_PREV] = tail
        r.pg32[b, RP_NEXT] = NO_PAGE
        if tail >= 0:
            r.pg32[tail, RP_NEXT] = b
        else:
            r.nd[n, RN_HEAD] = b
        tail = b
    r.nd[n, RN_TAIL] = tail
    r.nd[n, RN_LEN] += count
    # the appended pages' runs (their own: the edge's last run is not extended)
    last = NO_PAGE
    left = np.int32(0)
    for j in range(count - 1, -1, -1):
        b = pages[p0 + j]
        if last == NO_PAGE or keys[k0 + j] != keys[k0 + j + 1]:
            last = b
            left = np.int32(0)
        left += 1
        r.pg32[b, RP_RUN_LAST] = last
        r.pg32[b, RP_RUN_LEFT] = left


@kernel(cache=True, _nrt=False)
def _new_child(r, w, parent, keys, k0, pages, p0, count):
    n = _node_new(r, w)
    if n == NO_NODE:
        return NO_NODE
    r.nd[n, RN_PARENT] = parent
    _link_new_pages(r, w, n, pages, p0, count, keys, k0)
    r.nd[n, RN_TIME] = clock(r, w)
    _child_put(r, w, parent, keys[k0], n)
    r.nd[parent, RN_CHILDREN] += 1
    r.w64[w, RW_EVICTABLE] += count * r.w64[w, RW_PAGE_SIZE]
    _note_leaf(r, w, n)
    return n


@njit(cache=True, _nrt=False)
def insert(r, w, start, keys, k0, n_keys, pages, p0):
    """Insert the page keys that follow ``start``'s path (sglang.md §3.3): keys
    keys[k0 : k0 + n_keys] with the caller's pages pages[p0 : p0 + n_keys]. Pages
    covering keys already in the tree are not taken (the tree keeps its own).
    Returns the node where the inserted sequence ends (NO_NODE: no node slot), and
    leaves in RW_INSERT_SHARED how many keys were in the tree already (0: every page
    given was taken, so the caller has no duplicate to give back)."""
    now = clock(r, w)
    r.w64[w, RW_INSERT_SHARED] = 0
    top = r.w64[w, RW_NODE_OFF]
    ps = r.w64[w, RW_PAGE_SIZE]
    x = start
    while x != NO_NODE:
        _touch(r, w, x, now)
        x = r.nd[x, RN_PARENT]
    cur = start
    i = 0
    while i < n_keys:
        if cur != top and r.nd[cur, RN_CHILDREN] == 0 and \
                (r.nd[cur, RN_LOCK] == 0 or (cur == start and r.nd[cur, RN_LOCK] == 1)):
            count = n_keys - i
            _link_new_pages(r, w, cur, pages, p0 + i, count, keys, k0 + i)
            if r.nd[cur, RN_LOCK] == 0:
                r.w64[w, RW_EVICTABLE] += count * ps
            else:
                r.w64[w, RW_PROTECTED] += count * ps
            _touch(r, w, cur, now)
            return cur
        c = child_find(r, w, cur, keys[k0 + i])
        if c == NO_NODE:
            return _new_child(r, w, cur, keys, k0 + i, pages, p0 + i, n_keys - i)
        m = _common(r, c, keys, k0 + i, n_keys - i)
        r.w64[w, RW_INSERT_SHARED] += m
        if m == r.nd[c, RN_LEN]:
            i += m
            _touch(r, w, c, now)
            cur = c
            continue
        u = _split(r, w, c, m)
        if u == NO_NODE:
            return NO_NODE
        i += m
        if i < n_keys:
            return _new_child(r, w, u, keys, k0 + i, pages, p0 + i, n_keys - i)
        return u
    return cur


@kernel(cache=True, _nrt=False, inline="always")
def kv_logged(r, w):
    """Whether worker w's simulation logs KV Stored / Removed events."""
    return r.event_log.shape[1] > 1 and r.event_log[r.w64[w, RW_SIM], 0, EVH_KV] != 0


@kernel(cache=True, _nrt=False)
def log_inserted(r, w, end, q, pos0, n_new, scratch_tokens, session_row):
    """The last ``n_new`` pages of node ``end``'s edge just entered the tree for request
    q (its pages ``pos0`` on): give each its sequence hash and log them as one KV
    Stored event, parented on the page before them (none at the root), or as more
    blocks of the worker's open Stored event when they continue its chain and neither
    insert is a session turn's (``session_row``, as the reference groups them). A page's
    tokens-only hash is XXH3 (seed 1337) of its token with one-token pages, else its
    key (the tokens-only hash already)."""
    s = r.w64[w, RW_SIM]
    bits = r.event_log[s, 0, EVH_CLOCK_BITS]
    b = r.nd[end, RN_TAIL]
    for _ in range(n_new - 1):
        b = r.pg32[b, RP_PREV]
    prev = r.pg32[b, RP_PREV]
    if prev == NO_PAGE:
        up = r.nd[end, RN_PARENT]
        if up != r.w64[w, RW_NODE_OFF]:
            prev = np.int32(r.nd[up, RN_TAIL])
    chained = prev != NO_PAGE
    parent = r.pg_hash[prev] if chained else np.uint64(0)
    # an insert chained to the open Stored event's last block extends that event,
    # unless either is a session turn's (``session_row``: those stand alone)
    extend = chained and not session_row and r.w64[w, RW_KV_RUN] == KV_RUN_STORED \
        and np.uint64(r.w64[w, RW_KV_TAIL_HASH]) == parent
    one_token = r.w64[w, RW_PAGE_SIZE] == 1
    for j in range(n_new):
        key = r.pg_key[b]
        if one_token:
            scratch_tokens[0] = np.uint32(key)
            tokens = xxh3_64_u32_seed1337(scratch_tokens, 0, 1)
        else:
            tokens = key
        h = hash_chain(parent, tokens) if chained else tokens
        r.pg_hash[b] = h
        if j > 0 or extend:
            group = KV_NEXT
        elif chained:
            group = KV_FIRST_WITH_PARENT
        else:
            group = KV_FIRST
        row = log_row(r.event_log, s, w, EV_KV_STORED, np.int64(h),
                      np.int64(parent) if j == 0 else np.int64(0), np.int64(group), bits)
        if row > 0:
            r.event_log[s, row, EV_REQUEST] = q
            r.event_log[s, row, EV_BLOCK] = pos0 + j
        parent = h
        chained = True
        b = r.pg32[b, RP_NEXT]
    r.w64[w, RW_KV_RUN] = KV_RUN_NONE if session_row else KV_RUN_STORED
    r.w64[w, RW_KV_TAIL_HASH] = np.int64(parent)
    r.w64[w, RW_KV_UNREPORTED] += n_new


@kernel(cache=True, _nrt=False)
def _log_removed(r, w, b):
    """Tree page b leaves the tree: a Removed row, continuing the worker's open event
    when that is a Removed one (``RW_KV_RUN``): the reference reports the evictions of
    consecutive passes as one event, cut where it reports."""
    s = r.w64[w, RW_SIM]
    more = r.w64[w, RW_KV_RUN] == KV_RUN_REMOVED
    log_row(r.event_log, s, w, EV_KV_REMOVED, np.int64(r.pg_hash[b]), np.int64(0),
            np.int64(KV_NEXT if more else KV_FIRST), r.event_log[s, 0, EVH_CLOCK_BITS])
    r.w64[w, RW_KV_RUN] = KV_RUN_REMOVED
    r.w64[w, RW_KV_UNREPORTED] += 1


@kernel(cache=True, _nrt=False)
def report_kv(r, w, t_ms):
    """Worker w reports the KV rows it logged since its last report, at ``t_ms``: a
    report row (``EV_KV_REPORTED``) after them in the log, which gives them that time
    (``event_frames.kv_rows_as_reported``); a Removed row after it starts a new event."""
    if r.w64[w, RW_KV_UNREPORTED] > 0 and kv_logged(r, w):
        log_row(r.event_log, r.w64[w, RW_SIM], w, EV_KV_REPORTED, np.int64(0), np.int64(0),
                np.int64(0), np.float64(t_ms).view(np.int64))
    r.w64[w, RW_KV_UNREPORTED] = 0
    r.w64[w, RW_KV_RUN] = KV_RUN_NONE


@njit(cache=True, _nrt=False)
def path_pages(r, w, n, out, o0, lo=0):
    """The pages of n's root path at positions [lo, depth), written to out[o0 + pos];
    returns the path's depth in pages. Only the part from ``lo`` on is walked (the
    node chain above it is read, its pages are not)."""
    top = r.w64[w, RW_NODE_OFF]
    depth = 0
    x = n
    while x != top and x != NO_NODE:
        depth += r.nd[x, RN_LEN]
        x = r.nd[x, RN_PARENT]
    end = depth
    x = n
    while x != top and x != NO_NODE and end > lo:
        start = end - r.nd[x, RN_LEN]
        b = r.nd[x, RN_TAIL]
        pos = end
        while pos > max(start, lo):
            pos -= 1
            out[o0 + pos] = b
            b = r.pg32[b, RP_PREV]
        end = start
        x = r.nd[x, RN_PARENT]
    return depth


# ---------------------------------------------------------------------------------
# eviction
# ---------------------------------------------------------------------------------
@njit(cache=True, _nrt=False)
def evict(r, w, n_tokens):
    """Free at least ``n_tokens`` from unlocked leaves, oldest access first, cutting
    a leaf's newest pages when it has more than needed (sglang.md §3.5). Returns the
    tokens freed (fewer when nothing more is evictable)."""
    ps = r.w64[w, RW_PAGE_SIZE]
    top = r.w64[w, RW_NODE_OFF]
    logged = kv_logged(r, w)
    evicted = 0
    while evicted < n_tokens:
        leaf = _oldest_leaf(r, w)
        if leaf == NO_NODE:
            break
        need = (n_tokens - evicted + ps - 1) // ps
        length = r.nd[leaf, RN_LEN]
        if length > need:
            tail = r.nd[leaf, RN_TAIL]
            for _ in range(need - 1):
                tail = r.pg32[tail, RP_PREV]
            b = tail  # the oldest page cut: the cut pages go oldest first
            tail = r.pg32[tail, RP_PREV]
            while b != NO_PAGE:
                nxt = r.pg32[b, RP_NEXT]
                if logged:
                    _log_removed(r, w, b)
                page_free(r, w, b)
                b = nxt
            r.pg32[tail, RP_NEXT] = NO_PAGE
            _end_run_at(r, tail)
            r.nd[leaf, RN_TAIL] = tail
            r.nd[leaf, RN_LEN] = length - need
            r.w64[w, RW_EVICTABLE] -= need * ps
            evicted += need * ps
            continue
        parent = r.nd[leaf, RN_PARENT]
        _child_delete(r, w, parent, _first_key(r, leaf))
        b = r.nd[leaf, RN_HEAD]
        while b != NO_PAGE:
            nxt = r.pg32[b, RP_NEXT]
            if logged:
                _log_removed(r, w, b)
            page_free(r, w, b)
            b = nxt
        r.w64[w, RW_EVICTABLE] -= length * ps
        evicted += length * ps
        _node_free(r, w, leaf)
        r.nd[parent, RN_CHILDREN] -= 1
        if parent != top:
            _note_leaf(r, w, parent)
    return evicted


# ---------------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------------
def make_radix(pages_per_worker, nodes_per_worker, page_size=1, page_slots=None, empty=None) -> Radix:
    """Empty radix caches for workers with the given page pools (``num_gpu_blocks``
    pages each), page slots (resident pages at most; default the pool) and node slots
    (a worker never holds more nodes than resident pages + 1). ``empty(name, shape,
    dtype)`` allocates the arrays (default ``np.empty``; the driver's reuses a previous
    run's memory)."""
    cap = np.asarray(pages_per_worker, np.int64)
    pages = cap if page_slots is None else np.minimum(cap, np.asarray(page_slots, np.int64))
    nodes = np.asarray(nodes_per_worker, np.int64) + 1  # the root
    n_workers = len(pages)
    w64 = RADIX_W.new(n_workers)
    page_off = np.concatenate(([0], np.cumsum(pages)[:-1])) if n_workers else pages
    node_off = np.concatenate(([0], np.cumsum(nodes)[:-1])) if n_workers else nodes
    tab_sizes = np.array([1 << max(4, int(2 * n - 1).bit_length()) for n in nodes], np.int64)
    tab_off = np.concatenate(([0], np.cumsum(tab_sizes)[:-1])) if n_workers else tab_sizes
    heap_caps = 2 * nodes + 16
    heap_off = np.concatenate(([0], np.cumsum(heap_caps)[:-1])) if n_workers else heap_caps
    w64[:, RW_PAGE_OFF] = page_off
    w64[:, RW_PAGE_LEN] = pages
    w64[:, RW_PAGE_CAP] = cap
    w64[:, RW_NODE_OFF] = node_off
    w64[:, RW_NODE_LEN] = nodes
    w64[:, RW_TAB_OFF] = tab_off
    w64[:, RW_TAB_MASK] = tab_sizes - 1
    w64[:, RW_HEAP_OFF] = heap_off
    w64[:, RW_HEAP_CAP] = heap_caps
    w64[:, RW_PAGE_SIZE] = np.broadcast_to(np.asarray(page_size, np.int64), (n_workers,))
    # slots are initialized when first handed out (page_alloc, _node_new), so only the
    # roots need it now: an arena costs memory only as far as it is used
    if empty is None:
        empty = lambda name, shape, dtype: np.empty(shape, dtype)  # noqa: E731
    nd = empty("radix_nodes", (int(nodes.sum()), RN_FIELDS), np.int64)
    nd[node_off] = RADIX_N.new(1)[0]
    tab = empty("radix_table", int(tab_sizes.sum()), np.int32)
    tab.fill(-1)
    return Radix(w64=w64, pg32=empty("radix_pg32", (int(pages.sum()), RP_FIELDS), np.int32),
                 pg_key=empty("radix_pg_key", int(pages.sum()), np.uint64), nd=nd, tab=tab,
                 heap_time=empty("radix_heap_time", int(heap_caps.sum()), np.int64),
                 heap_node=empty("radix_heap_node", int(heap_caps.sum()), np.int64))
