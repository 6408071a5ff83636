"""Slow, plain reference model ("oracle") of the AISimulate SGLang rank (aggregated).

Scope: ``backend: sglang`` in an aggregated replay with ``dp_size 1``: radix cache over
pages, prefill admission with the new-token ratio, chunked prefill, the prefill-first
pass with its first-token step, the decode step with retraction, FIFO / LPM ordering.
Not modelled: ``prefill_decode_interval``, attention DP, host loop, MTP, vision,
disaggregation, KV events.

Every rule follows /work/shared/spec/sglang.md literally; comments name the section
("§4.3").  Like tests/support/oracle.py this is a second opinion for the Numba kernels, not a
product: plain classes, plain lists, one request at a time, no clever data structures.

Beyond sglang.md (each checked against the wheel):
* a retraction re-sorts ``running``: SGLang's retract_decode sorts the batch by
  ``(out_len, -prompt_len)`` descending (stable), pops victims off the end and keeps
  the survivors in that order.  This changes the later finish order and so the LRU
  order of finished leaves; it resolves sglang.md §12 (sx-ol1 176/300 -> 300/300).
* the ratio decays only after a decode pass that ran a batch (a pass with nothing to
  do changes nothing; sglang.md §12 lists that case as never reached).

Use
---
``SglangConfig.from_rank_json(rank_json)`` builds the configuration from the ``rank``
object of an execution payload; ``oracle.run(spec, trace)`` picks it (and so this rank)
when the spec's ``engine.rank.backend`` is ``"sglang"``.  ``SglangRank`` has the
interface ``oracle.Replay`` drives: ``submit``, ``is_ready``, ``execute_pass(now_ms)``
returning a pass result with ``admissions``, ``outputs``, ``end_ms`` ...

Invariants: ``SglangRank.check_invariants()`` (pool / tree / lease accounting, lock
counts) and ``SglangRank.check_drained()`` (no request left: nothing locked, the whole
tree evictable, everything returns to the pool) raise AssertionError on a violation.

Units: ``*_tokens`` count tokens, ``*_pages`` count pages of ``page_size`` tokens, page
ids are ints in ``[0, num_pages)``, times are ms.
"""

from __future__ import annotations

from . import oracle
from .oracle import Output, modeled_duration_ms

RETRACT_DECODE_STEPS = 20  # SGLang's RETRACT_DECODE_STEPS (§1)
LPM_MAX_WAITING = 128  # LPM falls back to FIFO above this many waiting requests (§7)
LPM_DUP_PREFIX_TOKENS = 32  # LPM deprioritization window (§7)


def ceil_div(a, b):
    return -(-a // b)


# ================================================================================================
# Configuration (§1)
# ================================================================================================
class SglangConfig:
    def __init__(self, block_size=1, num_gpu_blocks=16384, max_num_seqs=256,
                 enable_prefix_caching=True, max_model_len=None, timing_model=None,
                 speedup_ratio=1.0, decode_speedup_ratio=1.0, schedule_policy="fifo",
                 max_prefill_tokens=16384, chunked_prefill_size=8192, clip_max_new_tokens=4096,
                 schedule_conservativeness=1.0, prefill_decode_interval=0):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if chunked_prefill_size % block_size != 0:
            # the wheel refuses this spec (§10 item 8)
            raise ValueError("sglang.chunked_prefill_size must be divisible by block_size")
        if schedule_policy not in ("fifo", "lpm"):
            raise ValueError("schedule_policy must be fifo or lpm")
        self.backend = "sglang"
        self.page_size = block_size  # tokens per page
        self.num_pages = num_gpu_blocks
        self.total_kv_tokens = num_gpu_blocks * block_size
        self.max_running_requests = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.timing = oracle.TimingModel(timing_model)
        self.speedup_ratio = speedup_ratio
        self.decode_speedup_ratio = decode_speedup_ratio
        self.schedule_policy = schedule_policy
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.clip_max_new_tokens = clip_max_new_tokens
        self.prefill_decode_interval = prefill_decode_interval
        # New-token ratio constants (§1, §8), f64 in the reference's order.
        self.init_new_token_ratio = 0.7 * schedule_conservativeness
        self.min_new_token_ratio = self.init_new_token_ratio * 0.14
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / 600.0

    # oracle.Replay builds its workers' ranks through ``oracle.make_rank(config)``.
    @property
    def rank_class(self):
        return SglangRank

    @classmethod
    def from_rank_json(cls, rank):
        known = {"backend", "block_size", "num_gpu_blocks", "max_num_seqs",
                 "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
                 "preemption_mode", "max_model_len", "timing_model", "speedup_ratio",
                 "decode_speedup_ratio", "worker_type", "prefill_schedule_interval", "sglang",
                 "emit_kv_events", "prefill_decode_interval"}
        unknown = set(rank) - known
        if unknown:
            raise ValueError("rank fields not modeled by the SGLang oracle: %s" % sorted(unknown))
        if rank.get("backend") != "sglang":
            raise ValueError("not an sglang rank")
        if rank.get("worker_type", "aggregated") != "aggregated":
            raise ValueError("the SGLang oracle models aggregated workers only")
        if not rank.get("enable_chunked_prefill", True):
            raise ValueError("sglang requires chunked prefill")
        if rank.get("prefill_schedule_interval", 1) != 1:
            raise ValueError("prefill_schedule_interval is not modeled")
        sg = dict(rank.get("sglang") or {})
        known_sg = {"schedule_policy", "max_prefill_tokens", "chunked_prefill_size",
                    "clip_max_new_tokens", "schedule_conservativeness"}
        if set(sg) - known_sg:
            raise ValueError("sglang fields not modeled: %s" % sorted(set(sg) - known_sg))
        # max_num_batched_tokens and preemption_mode are ignored by SGLang (§1).
        kwargs = {k: rank[k] for k in ("block_size", "num_gpu_blocks", "max_num_seqs",
                                       "enable_prefix_caching", "max_model_len", "timing_model",
                                       "speedup_ratio", "decode_speedup_ratio",
                                       "prefill_decode_interval") if k in rank}
        kwargs.update(sg)
        return cls(**kwargs)


# ================================================================================================
# Radix tree over pages (§3)
# ================================================================================================
class Node:
    """One radix-tree node: an edge of page keys and the physical page ids that hold them."""

    def __init__(self, node_id, keys, pages, parent, lock, time):
        self.node_id = node_id  # creation order (debugging only)
        self.keys = keys  # page keys of the edge
        self.pages = pages  # page ids, same length as keys
        self.children = {}  # first page key of the child's edge -> Node
        self.parent = parent
        self.lock = lock
        self.time = time  # last access, from RadixCache.clock()

    def __repr__(self):
        return "Node(#%d, %d pages, lock=%d, time=%d, %d children)" % (
            self.node_id, len(self.pages), self.lock, self.time, len(self.children))


class RadixCache:
    """Page pool + radix tree.  ``evictable_tokens`` / ``protected_tokens`` count tokens
    in unlocked / locked nodes (root excluded)."""

    def __init__(self, num_pages, page_size):
        self.num_pages = num_pages
        self.page_size = page_size
        # Pool (§3): never-used pages are handed out in order after the free list (LIFO).
        self.next_unused_page = 0
        self.free_list = []
        self.logical_time = 0
        self.next_node_id = 0
        self.root = self._new_node([], [], None, 0, 0)
        self.nodes = {}  # node_id -> Node, every node except the root
        self.evictable_tokens = 0
        self.protected_tokens = 0

    # -- pool -------------------------------------------------------------------------------------
    @property
    def available_pages(self):
        return (self.num_pages - self.next_unused_page) + len(self.free_list)

    @property
    def available_tokens(self):
        return self.available_pages * self.page_size

    def alloc_page(self):
        if self.free_list:
            return self.free_list.pop()
        if self.next_unused_page >= self.num_pages:
            raise AssertionError("page pool exhausted")
        page = self.next_unused_page
        self.next_unused_page += 1
        return page

    def free_page(self, page):
        self.free_list.append(page)

    # -- clock and nodes --------------------------------------------------------------------------
    def clock(self):
        """Monotonic logical clock: every read returns a strictly larger value (§3)."""
        self.logical_time += 1
        return self.logical_time

    def _new_node(self, keys, pages, parent, lock, time):
        node = Node(self.next_node_id, keys, pages, parent, lock, time)
        self.next_node_id += 1
        return node

    def _add_child(self, parent, keys, pages):
        """A fresh unlocked node under ``parent``; its tokens are evictable."""
        child = self._new_node(keys, pages, parent, 0, self.clock())
        parent.children[keys[0]] = child
        self.nodes[child.node_id] = child
        self.evictable_tokens += len(pages) * self.page_size
        return child

    def _count(self, node, pages):
        """Counter bucket for ``pages`` more pages on ``node`` (by its lock)."""
        if node.lock == 0:
            self.evictable_tokens += pages * self.page_size
        else:
            self.protected_tokens += pages * self.page_size

    @staticmethod
    def _common_pages(edge_keys, keys, start):
        n = min(len(edge_keys), len(keys) - start)
        i = 0
        while i < n and edge_keys[i] == keys[start + i]:
            i += 1
        return i

    def split(self, node, at_pages):
        """§3.2: upper part U gets the first ``at_pages`` pages, the parent, the lock and the
        old time; ``node`` keeps the suffix, becomes U's only child and gets a fresh time."""
        upper = self._new_node(node.keys[:at_pages], node.pages[:at_pages], node.parent,
                               node.lock, node.time)
        self.nodes[upper.node_id] = upper
        node.parent.children[upper.keys[0]] = upper
        node.keys = node.keys[at_pages:]
        node.pages = node.pages[at_pages:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        node.time = self.clock()
        return upper

    # -- match ------------------------------------------------------------------------------------
    def match_readonly(self, keys):
        """§3.1: matched tokens of ``keys``; no mutation."""
        node, i = self.root, 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            common = self._common_pages(child.keys, keys, i)
            i += common
            if common < len(child.keys):
                break
            node = child
        return i * self.page_size

    def match_and_lock(self, keys):
        """§3.1: (matched tokens, terminal node, tree pages of the match); the terminal
        node's root path is locked."""
        now = self.clock()
        node, i = self.root, 0
        pages = []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            common = self._common_pages(child.keys, keys, i)
            if common < len(child.keys):
                node = self.split(child, common)
                pages.extend(node.pages)
                i += common
                break
            child.time = now
            pages.extend(child.pages)
            node = child
            i += common
        self.inc_lock(node)
        return i * self.page_size, node, pages

    # -- insert -----------------------------------------------------------------------------------
    def insert(self, start, keys, pages):
        """§3.3: add ``keys``/``pages`` below ``start`` (the caller's locked node); returns the
        node where the inserted sequence ends.  Caller pages covering keys already in the
        tree are not inserted."""
        now = self.clock()
        node = start
        while node is not None:
            node.time = now
            node = node.parent
        cur, i = start, 0
        while i < len(keys):
            if (cur is not self.root and not cur.children
                    and (cur.lock == 0 or (cur is start and cur.lock == 1))):
                # extend a childless leaf (or the caller's own tail) in place
                added = len(keys) - i
                cur.keys.extend(keys[i:])
                cur.pages.extend(pages[i:])
                self._count(cur, added)
                cur.time = now
                return cur
            child = cur.children.get(keys[i])
            if child is None:
                return self._add_child(cur, keys[i:], pages[i:])
            common = self._common_pages(child.keys, keys, i)
            if common == len(child.keys):
                child.time = now
                cur = child
                i += common
                continue
            upper = self.split(child, common)
            i += common
            if i < len(keys):
                return self._add_child(upper, keys[i:], pages[i:])
            return upper
        return cur

    # -- locks ------------------------------------------------------------------------------------
    def inc_lock(self, node):
        while node is not self.root:
            if node.lock == 0:
                tokens = len(node.pages) * self.page_size
                self.evictable_tokens -= tokens
                self.protected_tokens += tokens
            node.lock += 1
            node = node.parent

    def dec_lock(self, node):
        """§3.4 (a node reaching 0 becomes evictable; a childless one an evictable leaf)."""
        while node is not self.root:
            node.lock -= 1
            if node.lock < 0:
                raise AssertionError("lock underflow on %r" % node)
            if node.lock == 0:
                tokens = len(node.pages) * self.page_size
                self.protected_tokens -= tokens
                self.evictable_tokens += tokens
            node = node.parent

    def path_pages(self, node):
        """Tree page ids from the root to ``node`` (inclusive), in sequence order."""
        parts = []
        while node is not self.root:
            parts.append(node.pages)
            node = node.parent
        out = []
        for part in reversed(parts):
            out.extend(part)
        return out

    # -- eviction ---------------------------------------------------------------------------------
    def evictable_leaves(self):
        return [n for n in self.nodes.values() if not n.children and n.lock == 0]

    def evict(self, n_tokens):
        """§3.5: free at least ``n_tokens`` (if possible) from the least recently used
        unlocked leaves, cutting a leaf's newest pages first.  Returns tokens evicted."""
        evicted_tokens = 0
        while evicted_tokens < n_tokens:
            leaves = self.evictable_leaves()
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: (n.time, n.node_id))
            need_pages = ceil_div(n_tokens - evicted_tokens, self.page_size)
            if len(leaf.pages) > need_pages:
                cut = leaf.pages[-need_pages:]
                del leaf.keys[-need_pages:]
                del leaf.pages[-need_pages:]
            else:
                cut = leaf.pages
                del leaf.parent.children[leaf.keys[0]]
                del self.nodes[leaf.node_id]
                leaf.parent = None
            for page in cut:
                self.free_page(page)
            self.evictable_tokens -= len(cut) * self.page_size
            evicted_tokens += len(cut) * self.page_size
        return evicted_tokens


# ================================================================================================
# Request state (§2)
# ================================================================================================
class SglangRequest:
    def __init__(self, request_id, prompt_tokens, max_output_tokens, output_tokens, page_size):
        self.request_id = request_id
        self.seq = list(prompt_tokens)  # prompt followed by generated tokens
        self.prompt_len = len(prompt_tokens)
        self.max_out = max_output_tokens
        self.output_tokens = output_tokens  # planned output token ids
        self.page_size = page_size
        self.page_keys = []  # one key per complete page of seq (kept across retraction)
        # lease
        self.materialized_tokens = 0  # tokens whose KV is computed and owned
        self.allocated_tokens = 0  # page-rounded footprint
        self.pages = []  # one page id per page of materialized tokens
        self.cached_tokens = 0  # page-aligned prefix in the tree, locked through last_node
        self.last_node = None  # None while the lease is inactive
        self.retractions = 0

    @property
    def out_len(self):
        return len(self.seq) - self.prompt_len

    @property
    def remaining(self):
        return max(0, self.max_out - self.out_len)

    def keys(self, n_pages):
        """Page keys of the first ``n_pages`` complete pages (§2): the page's tokens (the
        token itself when a page is one token)."""
        ps = self.page_size
        while len(self.page_keys) < n_pages:
            i = len(self.page_keys)
            if ps == 1:
                self.page_keys.append(self.seq[i])
            else:
                self.page_keys.append(tuple(self.seq[i * ps:(i + 1) * ps]))
        return self.page_keys[:n_pages]

    def append_token(self):
        self.seq.append(self.output_tokens[self.out_len])


# ================================================================================================
# Pass result (the interface oracle.Replay reads)
# ================================================================================================
class SglangPassResult:
    def __init__(self, start_ms):
        self.start_ms = start_ms
        self.end_ms = start_ms
        self.admissions = []  # (request_id, reused tokens), admission order
        self.preempted = []  # retracted request ids, retraction order
        self.pressure_events = []  # one dict per retraction (the seed's PressureEvent)
        self.outputs = []  # oracle.Output, emission order
        self.prefill_ms = 0.0
        self.decode_ms = 0.0
        self.decode_batch = []  # request ids of a decode pass
        self.prefill_batch_size = 0  # b of §6 step 3
        self.prefill_tokens = 0  # Σ computed tokens of the admitted chunks
        self.prefill_kv_tokens = 0  # Σ prefix tokens of the admitted chunks
        self.decode_kv_tokens = 0  # active KV of the decode batch

    def fpm(self):
        return {
            "num_prefill_requests": self.prefill_batch_size,
            "sum_prefill_tokens": self.prefill_tokens,
            "sum_prefill_kv_tokens": self.prefill_kv_tokens,
            "num_decode_requests": len(self.decode_batch),
            "sum_decode_kv_tokens": self.decode_kv_tokens,
        }

    def has_effects(self):
        return (self.end_ms > self.start_ms or bool(self.admissions) or bool(self.preempted)
                or bool(self.outputs) or self.prefill_batch_size > 0 or bool(self.decode_batch))


# ================================================================================================
# The SGLang rank
# ================================================================================================
class SglangRank:
    def __init__(self, config):
        self.config = config
        self.ps = config.page_size
        self.cache = RadixCache(config.num_pages, config.page_size)
        self.requests = {}  # request_id -> SglangRequest (in a queue)
        self.waiting = []
        self.running = []
        self.new_token_ratio = config.init_new_token_ratio
        self.retractions_total = 0
        self.prefill_rounds = 0  # passes left without prefill (engine.md 7.8)
        self.next_output_token = 0

    # ------------------------------------------------------------------------------------------
    # Commands
    # ------------------------------------------------------------------------------------------
    def submit(self, request_id, prompt_tokens, max_output_tokens, output_token_ids=None,
               uuid_int=None):
        if request_id in self.requests:
            raise ValueError("request %r is already active" % (request_id,))
        if output_token_ids is not None:
            max_output_tokens = len(output_token_ids)
        if self.config.max_model_len is not None:
            max_output_tokens = min(max_output_tokens,
                                    max(0, self.config.max_model_len - len(prompt_tokens)))
        if output_token_ids is None:
            # Planned output ids: only per-request uniqueness matters (§2); negative ids
            # never collide with the interned (non-negative) prompt ids or with each other.
            output_token_ids = [-(self.next_output_token + k + 1) for k in range(max_output_tokens)]
            self.next_output_token += max_output_tokens
        request = SglangRequest(request_id, prompt_tokens, max_output_tokens,
                                list(output_token_ids), self.ps)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def is_ready(self):
        return bool(self.running) or bool(self.waiting)

    # ------------------------------------------------------------------------------------------
    # KV operations on a request (§4)
    # ------------------------------------------------------------------------------------------
    def first_allocation(self, r, chunk_end_tokens, cap_tokens):
        """§4.1.  Returns the matched prefix tokens, or None on failure (nothing held)."""
        cache, ps = self.cache, self.ps
        if self.config.enable_prefix_caching:
            n_match = min(cap_tokens, chunk_end_tokens) // ps
            prefix_tokens, last, tree_pages = cache.match_and_lock(r.keys(n_match))
        else:
            prefix_tokens, last, tree_pages = 0, cache.root, []
        req_pages = ceil_div(chunk_end_tokens, ps) - prefix_tokens // ps
        if req_pages * ps > cache.available_tokens + cache.evictable_tokens:
            cache.dec_lock(last)
            return None
        if req_pages * ps > cache.available_tokens:
            cache.evict(req_pages * ps - cache.available_tokens)
        r.pages = list(tree_pages) + [cache.alloc_page() for _ in range(req_pages)]
        r.cached_tokens = prefix_tokens
        r.last_node = last
        return prefix_tokens

    def extend_allocation(self, r, chunk_end_tokens):
        """§4.2.  True on success."""
        cache, ps = self.cache, self.ps
        new_pages = ceil_div(chunk_end_tokens, ps) - len(r.pages)
        if new_pages * ps > cache.available_tokens + cache.evictable_tokens:
            return False
        if new_pages * ps > cache.available_tokens:
            cache.evict(new_pages * ps - cache.available_tokens)
        r.pages.extend(cache.alloc_page() for _ in range(new_pages))
        return True

    def _free_duplicates(self, r, new_last, from_page, to_page, replace):
        """Lease pages in [from_page, to_page) that differ from the tree's page on
        ``new_last``'s path go back to the pool; ``replace`` puts the tree's page in."""
        tree = self.cache.path_pages(new_last)
        for i in range(from_page, to_page):
            if r.pages[i] != tree[i]:
                self.cache.free_page(r.pages[i])
                if replace:
                    r.pages[i] = tree[i]

    def cache_prefix(self, r):
        """§4.3: insert the page-aligned materialized prefix, move the lock, canonicalize."""
        ps = self.ps
        aligned = (r.materialized_tokens // ps) * ps
        if aligned == 0 or aligned <= r.cached_tokens or not self.config.enable_prefix_caching:
            return
        lo, hi = r.cached_tokens // ps, aligned // ps
        new_last = self.cache.insert(r.last_node, r.keys(hi)[lo:], r.pages[lo:hi])
        if new_last is not r.last_node:
            self.cache.inc_lock(new_last)
            self._free_duplicates(r, new_last, lo, hi, replace=True)
            self.cache.dec_lock(r.last_node)
        r.last_node = new_last
        r.cached_tokens = aligned

    def finish(self, r):
        """§4.4: insert the complete pages (generated ones included), free the rest, unlock."""
        cache, ps = self.cache, self.ps
        if not self.config.enable_prefix_caching:
            for page in r.pages:
                cache.free_page(page)
            cache.dec_lock(r.last_node)
            r.pages = []
            r.last_node = None
            return
        seq_aligned = (len(r.seq) // ps) * ps
        complete = (min(seq_aligned, r.materialized_tokens) // ps) * ps
        for page in r.pages[complete // ps:]:
            cache.free_page(page)
        del r.pages[complete // ps:]
        if complete == 0:
            cache.dec_lock(r.last_node)
        else:
            lo, hi = r.cached_tokens // ps, complete // ps
            new_last = cache.insert(r.last_node, r.keys(hi)[lo:], r.pages[lo:hi])
            self._free_duplicates(r, new_last, lo, hi, replace=False)
            cache.dec_lock(r.last_node)  # the old last; new nodes were never locked
        r.pages = []
        r.last_node = None

    def release_on_retraction(self, r):
        """§4.5: free everything not in the tree, unlock; keys and tokens stay."""
        for page in r.pages[r.cached_tokens // self.ps:]:
            self.cache.free_page(page)
        self.cache.dec_lock(r.last_node)
        r.pages = []
        r.last_node = None
        r.cached_tokens = 0
        r.materialized_tokens = 0
        r.allocated_tokens = 0

    # ------------------------------------------------------------------------------------------
    # LPM ordering (§7)
    # ------------------------------------------------------------------------------------------
    def apply_lpm(self):
        if (self.config.schedule_policy != "lpm" or not self.config.enable_prefix_caching
                or len(self.waiting) > LPM_MAX_WAITING):
            return
        ps = self.ps
        dup_tokens = ceil_div(LPM_DUP_PREFIX_TOKENS, ps) * ps
        seen = set()
        order = []
        for index, r in enumerate(self.waiting):
            prefix_tokens = self.cache.match_readonly(r.keys(len(r.seq) // ps))
            deprioritized = False
            if prefix_tokens <= LPM_DUP_PREFIX_TOKENS and len(r.seq) >= dup_tokens:
                window = tuple(r.keys(dup_tokens // ps))
                if window in seen:
                    deprioritized = True
                else:
                    seen.add(window)
            order.append(((deprioritized, -prefix_tokens, index), r))
        order.sort(key=lambda item: item[0])
        self.waiting = [r for _, r in order]

    # ------------------------------------------------------------------------------------------
    # Prefill admission (§5)
    # ------------------------------------------------------------------------------------------
    def admit(self, result):
        """Returns (admitted requests, Σ chunk_end, Σ prefix_len)."""
        cfg, cache, ps = self.config, self.cache, self.ps
        reserved_tokens = 0.0
        for q in self.running:
            reserved_tokens += float(min(q.remaining, cfg.clip_max_new_tokens)) * self.new_token_ratio
        rem_total = float(cache.available_tokens + cache.evictable_tokens) - reserved_tokens
        rem_input = float(cfg.max_prefill_tokens)
        rem_chunk = float(cfg.chunked_prefill_size)
        slots = max(0, cfg.max_running_requests - len(self.running))
        admitted = []
        total_isl = total_prefix = 0
        while len(admitted) < slots and self.waiting:
            r = self.waiting.pop(0)
            # 1. cached prefix probe (whole current sequence, len-1 cap)
            cached_prefix = 0
            if r.materialized_tokens == 0 and cfg.enable_prefix_caching:
                cap_len = len(r.seq) if r.max_out == 0 else len(r.seq) - 1
                cached_prefix = cache.match_readonly(r.keys(max(0, cap_len) // ps))
            # 2.
            start = max(r.materialized_tokens, cached_prefix)
            extend = len(r.seq) - start
            if extend == 0 and r.materialized_tokens > 0:
                self.waiting.insert(0, r)
                break
            # 3. chunking against the remaining chunk budget (§10 item 1)
            if ceil_div(extend, ps) * ps <= rem_chunk:
                chunk = extend
            else:
                chunk = (int(rem_chunk) // ps) * ps
                if chunk == 0:
                    self.waiting.insert(0, r)
                    break
                chunk = min(chunk, extend)
            # 4.
            charged = float(ceil_div(chunk, ps) * ps)
            out_reserve = 0.0 if chunk < extend else float(min(r.remaining, cfg.clip_max_new_tokens))
            # 5.
            if charged + out_reserve >= rem_total or charged > rem_input or charged > rem_chunk:
                self.waiting.insert(0, r)
                break
            # 6. allocate
            chunk_end = start + chunk
            first = r.materialized_tokens == 0
            if first:
                prefix_len = self.first_allocation(r, chunk_end, start)
                if prefix_len is None:
                    self.waiting.insert(0, r)
                    break
            else:
                if not self.extend_allocation(r, chunk_end):
                    self.waiting.insert(0, r)
                    break
                prefix_len = r.materialized_tokens
            # 7.
            result.prefill_tokens += chunk_end - prefix_len
            result.prefill_kv_tokens += prefix_len
            r.materialized_tokens = chunk_end
            r.allocated_tokens = ceil_div(chunk_end, ps) * ps
            if first:
                result.admissions.append((r.request_id, prefix_len))
            # 8.
            total_isl += chunk_end
            total_prefix += prefix_len
            rem_total -= charged + out_reserve
            rem_input -= charged
            rem_chunk -= charged
            admitted.append(r)
            if rem_chunk <= 0:
                break
        return admitted, total_isl, total_prefix

    # ------------------------------------------------------------------------------------------
    # One pass (§6)
    # ------------------------------------------------------------------------------------------
    def execute_pass(self, now_ms):
        """One pass. A pass that only counted down the prefill interval changes nothing
        anyone sees: the reference runs the rank again at once (a same-instant retry)."""
        while True:
            result, countdown_only = self._execute_pass(now_ms)
            if not countdown_only or not self.is_ready():
                return result

    def _execute_pass(self, now_ms):
        cfg = self.config
        result = SglangPassResult(now_ms)
        rounds = self.prefill_rounds
        defer_prefill = rounds > 0

        # 1. max_model_len rejections (outputs at the pass end)
        rejected = []
        if cfg.max_model_len is not None:
            for r in list(self.waiting):
                if r.prompt_len >= cfg.max_model_len:
                    self.waiting.remove(r)
                    del self.requests[r.request_id]
                    rejected.append(r.request_id)
        # 2. LPM
        self.apply_lpm()
        # 3. admission (none while the prefill interval counts down, chunks included)
        admitted, total_isl, total_prefix = self.admit(result) if not defer_prefill else ([], 0, 0)
        # a deferred pass with nothing to decode is idle: no ratio decay; with no
        # model work it resets the ratio
        interval_idle = defer_prefill and not any(r.remaining > 0 for r in self.running)
        b = len(admitted)
        result.prefill_batch_size = b
        # 4. prefill duration from the floored means
        if b > 0:
            raw_prefill = cfg.timing.predict_prefill_ms(b, total_isl // b, total_prefix // b)
        else:
            raw_prefill = 0.0
        prefill_ms = modeled_duration_ms(raw_prefill, cfg.speedup_ratio) if b > 0 else 0.0
        decode_start = now_ms + 0.0 + prefill_ms
        # 5. place the admitted requests
        stalled = list(self.running)
        new_prefills = []
        for r in admitted:
            if r.materialized_tokens < len(r.seq):
                self.cache_prefix(r)  # partial chunk: back to the waiting front
                self.waiting.insert(0, r)
            else:
                new_prefills.append(r)
        completed = []
        retracted = []
        ratio_estimate = None
        if b > 0:
            # 6. prefill pass: stalled requests keep their place; new prefills get a token
            survivors = self.first_tokens(new_prefills, result, completed)
            self.running = stalled + survivors
            end_ms = decode_start
            result.prefill_ms = prefill_ms
        elif self.running:
            # 7. decode pass
            end_ms, ratio_estimate = self.decode_step(now_ms, result, completed, retracted)
        else:
            end_ms = now_ms
        # 8. finish completed requests, then rejections, then requeue the retracted
        for r in completed:
            self.finish(r)
            del self.requests[r.request_id]
        for request_id in rejected:
            result.outputs.append(Output(request_id, None, True, True, None))
        self.waiting.extend(retracted)
        result.preempted = [r.request_id for r in retracted]
        # 9. new-token ratio (§8)
        if retracted:
            self.new_token_ratio = ratio_estimate
        elif b == 0 and result.decode_batch and not interval_idle:
            self.new_token_ratio = max(self.new_token_ratio - cfg.new_token_ratio_decay,
                                       cfg.min_new_token_ratio)
        prefilled = total_isl - total_prefix > 0
        emitted = any(o.token_id is not None for o in result.outputs)
        if interval_idle and not (prefilled or (b == 0 and emitted)):
            self.new_token_ratio = cfg.init_new_token_ratio
        self.prefill_rounds = cfg.prefill_decode_interval if prefilled else max(rounds - 1, 0)
        result.end_ms = end_ms
        return result, rounds > 0 and not result.has_effects()

    def first_tokens(self, new_prefills, result, completed):
        """§6.2: first tokens of the newly completed prefills; returns those that keep
        running, in order."""
        cache, ps = self.cache, self.ps
        survivors = []
        run = []
        for r in new_prefills:
            if r.remaining == 0:
                result.outputs.append(Output(r.request_id, None, True, False, None))
                completed.append(r)
            elif r.remaining == 1:
                r.append_token()  # final token, no KV slot
                result.outputs.append(Output(r.request_id, r.seq[-1], True, False, None))
                completed.append(r)
            else:
                run.append(r)
        if not run:
            return survivors
        need_tokens = sum(ceil_div(len(r.seq) + 1, ps) * ps - r.allocated_tokens for r in run)
        if cache.available_tokens < need_tokens:
            cache.evict(need_tokens - cache.available_tokens)
        if cache.available_tokens >= need_tokens:
            reserved = [cache.alloc_page() for _ in range(need_tokens // ps)]
            for r in run:
                if r.materialized_tokens % ps == 0:
                    r.pages.append(reserved.pop(0))
                if len(r.seq) + 1 > r.allocated_tokens:
                    r.allocated_tokens += ps
                self.cache_prefix(r)  # the prefilled sequence, before the token
                r.append_token()
                r.materialized_tokens += 1
                result.outputs.append(Output(r.request_id, r.seq[-1], False, False, None))
            for page in reversed(reserved):
                cache.free_page(page)
        else:
            for r in run:
                self.cache_prefix(r)  # no token this pass, but the prefill is cached
        survivors.extend(run)
        return survivors

    def decode_need_tokens(self):
        ps = self.ps
        return sum(max(0, ceil_div(len(r.seq) + min(1, r.remaining), ps) * ps - r.allocated_tokens)
                   for r in self.running)

    def decode_step(self, now_ms, result, completed, retracted):
        """§6.3.  Returns (pass end, ratio estimate or None)."""
        cfg, cache, ps = self.config, self.cache, self.ps
        # 1. requests with nothing left to generate
        for r in [r for r in self.running if r.remaining == 0]:
            self.running.remove(r)
            result.outputs.append(Output(r.request_id, None, True, False, None))
            completed.append(r)
        # 2. memory check and retraction
        while True:
            need = self.decode_need_tokens()
            if cache.available_tokens + cache.evictable_tokens >= need or len(self.running) <= 1:
                break
            if not retracted:
                # SGLang's retract_decode sorts the batch by (out_len, -prompt_len) descending
                # (stable: ties keep running order), pops victims off the end and keeps the
                # survivors in the sorted order.  So the victim is the smallest out_len, then
                # the longest prompt, then the last such in running order -- and the running
                # order itself changes (not in sglang.md; proven by sx-ol1 / sx-lpm2).
                self.running.sort(key=lambda q: (q.out_len, -q.prompt_len), reverse=True)
            before = (len(self.running), cache.num_pages - cache.available_pages)
            victim = self.running[-1]
            event = {
                "at_ms": now_ms, "request_id": victim.request_id,
                "running_before": before[0], "waiting_before": None,
                "active_blocks_before": before[1],
                "request_active_blocks_before": ceil_div(victim.allocated_tokens, ps),
                "logical_available_blocks_before": (cache.available_tokens + cache.evictable_tokens) // ps,
                "required_blocks_before": ceil_div(need, ps),
            }
            self.running.pop()
            self.release_on_retraction(victim)
            event.update(running_after=len(self.running), waiting_after=None,
                         active_blocks_after=cache.num_pages - cache.available_pages)
            result.pressure_events.append(event)
            victim.retractions += 1
            self.retractions_total += 1
            retracted.append(victim)
            floor_tokens = RETRACT_DECODE_STEPS * len(self.running)
            if cache.available_tokens < floor_tokens:
                cache.evict(floor_tokens - cache.available_tokens)
        # 3. growth eviction
        need = self.decode_need_tokens()
        if cache.available_tokens < need:
            cache.evict(need - cache.available_tokens)
        # 4. ratio estimate from the survivors before this pass's tokens
        ratio_estimate = None
        if retracted:
            sum_out = float(sum(r.out_len for r in self.running))
            sum_max = float(sum(r.max_out for r in self.running))
            ratio_estimate = min(1.0, (sum_out + float(RETRACT_DECODE_STEPS) * float(len(self.running)))
                                 / (sum_max + 1.0))
        # 5. time
        b = len(self.running)
        active_kv_tokens = sum(len(r.seq) for r in self.running)
        raw_decode = cfg.timing.predict_decode_ms(b, active_kv_tokens, cfg.total_kv_tokens)
        decode_ms = modeled_duration_ms(raw_decode, cfg.speedup_ratio * cfg.decode_speedup_ratio)
        decode_start = now_ms + 0.0
        # 6. reserve and emit
        if b == 0 or cache.available_tokens < need:
            return decode_start, ratio_estimate
        result.decode_batch = [r.request_id for r in self.running]
        result.decode_kv_tokens = active_kv_tokens
        result.decode_ms = decode_ms
        reserved = [cache.alloc_page() for _ in range(need // ps)]
        still_running = []
        for r in self.running:
            if r.materialized_tokens % ps == 0:
                r.pages.append(reserved.pop(0))
            if len(r.seq) + 1 > r.allocated_tokens:
                r.allocated_tokens += ps
            r.append_token()
            r.materialized_tokens += 1
            done = r.out_len >= r.max_out
            result.outputs.append(Output(r.request_id, r.seq[-1], done, False, None))
            if done:
                completed.append(r)
            else:
                still_running.append(r)
        for page in reversed(reserved):
            cache.free_page(page)
        # 7.
        self.running = still_running
        return decode_start + decode_ms, ratio_estimate

    # ------------------------------------------------------------------------------------------
    # Invariants (for property tests)
    # ------------------------------------------------------------------------------------------
    def check_invariants(self):
        """Pool / tree / lease accounting; raises AssertionError on a violation.

        * every page is exactly one of: free, in one tree node, private to one lease;
        * a lease's cached prefix is the tree's path to its locked node;
        * evictable / protected counters equal the tokens of unlocked / locked nodes;
        * each node's lock equals the number of active leases whose node is it or below it;
        * queues and the request table agree.
        """
        cache, ps = self.cache, self.ps
        owner = {}

        def claim(page, who):
            assert 0 <= page < cache.num_pages, "page id %r out of range" % page
            assert page not in owner, "page %d owned by %s and %s" % (page, owner[page], who)
            owner[page] = who

        for page in cache.free_list:
            claim(page, "free")
        for page in range(cache.next_unused_page, cache.num_pages):
            claim(page, "unused")
        evictable = protected = 0
        for node in cache.nodes.values():
            assert len(node.keys) == len(node.pages) > 0, "empty or ragged edge %r" % node
            assert node.parent is not None and node.parent.children.get(node.keys[0]) is node
            for page in node.pages:
                claim(page, "node %d" % node.node_id)
            if node.lock == 0:
                evictable += len(node.pages) * ps
            else:
                protected += len(node.pages) * ps
        assert evictable == cache.evictable_tokens, "evictable counter drift"
        assert protected == cache.protected_tokens, "protected counter drift"
        expected_lock = {}
        for r in self.requests.values():
            if r.last_node is None:
                assert not r.pages and r.materialized_tokens == 0 and r.allocated_tokens == 0
                continue
            assert r.cached_tokens % ps == 0
            node = r.last_node
            tree = cache.path_pages(node)
            assert len(tree) * ps == r.cached_tokens, "last node does not end at cached"
            assert r.pages[:len(tree)] == tree, "cached lease pages differ from the tree"
            assert len(r.pages) == ceil_div(r.materialized_tokens, ps)
            assert r.allocated_tokens == ceil_div(r.materialized_tokens, ps) * ps
            assert r.materialized_tokens <= len(r.seq)
            for page in r.pages[len(tree):]:
                claim(page, "lease %r" % (r.request_id,))
            while node is not cache.root:
                expected_lock[node.node_id] = expected_lock.get(node.node_id, 0) + 1
                node = node.parent
        for node in cache.nodes.values():
            assert node.lock == expected_lock.get(node.node_id, 0), "lock count drift %r" % node
        assert len(owner) == cache.num_pages, "pages leaked"
        queued = self.waiting + self.running
        assert len(queued) == len(set(map(id, queued))) == len(self.requests)
        for r in self.running:
            assert r.materialized_tokens == len(r.seq) or r.last_node is not None

    def check_drained(self):
        """With no request left: nothing locked, and evicting everything returns the whole
        pool.  Mutates the cache (evicts it)."""
        self.check_invariants()
        cache = self.cache
        assert not self.requests and not self.waiting and not self.running
        assert cache.protected_tokens == 0
        assert all(node.lock == 0 for node in cache.nodes.values())
        tree_tokens = sum(len(n.pages) for n in cache.nodes.values()) * self.ps
        assert cache.evictable_tokens == tree_tokens
        assert cache.available_tokens + cache.evictable_tokens == self.config.total_kv_tokens
        cache.evict(cache.evictable_tokens)
        assert not cache.nodes and cache.available_tokens == self.config.total_kv_tokens


# ================================================================================================
# Whole-row helper for comparisons with the reference CSV
# ================================================================================================
def reference_row(record):
    """An oracle record (oracle.RequestRecord.as_row) with the remaining columns the
    reference's aggregated CSV writes: trace_line (from a ``request_<line>`` id),
    decode_worker = worker, and the empty disaggregation columns."""
    row = dict(record)
    request_id = str(row["request_id"])
    if request_id.startswith("request_") and request_id[8:].isdigit():
        row["trace_line"] = int(request_id[8:])
    row["decode_worker"] = row["worker"]
    for col in ("prefill_worker", "prefill_admit_ms", "source_held_ms", "destination_reserved_ms",
                "destination_activated_ms", "decode_admit_ms", "source_released_ms",
                "decode_cached_tokens"):
        row[col] = None
    return row
