"""The SGLang rank's side of the disaggregated handoff (the DestinationFirst order):
what the reference's SGLang rank does on each handoff command, over its radix
cache (``sglang.radix``) and request leases (``sglang.core``). ``disagg.handoff``
runs the handoff and calls these where a worker's backend is SGLang.

* ReserveDestination, at the head of a decode worker's pending-destination FIFO: a
  locking match of the prompt's complete page keys, then fresh pages for the rest of
  the page-rounded prompt, evicting only the deficit; nothing enters the tree yet.
  The transferable prompt tokens are the fresh pages x page size.
* ActivateDestination: the request, its whole prompt materialized, joins the
  worker's ready list (the reference's prebuilt-ready FIFO). A later pass moves it
  to the running batch while slots remain, and only then do its prompt's complete
  pages enter the tree from the matched prefix on (the insert and canonicalization
  of ``cache_prefix``) and a capacity generation start (``sglang.core.promote_ready``).
* ReleaseSource of a held prefill: it finishes as a completed request does (its
  complete prompt pages enter the tree, its lock is released).
* CancelDestination of a reserved or activated (not yet promoted) destination: its
  fresh pages go back and the matched prefix is unlocked, as a retraction releases
  a request (nothing of it is in the tree yet).
"""


from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.loop.request_state import ceil_div
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_MAX_MODEL_LEN, CFG_NUM_GPU_BLOCKS,
                                              CFG_PREFIX_CACHING, RQ_ALLOCATED, RQ_LEASE_OFF, RQ_NUM_COMPUTED,
                                              RQ_PROMPT_LEN, RQ_RESERVED_FRESH, RQ_RESERVED_HITS,
                                              RQ_SG_CACHED, RQ_SG_LAST, RQ_STATUS, RS_ACTIVATED, RW_EVICTABLE,
                                              RW_PAGE_SIZE, WK_CAP_GEN, WK_RESERVED_LEN)
from aisim_fast.kernels.sglang import radix as rx
from aisim_fast.kernels.sglang.core import (_ensure_keys, _evict_for, _take_pages, finish_kv, ready_push,
                                            ready_remove, release_on_retraction)


@kernel(cache=True, _nrt=False)
def destination_impossible(cfg, rq, w, q):
    """The rank refuses the destination outright (the reference's ReserveDestination
    error): its page-rounded prompt exceeds the whole pool, or the prompt is at or
    past the rank's ``max_model_len`` (the request fails before its prefill)."""
    ps = cfg.i64[w, CFG_BLOCK_SIZE]
    limit = cfg.i64[w, CFG_MAX_MODEL_LEN]
    if limit >= 0 and rq.i64[q, RQ_PROMPT_LEN] >= limit:
        return True
    return ceil_div(rq.i64[q, RQ_PROMPT_LEN], ps) > cfg.i64[w, CFG_NUM_GPU_BLOCKS]


@kernel(cache=True, _nrt=False)
def reserve_destination(cfg, p, rq, wl, w, q, scratch_tokens):
    """Reserve q's prompt on decode worker w: 1 reserved, 0 it does not fit now (the
    match is unlocked again), -2 the worker's page or node slots ran out."""
    r = p.radix
    ps = r.w64[w, RW_PAGE_SIZE]
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    k0 = rq.i64[q, RQ_LEASE_OFF]
    if cfg.i64[w, CFG_PREFIX_CACHING] != 0:
        n_keys = prompt // ps
        _ensure_keys(rq, wl, q, n_keys, ps, scratch_tokens)
        matched, last = rx.match_lock(r, w, rq.seq_hash, k0, n_keys)
        if last < 0:
            return -2
    else:
        matched, last = 0, rx.root(r, w)
    fresh_pages = ceil_div(prompt, ps) - matched
    if fresh_pages * ps > rx.available_tokens(r, w) + r.w64[w, RW_EVICTABLE]:
        rx.dec_lock(r, w, last)
        return 0
    _evict_for(r, w, fresh_pages * ps)
    if not _take_pages(r, rq, w, q, matched, fresh_pages):
        return -2
    rq.i64[q, RQ_SG_CACHED] = matched * ps
    rq.i64[q, RQ_SG_LAST] = last
    rq.i64[q, RQ_RESERVED_HITS] = matched
    rq.i64[q, RQ_RESERVED_FRESH] = fresh_pages
    return 1


@kernel(cache=True, _nrt=False)
def activate_destination(cfg, p, rq, wk, w, q):
    """Commit q's reservation on decode worker w: its prompt is materialized and it
    joins the ready list. Nothing is freed, so no capacity generation starts. Its
    pages enter the tree only when a pass moves it to the running batch
    (``sglang.core.promote_ready``): reference runs e7 (an activated request still
    waiting for a running slot is no prefix hit for a later reservation) and e13
    (a running one is)."""
    ps = p.radix.w64[w, RW_PAGE_SIZE]
    prompt = rq.i64[q, RQ_PROMPT_LEN]
    rq.i64[q, RQ_NUM_COMPUTED] = prompt
    rq.i64[q, RQ_ALLOCATED] = ceil_div(prompt, ps) * ps
    rq.i64[q, RQ_STATUS] = RS_ACTIVATED
    wk.i64[w, WK_RESERVED_LEN] -= 1
    ready_push(rq, wk, w, q)


@kernel(cache=True, _nrt=False)
def release_source(cfg, p, rq, wl, wk, w, qp, path, scratch_tokens):
    """ReleaseSource of prefill row qp held on worker w: finished like a completed
    request (pages into the tree, lock released); a capacity generation starts."""
    finish_kv(cfg, p.radix, rq, wl, w, qp, path, scratch_tokens)
    wk.i64[w, WK_CAP_GEN] += 1


@kernel(cache=True, _nrt=False)
def cancel_destination(p, rq, wk, w, q):
    """Give back reserved or activated destination q on decode worker w (an activated
    one leaves the ready list first): its fresh pages are freed and the matched
    prefix unlocked. False when q is neither (then nothing is done)."""
    if rq.i64[q, RQ_STATUS] == RS_ACTIVATED:
        if not ready_remove(rq, wk, w, q):
            return False
    else:  # reserved: the reservation's pages are the lease's, from the matched prefix on
        ps = p.radix.w64[w, RW_PAGE_SIZE]
        rq.i64[q, RQ_ALLOCATED] = (rq.i64[q, RQ_RESERVED_HITS] + rq.i64[q, RQ_RESERVED_FRESH]) * ps
    release_on_retraction(p.radix, rq, w, q)
    return True
