"""The SGLang radix cache kernels (kernels/sglang/radix.py): insert, match, split,
lock, eviction order and the token counters, on hand-built trees (sglang.md §3)."""

from __future__ import annotations

import numpy as np
import pytest

from aisim_fast.kernels.schema.layout import (RN_CHILDREN, RN_LEN, RN_LOCK, RN_PARENT, RN_TIME, RW_EVICTABLE,
                                               RW_PROTECTED)
from aisim_fast.kernels.sglang import radix as X


class Tree:
    """One worker's radix cache, driven from Python."""

    def __init__(self, pages=64, page_size=1):
        self.r = X.make_radix([pages], [pages], page_size)
        self.ps = page_size

    def pages(self, n):
        out = np.array([X.page_alloc(self.r, 0) for _ in range(n)], np.int32)
        assert (out >= 0).all()
        return out

    def insert(self, keys, start=None):
        """Lock-match nothing, insert the whole key list from ``start`` (default the
        root) with fresh pages; returns the end node (unlocked)."""
        keys = np.asarray(keys, np.uint64)
        start = X.root(self.r, 0) if start is None else start
        pages = self.pages(len(keys))
        end = X.insert(self.r, 0, start, keys, 0, len(keys), pages, 0)
        return end, pages

    def lock_match(self, keys):
        keys = np.asarray(keys, np.uint64)
        return X.match_lock(self.r, 0, keys, 0, len(keys))

    def ro(self, keys):
        keys = np.asarray(keys, np.uint64)
        return X.match_readonly(self.r, 0, keys, 0, len(keys))

    def node(self, n):
        return self.r.nd[n]

    @property
    def evictable(self):
        return int(self.r.w64[0, RW_EVICTABLE])

    @property
    def protected(self):
        return int(self.r.w64[0, RW_PROTECTED])

    def available(self):
        return int(X.available_tokens(self.r, 0))

    def path(self, n):
        out = np.zeros(256, np.int32)
        d = X.path_pages(self.r, 0, n, out, 0)
        return out[:d].tolist()


def test_insert_then_match_prefix():
    t = Tree()
    end, pages = t.insert([1, 2, 3, 4, 5])
    assert t.ro([1, 2, 3, 4, 5]) == 5
    assert t.ro([1, 2, 3, 9]) == 3
    assert t.ro([7]) == 0
    assert t.path(end) == pages.tolist()
    assert t.evictable == 5 and t.protected == 0
    assert t.available() == 64 - 5


def test_locking_match_splits_and_refreshes_the_suffix():
    t = Tree()
    end, pages = t.insert([1, 2, 3, 4, 5])
    old_time = t.node(end)[RN_TIME]
    matched, upper = t.lock_match([1, 2, 3, 9])
    assert matched == 3
    assert upper != end
    u, x = t.node(upper), t.node(end)
    assert u[RN_LEN] == 3 and x[RN_LEN] == 2
    assert x[RN_PARENT] == upper and u[RN_CHILDREN] == 1
    assert u[RN_TIME] == old_time          # the upper part keeps the old time
    assert x[RN_TIME] > old_time           # the suffix gets a fresh one
    assert u[RN_LOCK] == 1 and x[RN_LOCK] == 0
    assert t.protected == 3 and t.evictable == 2
    assert t.path(upper) == pages[:3].tolist() and t.path(end) == pages.tolist()
    X.dec_lock(t.r, 0, upper)
    assert t.protected == 0 and t.evictable == 5


def test_a_locked_path_is_never_evicted():
    t = Tree(pages=16)
    end, _ = t.insert([1, 2, 3, 4])
    X.inc_lock(t.r, 0, end)
    assert X.evict(t.r, 0, 4) == 0
    assert t.ro([1, 2, 3, 4]) == 4
    X.dec_lock(t.r, 0, end)
    assert X.evict(t.r, 0, 4) == 4
    assert t.ro([1, 2, 3, 4]) == 0
    assert t.available() == 16 and t.evictable == 0


def test_eviction_takes_the_oldest_leaf_and_its_newest_pages_first():
    t = Tree(pages=16)
    a, _ = t.insert([1, 2, 3])
    b, _ = t.insert([7, 8, 9])      # newer
    assert X.evict(t.r, 0, 2) == 2  # two newest pages of the older leaf
    assert t.ro([1, 2, 3]) == 1 and t.ro([7, 8, 9]) == 3
    assert t.node(a)[RN_LEN] == 1
    # touching a makes b the older one
    m, n = t.lock_match([1])
    X.dec_lock(t.r, 0, n)
    assert X.evict(t.r, 0, 1) == 1
    assert t.ro([1]) == 1 and t.ro([7, 8, 9]) == 2


def test_a_parent_becomes_an_evictable_leaf_when_its_last_child_goes():
    t = Tree(pages=16)
    t.insert([1, 2, 3, 4])
    m, upper = t.lock_match([1, 2, 5])      # split: [1 2] -> {[3 4]}
    assert m == 2
    X.dec_lock(t.r, 0, upper)
    assert X.evict(t.r, 0, 4) == 4          # the suffix leaf, then the parent
    assert t.ro([1, 2, 3, 4]) == 0
    assert t.available() == 16


def test_insert_extends_a_leaf_locked_only_by_its_inserter():
    t = Tree()
    end, _ = t.insert([1, 2])
    X.inc_lock(t.r, 0, end)                 # one request holds [1 2]
    keys = np.array([1, 2, 3, 4], np.uint64)
    pages = t.pages(2)
    new_end = X.insert(t.r, 0, end, keys, 2, 2, pages, 0)
    assert new_end == end                   # appended to the edge, no new node
    assert t.node(end)[RN_LEN] == 4
    assert t.protected == 4
    X.dec_lock(t.r, 0, end)
    # locked by two: a child instead
    X.inc_lock(t.r, 0, end)
    X.inc_lock(t.r, 0, end)
    pages = t.pages(1)
    child = X.insert(t.r, 0, end, np.array([5], np.uint64), 0, 1, pages, 0)
    assert child != end and t.node(child)[RN_PARENT] == end
    assert t.ro([1, 2, 3, 4, 5]) == 5


def test_insert_keeps_the_trees_pages_for_keys_it_has():
    t = Tree()
    end, pages = t.insert([1, 2, 3])
    mine = t.pages(5)
    new_end = X.insert(t.r, 0, X.root(t.r, 0), np.array([1, 2, 3, 4, 5], np.uint64), 0, 5, mine, 0)
    path = t.path(new_end)
    assert path[:3] == pages.tolist()       # not the caller's duplicates
    assert path[3:] == mine[3:].tolist()


def _check_runs(r, used):
    """Every tree page's run: RUN_LEFT - 1 pages further along its edge is RUN_LAST,
    which ends the run, and every page on the way has the same key and run."""
    for b in range(used):
        if r.pg32[b, X.RP_IN_TREE] != 1:
            continue
        left, last, c = int(r.pg32[b, X.RP_RUN_LEFT]), int(r.pg32[b, X.RP_RUN_LAST]), b
        assert left >= 1
        for k in range(left - 1):
            c = int(r.pg32[c, X.RP_NEXT])
            assert c >= 0 and r.pg_key[c] == r.pg_key[b] and r.pg32[c, X.RP_RUN_LAST] == last
            assert r.pg32[c, X.RP_RUN_LEFT] == left - 1 - k
        assert c == last


@pytest.mark.parametrize("page_size", [1, 16])
def test_counters_add_up_after_random_work(page_size):
    """Every page is free, in a lease or in the tree exactly once; evictable +
    protected = tokens in the tree; a drained tree evicts to empty."""
    rng = np.random.default_rng(3)
    t = Tree(pages=400, page_size=page_size)
    held = []
    leases = []
    for step in range(300):
        keys = rng.integers(0, 4, size=rng.integers(1, 12)).astype(np.uint64)
        m, last = t.lock_match(keys)
        rest = len(keys) - m
        if X.free_pages(t.r, 0) < rest:
            X.evict(t.r, 0, (rest - X.free_pages(t.r, 0)) * page_size)
        if X.free_pages(t.r, 0) < rest:
            X.dec_lock(t.r, 0, last)
            continue
        pages = t.pages(rest)
        new_last = X.insert(t.r, 0, last, keys, m, rest, pages, 0)
        X.inc_lock(t.r, 0, new_last)
        X.dec_lock(t.r, 0, last)
        # pages the tree did not take stay with the caller, then go back
        for b in pages:
            if t.r.pg32[b, X.RP_IN_TREE] == 0:  # noqa: SIM102
                X.page_free(t.r, 0, b)
        held.append(new_last)
        if len(held) > 5:
            X.dec_lock(t.r, 0, held.pop(rng.integers(0, len(held))))
        used = int(t.r.w64[0, X.RW_PAGE_BUMP])  # slots past it were never handed out
        in_tree = int((t.r.pg32[:used, X.RP_IN_TREE] == 1).sum())
        _check_runs(t.r, used)
        assert X.match_readonly(t.r, 0, keys, 0, len(keys)) == len(keys)
        assert t.evictable + t.protected == in_tree * page_size
        assert X.free_pages(t.r, 0) + in_tree == 400
    for n in held:
        X.dec_lock(t.r, 0, n)
    assert t.protected == 0
    X.evict(t.r, 0, 400 * page_size)
    assert t.evictable == 0 and X.free_pages(t.r, 0) == 400
