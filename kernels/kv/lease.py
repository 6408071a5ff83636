"""A request's KV lease on the shared paged block pool (``kv.block_pool``): prefix
lookup, growth, release, and the identities of blocks as they complete
(``cache/vllm_block_pool.rs`` and the lease handling of ``scheduler/vllm/core.rs``).

Prompt tokens are the interned trace hash ids of their trace block; generated
tokens are the replay's output plan (``trace.output_plan``), so block hashes, generated
blocks included, are the reference's XXH3 sequence hashes.
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.hashing.xxh3 import hash_chain, xxh3_64_u32_seed1337
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import (cache_copy, kv_events_logged, note_kv_stored, release_ref,
                                              reserve, table_find)
from aisim_fast.kernels.loop.request_state import ceil_div, seq_len
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_NUM_GPU_BLOCKS, CFG_PREFIX_CACHING,
                                              CFG_ROLE, EV_BLOCK, EV_KIND, EV_KV_STORED, EV_REQUEST,
                                              EV_TOKENS_HASH, EV_WORKER, KV_FIRST, KV_FIRST_WITH_PARENT,
                                              KV_NEXT, NO_BLOCK, PB_CACHED, PB_PIN, PB_REF, ROLE_DECODE,
                                              RQ_ALLOCATED, RQ_FAST_LIMIT, RQ_LEASE_OFF, RQ_NUM_HASHED,
                                              RQ_PROMPT_LEN, RQ_REPUBLISHED, RQ_SRC_ROW)
from aisim_fast.kernels.trace.output_plan import output_token_ids


@kernel(cache=True, _nrt=False)
def hash_block(rq, wl, q, i, bs, scratch_tokens):
    """Sequence hash of block i of request q (block i-1 must already be hashed)."""
    local = local_block_hash(rq, wl, q, i, bs, scratch_tokens)
    if i == 0:
        return local
    return hash_chain(rq.seq_hash[rq.i64[q, RQ_LEASE_OFF] + i - 1], local)


@kernel(cache=True, _nrt=False)
def local_block_hash(rq, wl, q, i, bs, scratch_tokens):
    """The tokens-only hash of block i of request q (XXH3 of its tokens).

    Tokens: prompt positions hold the interned trace hash id of their trace block
    (filled run by run, a trace block is many engine tokens); generated positions
    hold the row's output token ids (its output plan, as the reference's replay)."""
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    pos = i * bs
    end = pos + bs
    j = 0
    if pos < prompt:
        row = rq.i64[q, RQ_SRC_ROW]
        tbs = wl.trace_block_size[row]
        h0 = wl.hash_indptr[row]
        while pos < min(end, prompt):
            run_end = min(min(end, prompt), (pos // tbs + 1) * tbs)
            token = wl.hash_ids[h0 + pos // tbs]
            while pos < run_end:
                scratch_tokens[j] = token
                j += 1
                pos += 1
    if pos < end:
        output_token_ids(wl.out_plan, wl.out_authored, rq.i64[q, RQ_SRC_ROW], pos - prompt, end - pos,
                         scratch_tokens, j)
    return xxh3_64_u32_seed1337(scratch_tokens, 0, bs)


@kernel(cache=True, _nrt=False)
def prefix_cost(cfg, p, rq, w, q):
    """(cached_tokens, active_cached_tokens) of a prefix lookup: leading complete
    blocks with a resident copy; active = those whose primary copy is referenced
    or pinned. Lookup does not touch the LRU."""
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return 0, 0
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    length = seq_len(rq, q)
    k0 = rq.i64[q, RQ_LEASE_OFF]
    overlap = 0
    active = 0
    for i in range(rq.i64[q, RQ_NUM_HASHED]):
        b = table_find(p, w, rq.seq_hash[k0 + i])
        if b == NO_BLOCK:
            break
        overlap += 1
        if p.b32[b, PB_REF] > 0 or p.b32[b, PB_PIN] > 0:
            active += 1
    return min(overlap * bs, length), min(active * bs, length)


@kernel(cache=True, _nrt=False)
def allocate(cfg, p, rq, w, q, target_tokens, reusable_prefix_blocks, hits, fresh):
    """Grow q's lease to cover ``target_tokens``; the first blocks up to
    ``reusable_prefix_blocks`` are prefix hits, the rest fresh private copies.
    Returns 1 ok, 0 capacity exhausted (unchanged), -1 arena exhausted."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    prev = ceil_div(rq.i64[q, RQ_ALLOCATED], bs)
    tgt = min(ceil_div(target_tokens, bs), ceil_div(seq_len(rq, q), bs))
    if tgt <= prev:
        rq.i64[q, RQ_ALLOCATED] = max(rq.i64[q, RQ_ALLOCATED], target_tokens)
        return 1
    count = tgt - prev
    n_hit = min(max(0, reusable_prefix_blocks - prev), count)
    for i in range(n_hit):
        hits[i] = table_find(p, w, rq.seq_hash[k0 + prev + i])
    res = reserve(p, w, cfg.i64[w, CFG_NUM_GPU_BLOCKS], hits, n_hit, count - n_hit, fresh)
    if res != 1:
        return res
    for i in range(n_hit):
        rq.lease[k0 + prev + i] = hits[i]
    for i in range(count - n_hit):
        rq.lease[k0 + prev + n_hit + i] = fresh[i]
    rq.i64[q, RQ_ALLOCATED] = target_tokens
    return 1


@njit(cache=True, _nrt=False)
def release_lease(cfg, p, rq, w, q):
    """Release every block, tail first, so a request's leaf enters the LRU (and is
    evicted) before its parents."""
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(ceil_div(rq.i64[q, RQ_ALLOCATED], bs) - 1, -1, -1):
        release_ref(p, w, rq.lease[k0 + i])
        rq.lease[k0 + i] = NO_BLOCK
    rq.i64[q, RQ_ALLOCATED] = 0
    rq.i64[q, RQ_FAST_LIMIT] = 0


@kernel(cache=True, _nrt=False)
def finalize(cfg, p, rq, wl, w, q, before, after, scratch_tokens):
    """Blocks completed by computing tokens [before, after) get their identity and
    become visible, before later requests of the same pass look them up."""
    if cfg.i64[w, CFG_PREFIX_CACHING] == 0:
        return
    bs = cfg.i64[w, CFG_BLOCK_SIZE]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    continues = False  # the block before became visible here too: same Stored event
    for i in range(before // bs, after // bs):
        if i >= rq.i64[q, RQ_NUM_HASHED]:
            rq.seq_hash[k0 + i] = hash_block(rq, wl, q, i, bs, scratch_tokens)
            rq.i64[q, RQ_NUM_HASHED] = i + 1
        b = rq.lease[k0 + i]
        if p.b32[b, PB_CACHED] == 0 and publish_block(p, rq, w, q, i, b, continues):
            continues = True
            if cfg.i64[w, CFG_ROLE] == ROLE_DECODE and i < rq.i64[q, RQ_PROMPT_LEN] // bs:
                rq.i64[q, RQ_REPUBLISHED] += 1
        else:
            continues = False


@kernel(cache=True, _nrt=False, inline="always")
def publish_block(p, rq, w, q, i, b, continues):
    """Make q's private copy ``b`` of its block i visible under the block's hash;
    True (and a KV Stored row) when the hash was not visible on the worker before.
    ``continues``: block i-1 became visible in the same step, so the row joins its
    event; else it starts one, with block i-1's hash as the parent."""
    k0 = rq.i64[q, RQ_LEASE_OFF]
    if not cache_copy(p, w, b, rq.seq_hash[k0 + i]):
        return False
    if not kv_events_logged(p, w):
        return True
    parent = np.int64(rq.seq_hash[k0 + i - 1]) if i > 0 else np.int64(0)
    group = KV_NEXT if continues else (KV_FIRST_WITH_PARENT if i > 0 else KV_FIRST)
    # the tokens-only hash is filled in when the log is drained (kv_tokens_hashes)
    note_kv_stored(p, w, np.int64(rq.seq_hash[k0 + i]), parent, np.int64(group), np.int64(0), q,
                   np.int64(i))
    return True


@njit(cache=True, _nrt=False)
def kv_tokens_hashes(cfg, rq, wl, rows, scratch_tokens):
    """Fill EV_TOKENS_HASH of the KV Stored rows of a drained event log: the
    tokens-only hash of block EV_BLOCK of request EV_REQUEST (a kernel row)."""
    for r in range(rows.shape[0]):
        if rows[r, EV_KIND] == EV_KV_STORED:
            bs = cfg.i64[rows[r, EV_WORKER], CFG_BLOCK_SIZE]
            rows[r, EV_TOKENS_HASH] = np.int64(local_block_hash(
                rq, wl, rows[r, EV_REQUEST], rows[r, EV_BLOCK], bs, scratch_tokens))
