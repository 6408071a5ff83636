"""KV-aware placement: Dynamo's KV router cost function over the engines' state.

For a request of ``isl`` prompt tokens and engine block size ``B``, each worker w of
the pool costs (reference/dynamo/README.md, verified there on every decision)::

    cost_w = prefill_load_scale * max(0, (P_w + isl) / B - overlap_score_credit * overlap_w) + D_w

* ``P_w`` (``WK_RT_PREFILL_TOKENS``): prompt tokens still to prefill on w, the sum over
  requests routed there whose first token has not been seen of ``isl - B * overlap``
  at their routing; released at the end of the pass that emits the first token.
* ``overlap_w``: leading complete prompt blocks of the request in w's prefix index.
  The index learns a block at the end of the pass that stored it, and forgets one at
  the end of the pass that evicted it: a block published by the pass in flight
  (``PB_PUB_PASS``) does not count yet, and one it evicted (``kv.block_pool._note_evicted``)
  still counts.
* ``D_w`` (``WK_RT_ACTIVE_BLOCKS``): distinct complete prompt blocks over the
  requests active on w (routed, not completed), this request's included; kept in
  a per-worker multiset of block hashes (``wk.rt_key`` / ``rt_count``), released at
  the end of the pass that completes the request. The multiset starts in the first
  slots of its region and grows there (``_make_room``): a worker holds a few hundred
  active blocks at a time, and a small table stays in cache.

Temperature 0 picks the lowest cost; exact ties go to a uniform draw among them
(reservoir order, as Dynamo's selector) from the simulation's seeded generator, so
a run is reproducible. Temperature > 0 samples the softmax of the normalised costs.
``pin_to_trace_worker`` computes and logs every cost but places on the trace row's
worker. Every decision is logged (``sims.rt_log`` / ``rt_costs``).

Disaggregated pools (reference/dynamo runs checked on every decision): each pool
has its own router over its own workers.

* Prefill (``ROUTE_PREFILL``), at arrival (the SubmitPrefill action): the cost above
  without ``D_w`` (active blocks are not tracked there); ``P_w`` and the prefix index
  are the prefill workers', ``P_w`` released at the end of the pass that finishes the
  prefill (its hidden first token, when the source is held).
* Decode (``ROUTE_DECODE``), when the source is held (the ReserveDestination
  action): ``cost_w = D_w`` alone, overlap-blind, where ``D_w`` sums ``floor(isl /
  B)`` over the requests active on w, this one included, shared prefixes counted
  once per request; released when the request completes. The logged overlap is 0.
"""

import numpy as np

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import NO_PASS, PASS_NUM_MASK, _mix, evicted_in_flight, table_find
from aisim_fast.kernels.loop.rank_queues import wait_at
from aisim_fast.kernels.routing.placement import next_random
from aisim_fast.kernels.schema.layout import (CFG_BLOCK_SIZE, CFG_ROUTER_PIN, CFGF_ROUTER_CREDIT,
                                              CFGF_ROUTER_LOAD_SCALE, CFGF_ROUTER_TEMPERATURE, NO_BLOCK,
                                              PB_PUB_PASS, PW_PASS_NUM, RL_BEST_OVERLAP, RL_COST, RL_OVERLAP,
                                              RL_POOL, RL_REQUEST, RL_TIED, RL_TIME_MS, RL_WORKER,
                                              ROUTE_AGGREGATED, ROUTE_DECODE, ROUTE_PREFILL, RQ_LEASE_OFF,
                                              RQ_PEER, RQ_PIN_WORKER, RQ_PROMPT_LEN, RQ_RT_ACTIVE,
                                              RQ_RT_PENDING, RQ_SRC_ROW, RQ_TERM_NEXT, SM_Q_OFF,
                                              SM_RT_LOG_LEN, WK_BUSY, WK_RT_ACTIVE_BLOCKS, WK_RT_FREED_TOKENS,
                                              WK_RT_LIMIT, WK_RT_MASK, WK_RT_OFF, WK_RT_PREFILL_TOKENS,
                                              WK_RT_USED, WK_RUN_LEN, WK_RUN_OFF, WK_TERM_HEAD, WK_WAIT_LEN)

RT_NEVER_USED = -1  # rt_count of a slot no hash took since the multiset was (re)built


@kernel(cache=True, _nrt=False)
def _slot(wk, w, h):
    """Slot of hash h in worker w's multiset: where it is, or the free slot it takes."""
    off = wk.i64[w, WK_RT_OFF]
    mask = wk.i64[w, WK_RT_MASK]
    i = np.int64(_mix(h) & np.uint64(mask))
    while True:
        c = wk.rt_count[off + i]
        if c == RT_NEVER_USED or wk.rt_key[off + i] == h:
            return off + i
        i = (i + 1) & mask


@kernel(cache=True, _nrt=False)
def _count_in(wk, w, h):
    """One more active block of hash h in worker w's multiset."""
    at = _slot(wk, w, h)
    if wk.rt_count[at] == RT_NEVER_USED:
        wk.rt_key[at] = h
        wk.rt_count[at] = 0
        wk.i64[w, WK_RT_USED] += 1
    if wk.rt_count[at] == 0:
        wk.i64[w, WK_RT_ACTIVE_BLOCKS] += 1
    wk.rt_count[at] += 1


@kernel(cache=True, _nrt=False)
def _recount(rq, wk, w, q):
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(rq.i64[q, RQ_RT_ACTIVE]):
        _count_in(wk, w, rq.seq_hash[k0 + i])


@kernel(cache=True, _nrt=False)
def _rebuild(rq, wk, w, slots):
    """Worker w's multiset anew in ``slots`` slots (a power of two, at most its region's):
    the blocks of the requests active here and nothing else, so the slots of released
    blocks are free again. Its active requests are those its queues hold: running,
    waiting, and the terminals of the pass in flight (released at its end)."""
    off = wk.i64[w, WK_RT_OFF]
    wk.rt_count[off:off + slots] = RT_NEVER_USED
    wk.i64[w, WK_RT_MASK] = slots - 1
    wk.i64[w, WK_RT_USED] = 0
    wk.i64[w, WK_RT_ACTIVE_BLOCKS] = 0
    for j in range(wk.i64[w, WK_RUN_LEN]):
        _recount(rq, wk, w, wk.run_q[wk.i64[w, WK_RUN_OFF] + j])
    for j in range(wk.i64[w, WK_WAIT_LEN]):
        _recount(rq, wk, w, wait_at(wk, w, j))
    q = wk.i64[w, WK_TERM_HEAD]
    while q >= 0:
        _recount(rq, wk, w, q)
        q = rq.i64[q, RQ_TERM_NEXT]


@kernel(cache=True, _nrt=False)
def _make_room(rq, wk, w, n):
    """Room in worker w's multiset for ``n`` more hashes at a load of at most a half:
    a multiset starts small (a slot per block most workers ever hold at once, and the
    table stays in cache) and keeps the slots of released blocks until a rebuild drops
    them; it doubles while its active blocks would fill more than a quarter."""
    slots = wk.i64[w, WK_RT_MASK] + 1
    used = wk.i64[w, WK_RT_USED]
    if 2 * (used + n) <= slots:
        return
    live = wk.i64[w, WK_RT_ACTIVE_BLOCKS]
    limit = wk.i64[w, WK_RT_LIMIT]
    if slots == limit and 4 * (used - live) < slots:
        return  # the region's whole: it holds every distinct block twice over
    while slots < limit and 4 * (live + n) > slots:
        slots *= 2
    _rebuild(rq, wk, w, slots)


@kernel(cache=True, _nrt=False)
def _active_count(wk, w, h):
    at = _slot(wk, w, h)
    c = wk.rt_count[at]
    return 0 if c == RT_NEVER_USED else c


@kernel(cache=True, _nrt=False)
def _visible_overlap(p, wk, w, phash, p0, n_blocks, now_ms):
    """Leading prompt blocks of the request in w's prefix index as the router sees it
    at ``now_ms``: as of the end of w's last pass, so a pass still in flight has
    neither stored nor removed anything yet (its KV events come at its end)."""
    in_flight = wk.i64[w, WK_BUSY] != 0 and wk.pass_end_ms[w] > now_ms \
        and p.w64[w, PW_PASS_NUM] != NO_PASS  # an attention-DP rank sitting out its group's pass
    current = p.w64[w, PW_PASS_NUM] & PASS_NUM_MASK
    k = np.int64(0)
    for i in range(n_blocks):
        h = phash[p0 + i]
        b = table_find(p, w, h)
        if b == NO_BLOCK or (in_flight and p.b32[b, PB_PUB_PASS] == current):
            if not (in_flight and evicted_in_flight(p, w, h)):
                break
        k += 1
    return k


@kernel(cache=True, _nrt=False)
def _softmax_pick(costs, n, temperature, sample):
    """Row drawn from the softmax of the normalised costs (Dynamo's selector)."""
    lo = np.inf
    hi = -np.inf
    for j in range(n):
        lo = min(lo, costs[j])
        hi = max(hi, costs[j])
    if lo == hi:
        return min(n - 1, np.int64(sample * n))
    rng = hi - lo
    magnitude = 1.0 if np.isfinite(rng) else max(abs(lo), abs(hi))
    lo_n = lo / magnitude
    scale = -1.0 / ((hi / magnitude - lo_n) * temperature)
    top = lo_n * scale
    total = 0.0
    for j in range(n):
        total += np.exp(costs[j] / magnitude * scale - top)
    cumulative = 0.0
    for j in range(n):
        cumulative += np.exp(costs[j] / magnitude * scale - top) / total
        if sample <= cumulative:
            return np.int64(j)
    return n - 1


@kernel(cache=True, _nrt=False)
def route(cfg, p, rq, wl, wk, sims, s, q, now_ms, w0, n, pool):
    """The worker of the pool ``[w0, w0 + n)`` that request row q goes to (``pool``:
    ROUTE_AGGREGATED at its arrival, ROUTE_PREFILL / ROUTE_DECODE for the two sides
    of a disaggregated one); the router's view of that worker takes the request in."""
    bs = cfg.i64[w0, CFG_BLOCK_SIZE]
    credit = cfg.f64[w0, CFGF_ROUTER_CREDIT]
    load_scale = cfg.f64[w0, CFGF_ROUTER_LOAD_SCALE]
    temperature = cfg.f64[w0, CFGF_ROUTER_TEMPERATURE]
    row = rq.i64[q, RQ_SRC_ROW]
    p0 = wl.phash_indptr[row]
    n_blocks = wl.phash_indptr[row + 1] - p0
    isl = rq.i64[q, RQ_PROMPT_LEN]
    decode = pool == ROUTE_DECODE
    r = sims.i64[s, SM_RT_LOG_LEN]
    sims.i64[s, SM_RT_LOG_LEN] = r + 1
    costs = sims.rt_costs[s, r]
    best_j = np.int64(0)
    best_cost = np.inf
    ties = np.int64(0)
    best_overlap = np.int64(0)
    for j in range(n):
        w = w0 + j
        if decode:
            cost = float(wk.i64[w, WK_RT_ACTIVE_BLOCKS] + isl // bs)
        else:
            overlap = _visible_overlap(p, wk, w, wl.phash, p0, n_blocks, now_ms)
            best_overlap = max(best_overlap, overlap)
            prefill_blocks = (wk.i64[w, WK_RT_PREFILL_TOKENS] + isl) / bs - credit * overlap
            cost = load_scale * max(0.0, prefill_blocks)
            if pool == ROUTE_AGGREGATED:
                # block hashes are chained: a request active here that holds block i
                # holds blocks 0..i-1 too, so this request's active blocks are a
                # leading run
                shared = np.int64(0)
                while shared < n_blocks and _active_count(wk, w, wl.phash[p0 + shared]) > 0:
                    shared += 1
                cost += float(wk.i64[w, WK_RT_ACTIVE_BLOCKS] + n_blocks - shared)
        costs[j] = cost
        if cost < best_cost:
            best_cost = cost
            best_j = j
            ties = 1
        elif cost == best_cost:
            ties += 1
            if next_random(sims, s) % np.uint64(ties) == 0:
                best_j = j
    if cfg.i64[w0, CFG_ROUTER_PIN]:
        best_j = rq.i64[q, RQ_PIN_WORKER]
    elif temperature > 0.0:
        sample = float(next_random(sims, s) >> np.uint64(11)) * (1.0 / 9007199254740992.0)
        best_j = _softmax_pick(costs, n, temperature, sample)
    w = w0 + best_j
    overlap = 0 if decode else _visible_overlap(p, wk, w, wl.phash, p0, n_blocks, now_ms)
    log = sims.rt_log[s, r]
    # the simulation's request: a prefill row's is its logical row (its peer)
    log[RL_REQUEST] = (rq.i64[q, RQ_PEER] if pool == ROUTE_PREFILL else q) - sims.i64[s, SM_Q_OFF]
    log[RL_WORKER] = best_j
    log[RL_COST] = costs[best_j]
    log[RL_OVERLAP] = overlap
    log[RL_BEST_OVERLAP] = best_overlap
    log[RL_TIED] = ties
    log[RL_TIME_MS] = now_ms
    log[RL_POOL] = pool
    if decode:
        wk.i64[w, WK_RT_ACTIVE_BLOCKS] += isl // bs
        rq.i64[q, RQ_RT_ACTIVE] = isl // bs
        return w
    pending = isl - bs * overlap
    wk.i64[w, WK_RT_PREFILL_TOKENS] += pending
    rq.i64[q, RQ_RT_PENDING] = pending
    if pool == ROUTE_AGGREGATED:
        _make_room(rq, wk, w, n_blocks)
        for i in range(n_blocks):
            _count_in(wk, w, wl.phash[p0 + i])
        rq.i64[q, RQ_RT_ACTIVE] = n_blocks
    return w


@kernel(cache=True, _nrt=False, inline="always")
def first_token_seen(rq, wk, w, q):
    """q's first token in the pass in flight: its share of P_w goes at the pass end."""
    wk.i64[w, WK_RT_FREED_TOKENS] += rq.i64[q, RQ_RT_PENDING]
    rq.i64[q, RQ_RT_PENDING] = 0


@kernel(cache=True, _nrt=False)
def pass_end(rq, wk, w):
    """End of w's pass: release the first tokens' prefill share."""
    wk.i64[w, WK_RT_PREFILL_TOKENS] -= wk.i64[w, WK_RT_FREED_TOKENS]
    wk.i64[w, WK_RT_FREED_TOKENS] = 0


@kernel(cache=True, _nrt=False)
def request_ended(rq, wk, w, q, distinct):
    """q's terminal was seen at a pass end: its blocks leave D_w (``distinct``: the
    aggregated router's multiset of block hashes; else a count) and whatever of P_w it
    still held (a request rejected before any token)."""
    wk.i64[w, WK_RT_PREFILL_TOKENS] -= rq.i64[q, RQ_RT_PENDING]
    rq.i64[q, RQ_RT_PENDING] = 0
    if not distinct:
        wk.i64[w, WK_RT_ACTIVE_BLOCKS] -= rq.i64[q, RQ_RT_ACTIVE]
        rq.i64[q, RQ_RT_ACTIVE] = 0
        return
    k0 = rq.i64[q, RQ_LEASE_OFF]
    for i in range(rq.i64[q, RQ_RT_ACTIVE]):
        at = _slot(wk, w, rq.seq_hash[k0 + i])
        wk.rt_count[at] -= 1
        if wk.rt_count[at] == 0:
            wk.i64[w, WK_RT_ACTIVE_BLOCKS] -= 1
    rq.i64[q, RQ_RT_ACTIVE] = 0


# The router's entry points behind its feature gate (kernels.features): a batch that
# routes nothing compiles none of this module.
route_gated = gate("kv_router", route, np.int64(0))
first_token_seen_gated = gate("kv_router", first_token_seen)
pass_end_gated = gate("kv_router", pass_end)
request_ended_gated = gate("kv_router", request_ended)
