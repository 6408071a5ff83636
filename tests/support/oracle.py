"""Slow, plain reference model ("oracle") of the AISimulate aggregated replay.

Scope: aggregated topology, vLLM and TRT-LLM backends (the shared vLLM core
with the G1 paged block pool), Mooncake traces (single-turn rows and
multi-turn sessions), open loop (trace timestamps) and closed loop
(``replay_concurrency``), polynomial and fixed timing.

This module is a second opinion for the Numba kernels, not a product.  Every
rule is written the most direct way: plain classes, plain lists, one request
at a time.  Do not optimise it; a faster but less obvious oracle is worth less.

Entry points
------------
``run(spec, trace_path) -> (records, passes)``
    Replays a reference execution payload (the ``*.spec.json`` files of the
    goldens) over a Mooncake trace.  ``records`` holds one dict per terminal
    request with the golden CSV column names; ``passes`` holds one dict per
    executed forward pass (see ``Replay._record_pass``).

``Rank(RankConfig(...))``
    One vLLM / TRT-LLM rank for unit tests: ``submit`` requests and call
    ``execute_pass(now_ms)``; all state (pool, queues, requests) is public.

The rules follow /work/shared/spec/engine.md (sections 1-6, 8, 9.2, 14) and
replay.md (sections 1-3); comments name the rule they implement.
"""

from __future__ import annotations

import heapq
import json
import struct
from collections import OrderedDict
from fractions import Fraction

import xxhash

XXH3_SEED = 1337
NANOS_PER_SEC = 1_000_000_000


# ================================================================================================
# Hashing (engine.md 4.1)
# ================================================================================================
def local_block_hash(tokens):
    """XXH3-64 (seed 1337) of one complete block, tokens as little-endian u32."""
    data = struct.pack("<%dI" % len(tokens), *tokens)
    return xxhash.xxh3_64_intdigest(data, seed=XXH3_SEED)


def chained_block_hash(parent_hash, local_hash):
    """Sequence hash of block i > 0: XXH3-64 over LE u64(parent) || LE u64(local)."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent_hash, local_hash), seed=XXH3_SEED)


def synthetic_output_token(uuid_int, ordinal):
    """vLLM-core output token when no planned token exists (engine.md 4.1).

    Low 32 bits of XXH3-64 (seed 0) over the 16 big-endian UUID bytes followed by
    the LE u64 output ordinal.  Only the identity structure matters for metrics:
    these tokens are per-request unique and never equal the small interned prompt
    ids, so generated blocks never collide with prompt blocks or other requests.
    """
    data = uuid_int.to_bytes(16, "big") + struct.pack("<Q", ordinal)
    return xxhash.xxh3_64_intdigest(data, seed=0) & 0xFFFFFFFF


# ================================================================================================
# Timing (engine.md 8)
# ================================================================================================
def secs_to_ns(seconds):
    """Rust ``Duration::from_secs_f64``: round the exact f64 value to the nearest ns."""
    return round(Fraction(seconds) * NANOS_PER_SEC)


def ns_to_secs(ns):
    """Rust ``Duration::as_secs_f64``: whole seconds plus the ns remainder over 1e9."""
    return float(ns // NANOS_PER_SEC) + float(ns % NANOS_PER_SEC) / 1e9


def modeled_duration_ms(raw_ms, ratio):
    """Quantize a modeled duration through the ns duration type, then apply a speedup.

    The speedup divides the already-quantized seconds and quantizes again
    (engine.md 8.4).  With ratio 1.0 the second step returns the same ns.
    """
    ns = secs_to_ns(raw_ms / 1000.0)
    if ratio > 0 and ns > 0:
        ns = secs_to_ns(ns_to_secs(ns) / ratio)
    return ns_to_secs(ns) * 1000.0


def polynomial_prefill_ms(batch_size, new_tokens_per_request):
    """Polynomial prefill; the argument is b x (floored mean isl - floored mean prefix).

    ``powi(2)`` is a plain square, so the quadratic term is a * (T * T), not
    (a * T) * T; the two round differently.
    """
    if batch_size == 0 or new_tokens_per_request == 0:
        return 0.0
    tokens = float(batch_size * new_tokens_per_request)
    return 4.209989e-07 * (tokens * tokens) + 1.518344e-02 * tokens + 1.650142e01


def polynomial_decode_ms(active_kv_tokens, total_kv_tokens):
    if total_kv_tokens > 0:
        p = min(float(active_kv_tokens) / float(total_kv_tokens), 1.0)
    else:
        p = 1.0
    return max(-25.74 * (p * p) + 54.01 * p + 5.74, 1.0)


class TimingModel:
    """Built-in timing providers: ``polynomial`` (default) or ``fixed``."""

    def __init__(self, config=None):
        config = dict(config or {"type": "polynomial"})
        self.kind = config.get("type", "polynomial")
        if self.kind == "fixed":
            self.prefill_ms = float(config["prefill_ms"])
            self.decode_ms = float(config["decode_ms"])
        elif self.kind != "polynomial":
            raise ValueError("oracle supports only polynomial and fixed timing, got %r" % self.kind)

    def predict_prefill_ms(self, batch_size, mean_isl, mean_prefix):
        # Wrapper rule: no provider call (0 ms) for an empty batch or when the
        # floored mean isl does not exceed the floored mean prefix.
        new_tokens = max(0, mean_isl - mean_prefix)
        if batch_size == 0 or new_tokens == 0:
            return 0.0
        if self.kind == "fixed":
            raw = self.prefill_ms
        else:
            raw = polynomial_prefill_ms(batch_size, new_tokens)
        return max(raw, 0.0)

    def predict_decode_ms(self, batch_size, active_kv_tokens, total_kv_tokens):
        if batch_size == 0:
            return 0.0
        if self.kind == "fixed":
            return self.decode_ms
        return polynomial_decode_ms(active_kv_tokens, total_kv_tokens)


# ================================================================================================
# Physical block pool (engine.md 4.3, cache/vllm_block_pool.rs)
# ================================================================================================
class BlockCopy:
    """One physical block.  ``hash is None`` means a private (request-owned) copy."""

    def __init__(self, copy_id):
        self.copy_id = copy_id
        self.hash = None
        self.refs = 0
        self.pins = 0

    @property
    def is_cached(self):
        return self.hash is not None


class Reservation:
    """Pinned prefix copies (root first) plus a count of fresh capacity units."""

    def __init__(self, prefix, fresh):
        self.prefix = prefix  # list of (hash, BlockCopy)
        self.fresh = fresh


class BlockPool:
    """Capacity = copies + reserved + free.  Cached copies with refs == pins == 0 sit in
    the inactive LRU (head evicted first).  A hash may have several physical copies:
    ``by_hash[h][0]`` is the primary used by prefix lookups, the rest are duplicates in
    creation order (the oldest duplicate is promoted when the primary goes away)."""

    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.free = capacity
        self.reserved = 0
        self.copies = {}  # copy_id -> BlockCopy
        self.by_hash = {}  # hash -> [BlockCopy, ...]
        self.lru = OrderedDict()  # copy_id -> BlockCopy, first item = eviction head
        self.next_copy_id = 0

    # -- queries ---------------------------------------------------------------------------
    def num_active(self):
        return len(self.copies) - len(self.lru) + self.reserved

    def num_inactive(self):
        return len(self.lru)

    def primary(self, block_hash):
        copies = self.by_hash.get(block_hash)
        return copies[0] if copies else None

    def is_inactive(self, copy):
        return copy.is_cached and copy.refs == 0 and copy.pins == 0

    # -- reservation -------------------------------------------------------------------------
    def reserve(self, prefix_hashes, fresh):
        """Atomically pin ``prefix_hashes`` (must be resident) and reserve ``fresh`` units.

        Returns (Reservation, removed_hashes) or None when capacity is exhausted; a
        failure changes nothing.  Free capacity is used before evicting; an evicted
        hash is reported only when its last physical copy goes.
        """
        hits = []
        for block_hash in prefix_hashes:
            copy = self.primary(block_hash)
            if copy is None:
                raise AssertionError("authorized prefix hash %d is no longer resident" % block_hash)
            hits.append((block_hash, copy))
        needed_evictions = max(0, fresh - self.free)
        if needed_evictions > 0:
            # Pinning an inactive hit takes it out of the LRU, so it cannot be evicted
            # for this same reservation.
            inactive_hits = {copy.copy_id for _, copy in hits if self.is_inactive(copy)}
            if needed_evictions > len(self.lru) - len(inactive_hits):
                return None
        for _, copy in hits:
            self._pin(copy)
        self.free -= fresh - needed_evictions
        removed = []
        for _ in range(needed_evictions):
            evicted_hash = self._evict_one()
            if evicted_hash is not None:
                removed.append(evicted_hash)
        self.reserved += fresh
        return Reservation(hits, fresh), removed

    def _pin(self, copy):
        if self.is_inactive(copy):
            del self.lru[copy.copy_id]
        copy.pins += 1

    def _unpin(self, copy):
        copy.pins -= 1
        if copy.pins == 0 and copy.refs == 0:
            self.lru[copy.copy_id] = copy

    def _evict_one(self):
        copy_id, copy = self.lru.popitem(last=False)
        del self.copies[copy_id]
        copies = self.by_hash[copy.hash]
        copies.remove(copy)
        if not copies:
            del self.by_hash[copy.hash]
            return copy.hash
        return None

    def activate_prefix(self, reservation):
        """Turn the reservation's prefix pins into request references (root first)."""
        prefix = reservation.prefix
        reservation.prefix = []
        for _, copy in prefix:
            copy.pins -= 1
            copy.refs += 1
        return prefix

    def allocate_private(self, reservation):
        if reservation.fresh <= 0:
            raise AssertionError("reservation has no fresh capacity")
        reservation.fresh -= 1
        self.reserved -= 1
        copy = BlockCopy(self.next_copy_id)
        self.next_copy_id += 1
        self.copies[copy.copy_id] = copy
        return copy

    def cache_private(self, copy, block_hash):
        """Make a computed private copy cache-visible; True if it is the first copy of the hash."""
        if copy.is_cached:
            raise AssertionError("only a private copy can enter the prefix cache")
        copy.hash = block_hash
        copy.refs = 1
        copy.pins = 0
        if block_hash in self.by_hash:
            self.by_hash[block_hash].append(copy)
            return False
        self.by_hash[block_hash] = [copy]
        return True

    def release(self, copy):
        """Drop one request reference: private copies free capacity now, cached copies
        enter the LRU tail when unreferenced and unpinned."""
        if not copy.is_cached:
            del self.copies[copy.copy_id]
            self.free += 1
            return
        copy.refs -= 1
        if copy.refs < 0:
            raise AssertionError("cached-copy reference underflow")
        if copy.refs == 0 and copy.pins == 0:
            self.lru[copy.copy_id] = copy

    def cancel(self, reservation):
        """Return unconsumed capacity; unpin the prefix in reverse so leaves age first."""
        for _, copy in reversed(reservation.prefix):
            self._unpin(copy)
        reservation.prefix = []
        self.reserved -= reservation.fresh
        self.free += reservation.fresh
        reservation.fresh = 0


# ================================================================================================
# Request state (engine.md 4.2, 5.1)
# ================================================================================================
WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"


class LeaseEntry:
    """One block of the request's current sequence (the last one may be partial)."""

    def __init__(self, seq_hash):
        self.seq_hash = seq_hash  # None for a partial / not yet finalized block
        self.copy = None  # physical BlockCopy or None
        self.pending_cache = False  # fresh full block that becomes visible once computed


class Request:
    def __init__(self, request_id, prompt_tokens, max_output_tokens, block_size, uuid_int,
                 waiting_order, output_token_ids=None):
        self.request_id = request_id
        self.uuid_int = uuid_int
        self.prompt_len = len(prompt_tokens)
        self.tokens = list(prompt_tokens)
        # Effective output budget (the rank applies planned-output length and the TRT-LLM
        # clamp before constructing the request).
        self.max_output_tokens = max_output_tokens
        self.planned_output = list(output_token_ids) if output_token_ids is not None else None
        self.generated = 0
        self.block_size = block_size
        # Complete prompt blocks carry their identity from the start; a partial tail has none.
        self.entries = []
        parent = None
        for start in range(0, self.prompt_len, block_size):
            block = self.tokens[start:start + block_size]
            if len(block) == block_size:
                local = local_block_hash(block)
                seq_hash = local if parent is None else chained_block_hash(parent, local)
                self.entries.append(LeaseEntry(seq_hash))
                parent = seq_hash
            else:
                self.entries.append(LeaseEntry(None))
        self.allocated_tokens = 0
        self.status = WAITING
        self.num_computed = 0
        self.num_preemptions = 0
        self.cached_prefix_tokens = None  # admission truth, set once
        self.cached_tokens_signaled = False
        self.waiting_order = waiting_order

    @property
    def length(self):
        return len(self.tokens)

    def known_blocks(self):
        return -(-self.length // self.block_size)

    def next_output_token(self):
        if self.planned_output is not None and self.generated < len(self.planned_output):
            return self.planned_output[self.generated]
        return synthetic_output_token(self.uuid_int, self.generated)

    def append_token(self, token):
        # A token that starts a new block opens a new partial lease entry.
        if self.length % self.block_size == 0:
            self.entries.append(LeaseEntry(None))
        self.tokens.append(token)
        self.generated += 1

    def block_tokens(self, index):
        return self.tokens[index * self.block_size:(index + 1) * self.block_size]

    def take_cached_tokens_for_signal(self):
        """Admission cache truth rides only on the request's first output."""
        if self.cached_tokens_signaled:
            return None
        self.cached_tokens_signaled = True
        return self.cached_prefix_tokens


class PrefillCost:
    def __init__(self, new_blocks, new_tokens, cached_tokens, active_cached_tokens):
        self.new_blocks = new_blocks
        self.new_tokens = new_tokens
        self.cached_tokens = cached_tokens
        self.active_cached_tokens = active_cached_tokens

    def __repr__(self):
        return "PrefillCost(new_blocks=%d, new_tokens=%d, cached=%d, active_cached=%d)" % (
            self.new_blocks, self.new_tokens, self.cached_tokens, self.active_cached_tokens)


# ================================================================================================
# Rank configuration (engine.md 1)
# ================================================================================================
class RankConfig:
    DEFAULT_BLOCK_SIZE = {"vllm": 64, "trtllm": 32}

    def __init__(self, backend="vllm", block_size=None, num_gpu_blocks=16384, max_num_seqs=256,
                 max_num_batched_tokens=8192, enable_prefix_caching=True,
                 enable_chunked_prefill=True, preemption_mode="lifo", max_model_len=None,
                 timing_model=None, speedup_ratio=1.0, decode_speedup_ratio=1.0,
                 emit_kv_events=False):
        if backend not in self.DEFAULT_BLOCK_SIZE:
            raise ValueError("oracle supports vllm and trtllm only, got %r" % backend)
        if preemption_mode not in ("lifo", "fifo"):
            raise ValueError("preemption_mode must be lifo or fifo")
        self.backend = backend
        self.block_size = block_size if block_size is not None else self.DEFAULT_BLOCK_SIZE[backend]
        if self.block_size < 2:
            raise ValueError("vLLM/TRT-LLM block_size must be >= 2")
        self.num_gpu_blocks = num_gpu_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.max_model_len = max_model_len
        self.timing = TimingModel(timing_model)
        self.speedup_ratio = speedup_ratio
        self.decode_speedup_ratio = decode_speedup_ratio
        self.emit_kv_events = emit_kv_events

    @property
    def is_trtllm(self):
        return self.backend == "trtllm"

    @classmethod
    def from_rank_json(cls, rank):
        known = {"backend", "block_size", "num_gpu_blocks", "max_num_seqs",
                 "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
                 "preemption_mode", "max_model_len", "timing_model", "speedup_ratio",
                 "decode_speedup_ratio", "emit_kv_events", "worker_type",
                 "prefill_schedule_interval", "trtllm"}
        unknown = set(rank) - known
        if unknown:
            raise ValueError("rank fields not modeled by the oracle: %s" % sorted(unknown))
        if rank.get("worker_type", "aggregated") != "aggregated":
            raise ValueError("oracle models aggregated workers only")
        if rank.get("prefill_schedule_interval", 1) != 1:
            raise ValueError("prefill_schedule_interval only matters with attention DP")
        trtllm = rank.get("trtllm") or {}
        if trtllm.get("capacity_scheduler_policy", "guaranteed_no_evict") != "guaranteed_no_evict":
            raise ValueError("TRT-LLM supports only guaranteed_no_evict")
        kwargs = {k: v for k, v in rank.items()
                  if k not in ("worker_type", "prefill_schedule_interval", "trtllm")}
        return cls(**kwargs)


# ================================================================================================
# One rank: vLLM core with the vLLM or TRT-LLM (guaranteed-no-evict) policy
# ================================================================================================
SCHEDULED = "scheduled"
BLOCKED = "blocked"
CURRENT_PREEMPTED = "current_preempted"


class ScheduledWork:
    def __init__(self, total_tokens, prompt_tokens, prefix_tokens, prompt_len, sequence_len,
                 terminal_after_schedule):
        self.total_tokens = total_tokens
        self.prompt_tokens = prompt_tokens
        self.prefix_tokens = prefix_tokens
        self.prompt_len = prompt_len
        self.sequence_len = sequence_len
        self.terminal_after_schedule = terminal_after_schedule


class Output:
    def __init__(self, request_id, token_id, completed, rejected, cached_tokens):
        self.request_id = request_id
        self.token_id = token_id
        self.completed = completed
        self.rejected = rejected
        self.cached_tokens = cached_tokens

    def __repr__(self):
        return "Output(%r, token=%r, completed=%r, rejected=%r, cached=%r)" % (
            self.request_id, self.token_id, self.completed, self.rejected, self.cached_tokens)


class PassResult:
    """Everything one ``execute_pass`` produced.  The core mutates eagerly; admissions are
    visible at ``start_ms`` and outputs at ``end_ms``."""

    def __init__(self, start_ms):
        self.start_ms = start_ms
        self.end_ms = start_ms
        self.admissions = []  # (request_id, reused_input_tokens) in admission order
        self.preempted = []  # request ids, in preemption order
        self.pressure_events = []  # one dict per preemption (engine.md 5.5)
        self.outputs = []  # Output, in emission order
        self.scheduled = {}  # request_id -> ScheduledWork (victims removed)
        self.prefill_ms = 0.0
        self.decode_ms = 0.0
        self.decode_batch = []  # request ids charged in the decode time

    def fpm(self):
        """ForwardPassMetrics counters of engine.md 9.2 (only the ones the trace uses)."""
        prefill = [w for w in self.scheduled.values() if w.prompt_tokens > 0]
        decode = [w for w in self.scheduled.values()
                  if w.prompt_tokens == 0 and not w.terminal_after_schedule]
        return {
            "num_prefill_requests": len(prefill),
            "sum_prefill_tokens": sum(w.total_tokens for w in prefill),
            "sum_prefill_kv_tokens": sum(w.prefix_tokens for w in prefill),
            "num_decode_requests": len(decode),
            "sum_decode_kv_tokens": sum(w.sequence_len for w in decode),
        }

    def has_effects(self):
        """A pass the replay treats as progress (an effect-free zero-duration pass is not)."""
        fpm = self.fpm()
        return (self.end_ms > self.start_ms or bool(self.admissions) or bool(self.preempted)
                or bool(self.outputs) or fpm["num_prefill_requests"] > 0
                or fpm["num_decode_requests"] > 0)


class PassContext:
    """Mutable per-pass bookkeeping shared by the running and waiting loops."""

    def __init__(self, now_ms, budget):
        self.now_ms = now_ms
        self.budget = budget
        self.scheduled = {}
        self.batch_count = 0
        self.batch_total_isl = 0
        self.batch_total_prefix = 0
        self.preempted_any = False
        self.result = PassResult(now_ms)


class Rank:
    def __init__(self, config):
        self.config = config
        self.bs = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks)
        self.requests = {}  # request_id -> Request (owned by the queues)
        self.waiting = []  # FIFO; preempted requests go to the front
        self.running = []  # admission order
        self.next_waiting_order = 0
        self.next_uuid = 1
        self.preemptions_total = 0
        self.kv_events = []  # only with config.emit_kv_events

    # ------------------------------------------------------------------------------------------
    # Commands
    # ------------------------------------------------------------------------------------------
    def submit(self, request_id, prompt_tokens, max_output_tokens, output_token_ids=None,
               uuid_int=None):
        """Submit: append to the waiting queue.  ``uuid_int`` seeds the synthetic output
        tokens (default: submission ordinal from 1); ``output_token_ids`` plans them."""
        if request_id in self.requests:
            raise ValueError("request %r is already active" % (request_id,))
        if uuid_int is None:
            uuid_int = self.next_uuid
        self.next_uuid = max(self.next_uuid, uuid_int) + 1
        if output_token_ids is not None:
            # A planned output list fixes the generation length (engine.md 2).
            max_output_tokens = len(output_token_ids)
        max_output_tokens = self._normalize_max_output(len(prompt_tokens), max_output_tokens)
        request = Request(request_id, prompt_tokens, max_output_tokens, self.bs, uuid_int,
                          self.next_waiting_order, output_token_ids)
        self.next_waiting_order += 1
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def _normalize_max_output(self, prompt_len, max_output):
        # TRT-LLM enqueue clamp: prompt + output can reserve at most the whole pool.  A
        # prompt that alone fills the pool is left unclamped and is rejected later.
        if not self.config.is_trtllm:
            return max_output
        capacity_tokens = self.config.num_gpu_blocks * self.bs
        if prompt_len >= capacity_tokens:
            return max_output
        return min(max_output, capacity_tokens - prompt_len)

    def is_ready(self):
        return bool(self.running) or bool(self.waiting)

    def cancel(self, request_id):
        """CancelRequest: drop a queued or running request and release its KV.
        Returns True when applied, False (no-op) for an unknown id."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.release_lease(request)
        del self.requests[request_id]
        return True

    def check_invariants(self):
        """Pool accounting and lease/queue consistency; raises AssertionError."""
        pool = self.pool
        assert pool.capacity == len(pool.copies) + pool.reserved + pool.free, "capacity drift"
        assert pool.reserved == 0, "reservation leaked past a scheduling decision"
        for copy_id, copy in pool.lru.items():
            assert pool.is_inactive(copy) and pool.copies[copy_id] is copy
        refs = {}
        for request in self.requests.values():
            for entry in request.entries:
                if entry.copy is not None:
                    refs[entry.copy.copy_id] = refs.get(entry.copy.copy_id, 0) + 1
        for copy_id, copy in pool.copies.items():
            expected = refs.get(copy_id, 0)
            if copy.is_cached:
                assert copy.refs == expected and copy.pins == 0, "refcount drift"
            else:
                assert expected == 1, "private copy must have exactly one owner"
        queued = self.waiting + self.running
        assert len(queued) == len(set(map(id, queued))) == len(self.requests)
        for request in self.running:
            assert request.status == RUNNING
            assert request.num_computed <= request.allocated_tokens <= request.length
        for request in self.waiting:
            assert request.status != RUNNING

    # ------------------------------------------------------------------------------------------
    # Policy helpers (engine.md 5.2, 6)
    # ------------------------------------------------------------------------------------------
    def remaining_generation(self, request, use_model_len=True):
        remaining = max(0, request.max_output_tokens - request.generated)
        if use_model_len and self.config.max_model_len is not None:
            remaining = min(remaining, max(0, self.config.max_model_len - request.length))
        return remaining

    def generation_complete(self, request, use_model_len=True):
        return self.remaining_generation(request, use_model_len) == 0

    def to_completion_blocks(self, request):
        output = request.max_output_tokens
        if self.config.is_trtllm and self.config.max_model_len is not None:
            # TRT-LLM reserves through the realizable output under max_model_len.
            output = min(output, max(0, self.config.max_model_len - request.prompt_len))
        return -(-(request.prompt_len + output) // self.bs)

    def prefill_cost(self, request):
        """Prefix lookup (engine.md 4.4): walk blocks from 0 until an unhashed or
        non-resident block.  Does not touch LRU order."""
        overlap = 0
        active_overlap = 0
        if self.config.enable_prefix_caching:
            for entry in request.entries:
                if entry.seq_hash is None:
                    break
                copy = self.pool.primary(entry.seq_hash)
                if copy is None:
                    break
                overlap += 1
                if copy.refs > 0 or copy.pins > 0:
                    active_overlap += 1
        cached = min(overlap * self.bs, request.length)
        active_cached = min(active_overlap * self.bs, request.length)
        return PrefillCost(len(request.entries) - overlap, request.length - cached, cached,
                           active_cached)

    def apply_prefix_recompute(self, request, cost, requires_logits):
        """vLLM only: a request that still needs logits recomputes at least its last
        token, and block-granular allocation turns that into the last cached block."""
        if not requires_logits or self.config.is_trtllm:
            return cost
        max_cached = ((request.length - 1) // self.bs) * self.bs if request.length > 0 else 0
        if cost.cached_tokens > max_cached:
            recompute = cost.cached_tokens - max_cached
            return PrefillCost(cost.new_blocks + recompute // self.bs,
                               cost.new_tokens + recompute, max_cached,
                               min(cost.active_cached_tokens, max_cached))
        return cost

    def blocks_needed_to_finish(self, request, cost=None):
        """TRT-LLM: completion footprint minus what the request already holds (or, before
        its first allocation, minus its active cached prefix)."""
        full = self.to_completion_blocks(request)
        if request.allocated_tokens == 0:
            if cost is None:
                cost = self.prefill_cost(request)
            return max(0, full - cost.active_cached_tokens // self.bs)
        return max(0, full - (-(-request.allocated_tokens // self.bs)))

    def decide_waiting_admission(self, request):
        """Returns ("admit", cost), ("wait", None) or ("reject", None) (engine.md 5.3, 6)."""
        c = self.config.num_gpu_blocks
        is_fresh = request.status == WAITING
        if is_fresh:
            if self.config.is_trtllm:
                if self.to_completion_blocks(request) > c:
                    return "reject", None
            elif request.known_blocks() > c:
                return "reject", None
        # The logits requirement here ignores max_model_len (policy.rs passes None).
        cost = self.apply_prefix_recompute(
            request, self.prefill_cost(request),
            requires_logits=not self.generation_complete(request, use_model_len=False))
        if self.config.is_trtllm:
            reserved = sum(self.blocks_needed_to_finish(r) for r in self.running)
            available = max(0, max(0, c - self.pool.num_active()) - reserved)
            needed = self.blocks_needed_to_finish(request, cost)
        else:
            # Inactive cached hits count as available, so only blocks already referenced
            # by running requests are discounted.
            available = max(0, c - self.pool.num_active())
            needed = max(0, request.known_blocks() - cost.active_cached_tokens // self.bs)
        if needed > available:
            return "wait", None
        return "admit", cost

    # ------------------------------------------------------------------------------------------
    # KV lease operations (engine.md 4.5-4.7, kv_manager/vllm_backend.rs)
    # ------------------------------------------------------------------------------------------
    def allocate(self, request, target_tokens, reusable_prefix_blocks):
        """Grow the lease to cover ``target_tokens``.  False (and no change) on exhaustion."""
        n_entries = len(request.entries)
        previous_blocks = min(-(-request.allocated_tokens // self.bs), n_entries)
        target_blocks = min(-(-target_tokens // self.bs), n_entries)
        if target_blocks <= previous_blocks:
            request.allocated_tokens = max(request.allocated_tokens, target_tokens)
            return True
        newly_reusable = max(0, reusable_prefix_blocks - previous_blocks)
        count = target_blocks - previous_blocks
        if newly_reusable > count:
            raise AssertionError("reusable prefix exceeds the newly allocated block range")
        prefix_hashes = [request.entries[i].seq_hash
                         for i in range(previous_blocks, previous_blocks + newly_reusable)]
        outcome = self.pool.reserve(prefix_hashes, count - newly_reusable)
        if outcome is None:
            return False
        reservation, removed = outcome
        if removed:
            self._publish({"type": "removed", "blocks": removed})
        prefix = self.pool.activate_prefix(reservation)
        for offset, position in enumerate(range(previous_blocks, target_blocks)):
            entry = request.entries[position]
            if offset < len(prefix):
                entry.copy = prefix[offset][1]
                entry.pending_cache = False
            else:
                entry.copy = self.pool.allocate_private(reservation)
                # A fresh full block with a known identity becomes visible once computed.
                entry.pending_cache = (entry.seq_hash is not None
                                       and self.config.enable_prefix_caching)
        self.pool.cancel(reservation)  # nothing left; keeps the accounting explicit
        request.allocated_tokens = target_tokens
        return True

    def finalize_computed(self, request, computed_before, computed_after):
        """Blocks completed by this scheduling decision become cache-visible now, so later
        requests of the same pass can hit them (engine.md 4.6)."""
        first = computed_before // self.bs
        completed = min(computed_after // self.bs, len(request.entries))
        group = None  # pending Stored event: [parent_hash, [hashes]]
        for position in range(first, completed):
            entry = request.entries[position]
            parent = request.entries[position - 1].seq_hash if position > 0 else None
            if entry.seq_hash is None:
                local = local_block_hash(request.block_tokens(position))
                entry.seq_hash = local if parent is None else chained_block_hash(parent, local)
                entry.pending_cache = self.config.enable_prefix_caching
            if not entry.pending_cache:
                group = self._flush_store_group(group)
                continue
            entry.pending_cache = False
            if entry.copy is None:
                raise AssertionError("computed block must have a physical copy")
            became_visible = self.pool.cache_private(entry.copy, entry.seq_hash)
            if became_visible:
                if group is None:
                    group = [parent, []]
                group[1].append(entry.seq_hash)
            else:
                group = self._flush_store_group(group)
        self._flush_store_group(group)

    def _flush_store_group(self, group):
        if group is not None and group[1]:
            self._publish({"type": "stored", "parent": group[0], "blocks": group[1]})
        return None

    def _publish(self, event):
        if self.config.emit_kv_events and self.config.enable_prefix_caching:
            self.kv_events.append(event)

    def release_lease(self, request):
        """Finish / cancel / preempt: release entries tail first; identities stay."""
        for entry in reversed(request.entries):
            if entry.copy is not None:
                self.pool.release(entry.copy)
                entry.copy = None
            entry.pending_cache = False
        request.allocated_tokens = 0

    # ------------------------------------------------------------------------------------------
    # Preemption (engine.md 5.5)
    # ------------------------------------------------------------------------------------------
    def preempt_victim(self, ctx):
        if self.config.is_trtllm:
            # GUARANTEED_NO_EVICT never preempts; the allocation is simply Blocked.
            return None
        if not self.running:
            return None
        if self.config.preemption_mode == "lifo":
            victim = self.running[-1]
        else:
            victim = self.running[0]
        before = (len(self.running), len(self.waiting), self.pool.num_active())
        victim_blocks = -(-victim.allocated_tokens // self.bs)
        # Removed in place: the running loop walks by index, so removing an earlier
        # element shifts the next request onto the cursor (it is skipped this pass).
        self.running.remove(victim)
        victim.status = PREEMPTED
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.preemptions_total += 1
        self.waiting.insert(0, victim)
        self.release_lease(victim)
        ctx.result.preempted.append(victim.request_id)
        ctx.result.pressure_events.append({
            "at_ms": ctx.now_ms,
            "request_id": victim.request_id,
            "running_before": before[0], "running_after": len(self.running),
            "waiting_before": before[1], "waiting_after": len(self.waiting),
            "active_blocks_before": before[2], "active_blocks_after": self.pool.num_active(),
            "request_active_blocks_before": victim_blocks,
            "logical_available_blocks_before": None, "required_blocks_before": None,
        })
        return victim

    # ------------------------------------------------------------------------------------------
    # schedule_request (engine.md 5.4)
    # ------------------------------------------------------------------------------------------
    def schedule_request(self, request, from_waiting, cost, ctx):
        if request.num_computed == 0:
            if cost is not None:
                cached = cost.cached_tokens
            else:
                # A running request with nothing computed re-probes the cache.
                cached = self.apply_prefix_recompute(
                    request, self.prefill_cost(request),
                    requires_logits=not self.generation_complete(request)).cached_tokens
        else:
            cached = 0
        before = request.num_computed + cached
        prompt_len = request.prompt_len
        prompt_before = min(before, prompt_len)
        remaining_known = max(0, request.length - before)
        prompt_remaining = prompt_len - prompt_before
        if (prompt_remaining > 0 and not self.config.enable_chunked_prefill
                and prompt_remaining > ctx.budget):
            return BLOCKED, 0
        desired = min(remaining_known, ctx.budget)
        if desired == 0 and remaining_known > 0:
            return BLOCKED, 0
        target = before + desired
        actual_after = target
        while True:
            if target > request.allocated_tokens:
                if self.allocate(request, target, cached // self.bs):
                    request.num_computed = actual_after
                    break
            else:
                request.num_computed = actual_after
                break
            victim = self.preempt_victim(ctx)
            if victim is None:
                actual_after = before
                break
            ctx.preempted_any = True
            undone = ctx.scheduled.pop(victim.request_id, None)
            if undone is not None:
                # The victim was scheduled earlier in this pass: give its work back.
                ctx.budget += undone.total_tokens
                if undone.prompt_tokens > 0:
                    ctx.batch_count -= 1
                    ctx.batch_total_isl -= undone.prefix_tokens + undone.prompt_tokens
                    ctx.batch_total_prefix -= undone.prefix_tokens
            if victim is request:
                return CURRENT_PREEMPTED, 0
        tokens_used = actual_after - before
        if tokens_used == 0 and actual_after < request.length:
            return BLOCKED, 0

        self.finalize_computed(request, before, actual_after)

        prompt_after = min(actual_after, prompt_len)
        prompt_tokens = prompt_after - prompt_before
        ctx.scheduled[request.request_id] = ScheduledWork(
            tokens_used, prompt_tokens, prompt_before, prompt_len, request.length,
            self.generation_complete(request))
        if prompt_tokens > 0:
            ctx.batch_count += 1
            ctx.batch_total_isl += prompt_before + prompt_tokens
            ctx.batch_total_prefix += prompt_before
        if from_waiting:
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RUNNING
        ctx.budget = max(0, ctx.budget - tokens_used)
        if from_waiting:
            if request.cached_prefix_tokens is None:
                request.cached_prefix_tokens = cached
            ctx.result.admissions.append((request.request_id, cached))
        return SCHEDULED, tokens_used

    # ------------------------------------------------------------------------------------------
    # One pass (engine.md 5.6)
    # ------------------------------------------------------------------------------------------
    def execute_pass(self, now_ms):
        ctx = PassContext(now_ms, self.config.max_num_batched_tokens)
        result = ctx.result

        # Running loop: walk by index; Blocked stops it, CurrentPreempted keeps the index.
        index = 0
        while index < len(self.running) and ctx.budget > 0:
            outcome, _ = self.schedule_request(self.running[index], False, None, ctx)
            if outcome == SCHEDULED:
                index += 1
            elif outcome == BLOCKED:
                break

        # Waiting loop: strict FIFO head, only if nothing was preempted in this pass.
        rejected = []
        while not ctx.preempted_any and len(self.running) < self.config.max_num_seqs:
            if not self.waiting:
                break
            request = self.waiting[0]
            if (self.config.max_model_len is not None
                    and request.prompt_len >= self.config.max_model_len):
                decision, cost = "reject", None
            else:
                decision, cost = self.decide_waiting_admission(request)
            if decision == "wait":
                break
            if decision == "reject":
                self.waiting.remove(request)
                self.release_lease(request)
                del self.requests[request.request_id]
                rejected.append(request.request_id)
                continue
            outcome, tokens_used = self.schedule_request(request, True, cost, ctx)
            if outcome != SCHEDULED:
                break
            if tokens_used == 0 and ctx.budget == 0:
                break

        # Prefill time from the floored batch means (engine.md 8.2).
        if ctx.batch_count > 0:
            mean_isl = ctx.batch_total_isl // ctx.batch_count
            mean_prefix = ctx.batch_total_prefix // ctx.batch_count
        else:
            mean_isl = mean_prefix = 0
        raw_prefill = self.config.timing.predict_prefill_ms(ctx.batch_count, mean_isl, mean_prefix)
        prefill_ms = modeled_duration_ms(raw_prefill, self.config.speedup_ratio)
        decode_start = now_ms + prefill_ms

        # Emit tokens (engine.md 5.6 step 6).
        ready = []
        already_complete = []
        for request in self.running:
            if request.num_computed < request.length:
                continue  # mid-prefill
            if self.generation_complete(request):
                already_complete.append(request)
            else:
                ready.append(request)
        for request in already_complete:
            cached_signal = request.take_cached_tokens_for_signal()
            self._complete(request)
            result.outputs.append(Output(request.request_id, None, True, False, cached_signal))

        # Decode batch: ready requests except a first token produced by the pass that
        # computed the prompt.  A recomputed preempted request has generated tokens and
        # counts (engine.md 14.2 item 1).
        decode_batch = []
        for request in ready:
            work = ctx.scheduled.get(request.request_id)
            if work is not None and work.prompt_tokens > 0 and request.generated == 0:
                continue
            decode_batch.append(request)
        total_kv = self.config.num_gpu_blocks * self.bs
        active_kv = sum(request.length for request in decode_batch)
        raw_decode = self.config.timing.predict_decode_ms(len(decode_batch), active_kv, total_kv)
        decode_ms = modeled_duration_ms(
            raw_decode, self.config.speedup_ratio * self.config.decode_speedup_ratio)
        end_ms = decode_start + decode_ms

        for request in ready:
            # The sampled token's KV is allocated when it is computed in the next pass.
            request.append_token(request.next_output_token())
            completed = self.generation_complete(request)
            cached_signal = request.take_cached_tokens_for_signal()
            if completed:
                self._complete(request)
            result.outputs.append(Output(request.request_id, request.tokens[-1], completed, False,
                                         cached_signal))
        for request_id in rejected:
            result.outputs.append(Output(request_id, None, True, True, None))

        result.end_ms = end_ms
        result.prefill_ms = prefill_ms
        result.decode_ms = decode_ms
        result.decode_batch = [request.request_id for request in decode_batch]
        result.scheduled = ctx.scheduled
        return result

    def _complete(self, request):
        self.running.remove(request)
        self.release_lease(request)
        del self.requests[request.request_id]


# ================================================================================================
# Mooncake trace loading (replay.md 3.1)
# ================================================================================================
class Turn:
    def __init__(self, line_number, input_length, output_length, hash_ids, delay_ms):
        self.line_number = line_number  # 1-based file line
        self.input_length = input_length
        self.output_length = output_length
        self.hash_ids = hash_ids  # interned ids
        self.delay_ms = delay_ms  # think time after the previous turn completes


class Session:
    def __init__(self, session_id, start_ms):
        self.session_id = session_id
        self.start_ms = start_ms  # None when the first row has no timestamp
        self.turns = []


def _first_present(row, *names):
    present = [name for name in names if row.get(name) is not None]
    if len(present) > 1:
        raise ValueError("row sets both %s" % " and ".join(present))
    return row[present[0]] if present else None


def load_mooncake(path, trace_block_size=512, arrival_speedup_ratio=1.0):
    """Sessions in first-appearance order; hash ids interned densely in file order."""
    if not (arrival_speedup_ratio > 0):
        raise ValueError("arrival_speedup_ratio must be finite and > 0")
    sessions = []
    by_id = {}
    last_timestamp = {}
    interned = {}
    with open(path, encoding="utf-8") as fh:
        for line_index, line in enumerate(fh):
            if not line.strip():
                continue  # blank lines still count for line numbers
            row = json.loads(line)
            line_number = line_index + 1
            session_id = row.get("session_id") or "request_%d" % line_number
            hash_ids = row.get("hash_ids")
            if not hash_ids:
                raise ValueError("trace line %d is missing hash_ids" % line_number)
            capacity = len(hash_ids) * trace_block_size
            input_length = _first_present(row, "input_length", "input_tokens")
            if input_length is None:
                input_length = capacity
            if input_length > capacity:
                raise ValueError("trace line %d input_length %d exceeds hash_ids capacity %d"
                                 % (line_number, input_length, capacity))
            output_length = _first_present(row, "output_length", "output_tokens")
            if output_length is None:
                raise ValueError("trace line %d is missing output_length" % line_number)
            timestamp = _first_present(row, "timestamp", "created_time")
            timestamp = float(timestamp) if timestamp is not None else None
            delay = _first_present(row, "delay", "delay_ms")
            delay = float(delay) if delay is not None else None
            if session_id not in by_id:
                session = Session(session_id, timestamp)
                by_id[session_id] = session
                sessions.append(session)
                last_timestamp[session_id] = timestamp
            session = by_id[session_id]
            if not session.turns:
                if delay not in (None, 0.0):
                    raise ValueError("trace line %d sets delay on a first turn" % line_number)
                delay_ms = 0.0
            elif delay is not None:
                delay_ms = delay
            elif timestamp is not None:
                if last_timestamp[session_id] is None:
                    raise ValueError("trace line %d cannot infer delay" % line_number)
                delay_ms = timestamp - last_timestamp[session_id]
            else:
                delay_ms = 0.0
            if not (delay_ms >= 0.0) or delay_ms == float("inf"):
                raise ValueError("trace line %d has invalid delay %r" % (line_number, delay_ms))
            ids = []
            for hash_id in hash_ids:
                if hash_id not in interned:
                    interned[hash_id] = len(interned)
                ids.append(interned[hash_id])
            session.turns.append(Turn(line_number, input_length, output_length, ids, delay_ms))
            if timestamp is not None:
                last_timestamp[session_id] = timestamp
    if not sessions:
        raise ValueError("trace %s has no requests" % path)
    starts = [s.start_ms for s in sessions if s.start_ms is not None]
    if starts:
        first = min(starts)
        for session in sessions:
            if session.start_ms is not None:
                session.start_ms = session.start_ms - first
    for session in sessions:
        if session.start_ms is not None:
            session.start_ms = session.start_ms / arrival_speedup_ratio
        for turn in session.turns:
            turn.delay_ms = turn.delay_ms / arrival_speedup_ratio
    return sessions


def synthesize_prompt(turn, trace_block_size):
    """Each hash id becomes up to ``trace_block_size`` copies of its interned id."""
    tokens = []
    for hash_id in turn.hash_ids:
        take = min(trace_block_size, turn.input_length - len(tokens))
        tokens.extend([hash_id] * take)
        if len(tokens) == turn.input_length:
            break
    return tokens


# ================================================================================================
# Workload driver: sessions, open/closed loop (replay.md 2, loadgen/driver.rs)
# ================================================================================================
class WorkloadDriver:
    """Releases turns: ready sessions are ordered by (ready time, session index, turn).
    A later turn becomes ready ``delay`` after the previous turn's terminal.  In closed
    loop at most ``concurrency`` sessions are active (depth first, in trace order).

    Like the reference, ready sessions sit in a min-heap; an entry is acted on only if
    it still matches the session's current (turn, ready time)."""

    def __init__(self, sessions, concurrency=None):
        self.sessions = sessions
        self.concurrency = concurrency
        self.next_turn = [0] * len(sessions)
        self.ready_at = [None] * len(sessions)
        self.ready_heap = []  # (ready_ms, session index, turn index)
        self.in_flight = {}  # uuid -> session index
        self.active_sessions = 0
        self.next_pending_session = 0
        # canonical_v1 UUIDs: ordinal over sessions then turns, starting at 1.
        self.uuid_of = {}
        ordinal = 1
        for s_index, session in enumerate(sessions):
            for t_index in range(len(session.turns)):
                self.uuid_of[(s_index, t_index)] = ordinal
                ordinal += 1
        if concurrency is None:
            for s_index, session in enumerate(sessions):
                start = session.start_ms if session.start_ms is not None else 0.0
                self._make_ready(s_index, start)
        else:
            if concurrency <= 0:
                raise ValueError("replay_concurrency must be > 0")
            self._activate_pending(0.0)

    def _make_ready(self, s_index, ready_ms):
        self.ready_at[s_index] = ready_ms
        heapq.heappush(self.ready_heap, (ready_ms, s_index, self.next_turn[s_index]))

    def _activate_pending(self, now_ms):
        while (self.active_sessions < self.concurrency
               and self.next_pending_session < len(self.sessions)):
            self._make_ready(self.next_pending_session, now_ms)
            self.next_pending_session += 1
            self.active_sessions += 1

    def _is_current(self, entry):
        ready_ms, s_index, t_index = entry
        return self.ready_at[s_index] == ready_ms and self.next_turn[s_index] == t_index

    def _at_capacity(self):
        return self.concurrency is not None and len(self.in_flight) >= self.concurrency

    def next_ready_time(self):
        if self._at_capacity():
            return None
        while self.ready_heap and not self._is_current(self.ready_heap[0]):
            heapq.heappop(self.ready_heap)
        return self.ready_heap[0][0] if self.ready_heap else None

    def pop_ready(self, now_ms):
        """All turns ready at ``now_ms`` in release order: (session, turn, uuid, arrival)."""
        released = []
        while self.ready_heap and not self._at_capacity():
            entry = self.ready_heap[0]
            if not self._is_current(entry):
                heapq.heappop(self.ready_heap)
                continue
            ready_ms, s_index, t_index = entry
            if ready_ms > now_ms:
                break
            heapq.heappop(self.ready_heap)
            uuid_int = self.uuid_of[(s_index, t_index)]
            self.ready_at[s_index] = None
            self.in_flight[uuid_int] = s_index
            # Open loop stamps the scheduled ready time, closed loop the dispatch time.
            arrival = ready_ms if self.concurrency is None else now_ms
            released.append((s_index, t_index, uuid_int, arrival))
        return released

    def on_terminal(self, uuid_int, now_ms):
        s_index = self.in_flight.pop(uuid_int)
        self.next_turn[s_index] += 1
        turns = self.sessions[s_index].turns
        if self.next_turn[s_index] < len(turns):
            self._make_ready(s_index, now_ms + turns[self.next_turn[s_index]].delay_ms)
        elif self.concurrency is not None:
            self.active_sessions -= 1
            self._activate_pending(now_ms)

    def is_drained(self):
        return not self.in_flight and all(
            self.next_turn[i] >= len(s.turns) for i, s in enumerate(self.sessions))


# ================================================================================================
# Per-request collector
# ================================================================================================
class RequestRecord:
    def __init__(self, request_id, turn_index, arrival_ms, input_tokens, requested_output,
                 worker):
        self.request_id = request_id
        self.turn_index = turn_index
        self.arrival_ms = arrival_ms
        self.input_tokens = input_tokens
        self.requested_output = requested_output
        self.worker = worker
        self.admissions = []  # (time, reused tokens)
        self.token_times = []
        self.terminal_ms = None
        self.status = None
        self.tokenized_ms = None  # when its prompt left its worker's tokenization pool

    def as_row(self):
        """One row with the golden CSV column names.  ``cached_tokens`` is the maximum
        reused count over all admissions and is not clamped to the prompt (a re-admitted
        preempted request may reuse its own generated blocks); a never-admitted
        (rejected) request reports 0 for both cached columns.  ``second_token_ms`` is the
        second token's own time (the golden CSV writes first + ttst instead)."""
        tokens = self.token_times
        first = tokens[0] if tokens else None
        second = tokens[1] if len(tokens) > 1 else None
        last = tokens[-1] if tokens else None
        n = len(tokens)
        reused = [r for _, r in self.admissions]
        return {
            "request_id": self.request_id,
            "turn_index": self.turn_index,
            "arrival_ms": self.arrival_ms,
            "first_admit_ms": self.admissions[0][0] if self.admissions else None,
            "first_token_ms": first,
            "second_token_ms": second,
            "last_token_ms": last,
            "completion_ms": self.terminal_ms,
            "ttft_ms": (first - self.arrival_ms) if first is not None else None,
            "tpot_ms": ((last - first) / (n - 1)) if n >= 2 else None,
            "e2e_ms": (last - self.arrival_ms) if last is not None else None,
            "input_tokens": self.input_tokens,
            "output_tokens": n,
            "requested_output_tokens": self.requested_output,
            "cached_tokens": max(reused) if reused else 0,
            "first_admission_cached_tokens": reused[0] if reused else 0,
            "worker": self.worker,
            "admission_count": len(self.admissions),
            "readmission_count": max(0, len(self.admissions) - 1),
            "terminal_status": self.status,
            "tokenized_ms": self.tokenized_ms,
        }


# ================================================================================================
# Aggregated replay event loop (replay.md 1.3, 1.4)
# ================================================================================================
def make_rank(config):
    """Rank factory: a config may name its own rank class (tests/support/oracle_sglang.py)."""
    return getattr(config, "rank_class", Rank)(config)


class Worker:
    def __init__(self, worker_id, config):
        self.worker_id = worker_id
        self.rank = make_rank(config)
        self.pending_end_ms = None  # end time of the pass in flight
        self.pending_result = None
        self.pass_count = 0


_U64 = (1 << 64) - 1


def splitmix64(state):
    """(next state, output) of the splitmix64 generator (random placement)."""
    state = (state + 0x9E3779B97F4A7C15) & _U64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return state, z ^ (z >> 31)


class Replay:
    def __init__(self, rank_config, num_workers, sessions, trace_block_size, concurrency=None,
                 placement="round_robin", placement_seed=0, tokenization=None):
        self.placement = placement
        # a pool of servers ahead of each worker: (servers, base ms, ms per prompt token);
        # each server's next free time per worker, and the requests in the pools
        self.tokenization = tokenization
        self.tok_free = [[0.0] * tokenization[0] for _ in range(num_workers)] if tokenization else None
        self.tokenizing = []  # (tokenized_ms, session index, turn index, worker, uuid, prompt, output)
        self.rng_state = placement_seed
        self.config = rank_config
        self.workers = [Worker(i, rank_config) for i in range(num_workers)]
        self.sessions = sessions
        self.trace_block_size = trace_block_size
        self.driver = WorkloadDriver(sessions, concurrency)
        self.now_ms = 0.0
        self.rr_cursor = 0
        self.records = {}  # uuid -> RequestRecord
        self.passes = []
        self.label = {}  # uuid -> (request_id, turn_index)

    # -- one instant ------------------------------------------------------------------------------
    def _complete_due_passes(self):
        changed = False
        for worker in self.workers:  # ascending worker id = heap order at one instant
            if worker.pending_end_ms is not None and worker.pending_end_ms == self.now_ms:
                result = worker.pending_result
                worker.pending_end_ms = None
                worker.pending_result = None
                self._apply_outputs(result)
                changed = True
        return changed

    def _apply_outputs(self, result):
        for output in result.outputs:
            record = self.records[output.request_id]
            if output.token_id is not None:
                record.token_times.append(self.now_ms)
            if output.completed:
                record.terminal_ms = self.now_ms
                record.status = "rejected" if output.rejected else "completed"
                self.driver.on_terminal(output.request_id, self.now_ms)

    def _release_arrivals(self):
        released = self.driver.pop_ready(self.now_ms)
        for s_index, t_index, uuid_int, arrival in released:
            session = self.sessions[s_index]
            turn = session.turns[t_index]
            if self.placement == "random":
                # uniform over the workers from the seeded generator
                self.rng_state, draw = splitmix64(self.rng_state)
                worker = self.workers[draw % len(self.workers)]
            else:
                # Round robin over workers in arrival order, regardless of load.
                worker = self.workers[self.rr_cursor % len(self.workers)]
                self.rr_cursor += 1
            self.records[uuid_int] = RequestRecord(session.session_id, t_index, arrival,
                                                   turn.input_length, turn.output_length,
                                                   worker.worker_id)
            self.label[uuid_int] = (session.session_id, t_index)
            prompt = synthesize_prompt(turn, self.trace_block_size)
            if self.tokenization:
                # the earliest free server of the worker's pool (the lowest of equal ones)
                free = self.tok_free[worker.worker_id]
                k = min(range(len(free)), key=lambda i: (free[i], i))
                _, base_ms, per_token_ms = self.tokenization
                done = max(arrival, free[k]) + (base_ms + per_token_ms * turn.input_length)
                free[k] = done
                self.records[uuid_int].tokenized_ms = done
                self.tokenizing.append((done, s_index, t_index, worker, uuid_int, prompt, turn.output_length))
                continue
            worker.rank.submit(uuid_int, prompt, turn.output_length, uuid_int=uuid_int)
        return bool(released)

    def _release_tokenized(self):
        """Requests whose prompts are tokenized by now reach their workers' schedulers,
        in (time, session, turn) order."""
        due = sorted((t for t in self.tokenizing if t[0] <= self.now_ms), key=lambda t: t[:3])
        if not due:
            return False
        self.tokenizing = [t for t in self.tokenizing if t[0] > self.now_ms]
        for _, _, _, worker, uuid_int, prompt, output_length in due:
            worker.rank.submit(uuid_int, prompt, output_length, uuid_int=uuid_int)
        return True

    def _drive_workers(self):
        """Start passes on idle workers, lowest id first; a zero-duration pass completes at
        once and its worker is considered again before higher ids."""
        changed = False
        while True:
            started = False
            for worker in self.workers:
                if worker.pending_end_ms is not None or not worker.rank.is_ready():
                    continue
                result = worker.rank.execute_pass(self.now_ms)
                if not result.has_effects():
                    continue  # effect-free zero-duration pass: no state change, try the next
                worker.pass_count += 1
                self._record_pass(worker, result)
                for request_id, reused in result.admissions:
                    self.records[request_id].admissions.append((self.now_ms, reused))
                if result.end_ms > self.now_ms:
                    worker.pending_end_ms = result.end_ms
                    worker.pending_result = result
                else:
                    self._apply_outputs(result)
                started = True
                changed = True
                break
            if not started:
                return changed

    def _record_pass(self, worker, result):
        fpm = result.fpm()
        label = self.label
        self.passes.append({
            "worker": worker.worker_id,
            "start_ms": result.start_ms,
            "end_ms": result.end_ms,
            "prefill_ms": result.prefill_ms,
            "decode_ms": result.decode_ms,
            "num_prefill_requests": fpm["num_prefill_requests"],
            "sum_prefill_tokens": fpm["sum_prefill_tokens"],
            "sum_prefill_kv_tokens": fpm["sum_prefill_kv_tokens"],
            "num_decode_requests": fpm["num_decode_requests"],
            "sum_decode_kv_tokens": fpm["sum_decode_kv_tokens"],
            "decode_batch_size": len(result.decode_batch),
            "admitted": [label[rid] for rid, _ in result.admissions],
            "emitted": [label[o.request_id] for o in result.outputs if o.token_id is not None],
            "terminated": [label[o.request_id] for o in result.outputs if o.completed],
            "preempted": [label[rid] for rid in result.preempted],
            # the seed's PressureEvent of each preemption / retraction, request as its key
            "pressure": [dict(event, request_id=label[event["request_id"]])
                         for event in result.pressure_events],
            # Every output in emission order: (key, token emitted, completed, rejected).
            "outputs": [(label[o.request_id], o.token_id is not None, o.completed, o.rejected)
                        for o in result.outputs],
        })

    def _drain_instant(self):
        """One instant to a fixed point (replay.md 1.4): pass completions (by worker id),
        then arrivals / closed-loop backfill, then idle workers start passes.  A slot freed
        by a zero-duration pass is refilled only in the next iteration, after every idle
        worker was driven, as in the reference's drain loop."""
        while True:
            changed = self._complete_due_passes()
            changed |= self._release_arrivals()
            changed |= self._release_tokenized()
            changed |= self._drive_workers()
            if not changed:
                return

    def _next_time(self):
        times = [w.pending_end_ms for w in self.workers if w.pending_end_ms is not None]
        ready = self.driver.next_ready_time()
        if ready is not None:
            times.append(ready)
        times += [t[0] for t in self.tokenizing]
        return min(times) if times else None

    def run(self):
        self._drain_instant()
        while True:
            next_ms = self._next_time()
            if next_ms is None:
                break
            if next_ms < self.now_ms:
                raise AssertionError("time went backwards")
            self.now_ms = next_ms
            self._drain_instant()
        in_flight = sum(len(w.rank.requests) for w in self.workers)
        if in_flight or not self.driver.is_drained():
            # The reference aborts here too ("effect-free zero-duration pass").
            raise RuntimeError("replay dead end: effect-free zero-duration pass with %d "
                               "in-flight requests remaining" % in_flight)
        rows = [record.as_row() for record in self.records.values() if record.status]
        rows.sort(key=lambda r: (r["arrival_ms"], r["request_id"], r["turn_index"]))
        return rows, self.passes


# ================================================================================================
# Public entry point
# ================================================================================================
def run(spec, trace_path):
    """Replay an aggregated vLLM/TRT-LLM execution payload over a Mooncake trace.

    Returns (records, passes).  ``records`` use the golden CSV column names;
    ``passes`` list every executed pass: worker, start_ms, end_ms, the FPM counters
    (num_prefill_requests, sum_prefill_tokens, num_decode_requests,
    sum_decode_kv_tokens), and the (request_id, turn_index) keys admitted, emitting a
    token, terminating and preempted in that pass.
    """
    payload = spec
    inner = payload.get("spec", payload)
    traffic = payload.get("traffic") or {}
    topology = inner.get("topology", {"kind": "aggregated"})
    if topology.get("kind", "aggregated") != "aggregated":
        raise ValueError("oracle models the aggregated topology only")
    workers = topology.get("workers", {})
    num_workers = int(workers.get("initial_workers", 1))
    # startup_delay_ms delays only workers a scaler adds (none here): initial workers start ready
    engine = inner.get("engine", {})
    if int(engine.get("dp_size", 1)) != 1:
        raise ValueError("attention DP is not modeled")
    if inner.get("max_sim_time_ms") is not None:
        raise ValueError("max_sim_time_ms is not modeled")
    placement = (inner.get("adapters") or {}).get("placement") or {}
    provider = placement.get("provider", "round_robin")
    if provider not in ("round_robin", "random"):
        raise ValueError("placement: round_robin (the reference's) or random only")
    seed = int((placement.get("config") or {}).get("seed", 0))
    rank_json = engine.get("rank", {})
    if rank_json.get("backend") == "sglang":
        from . import oracle_sglang  # the SGLang rank model (cyclic: it builds on this module)
        rank_config = oracle_sglang.SglangConfig.from_rank_json(rank_json)
    else:
        rank_config = RankConfig.from_rank_json(rank_json)
    if traffic.get("trace_format", "mooncake") != "mooncake":
        raise ValueError("oracle loads Mooncake traces only")
    trace_block_size = int(traffic.get("trace_block_size", 512))
    speedup = float(traffic.get("arrival_speedup_ratio", 1.0))
    concurrency = None
    if traffic.get("load_type") == "concurrency":
        concurrency = traffic.get("replay_concurrency") or traffic.get("concurrency")
        if not concurrency:
            raise ValueError("concurrency load needs replay_concurrency")
        concurrency = int(concurrency)
    sessions = load_mooncake(trace_path, trace_block_size, speedup)
    tok = payload.get("tokenization")
    tokenization = None if tok is None else (int(tok.get("workers", 1)), float(tok.get("base_ms", 0.0)),
                                             float(tok.get("per_input_token_ms", 0.0)))
    replay = Replay(rank_config, num_workers, sessions, trace_block_size, concurrency, provider, seed,
                    tokenization)
    return replay.run()
