"""Growing a batch's kernel state: more requests for one simulation between steps.

The kernels' arrays are packed: each simulation's request rows, its per-request
regions (start order, release heap, handoff ring, transfer heap) and each worker's
queues are slices at offsets. A simulation therefore grows by reallocation: the
arrays are rebuilt larger and every value that points at a request row that moved
is renumbered. Which values those are is declared once, in the ``ref`` column of
the layout's field tables (``"q"``); the index arrays (queues, heaps, rings, the
start order) hold request rows by construction. Block slots, lease entries and
workload rows never move: a grown simulation's new leases and workload rows are
appended at the ends of their arrays.

The order of request rows is kept: logical rows of every simulation first (the
grown one's new rows after its old ones), then the prefill rows of every
disaggregated simulation in the same order. Kernel code sees exactly the state it
would have seen had the rows been there from the start, apart from their numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aisim_fast.kernels.hashing.prompt_blocks import count_prompt_blocks, hash_prompt_blocks
from aisim_fast.kernels.schema import layout as L
from aisim_fast.trace.growing_arrays import append_into


@dataclass
class KernelState:
    """The arrays of one batch as the kernels take them (see kernels.schema.layout)."""
    cfg: L.RankConfig
    pool: L.Pool
    rq: L.Requests
    wl: L.Workload
    wk: L.Workers
    st: L.Sims
    max_lease: int   # largest lease of any request (scratch size of the kernels)
    max_bs: int      # largest block size
    # the append-only arrays (workload table, lease arena) as views of buffers with room
    # to grow (growing_arrays): appending writes past the old end instead of copying
    # the whole array, so a simulation grown one request at a time (a rank fed Submit
    # by Submit) costs what the new rows cost, not what the arrays hold
    buffers: dict = field(default_factory=dict, repr=False)


def kernel_output_plan(workload, authored_base: int) -> tuple[np.ndarray, np.ndarray]:
    """The output plan of ``workload``'s rows as a table of the kernel workload takes it:
    (``out_plan`` rows, authored ids to append) when the table's authored ids start at
    ``authored_base`` of ``out_authored``."""
    plan, authored = workload.output_plan()
    return np.where(plan < 0, plan - authored_base, plan), authored


@dataclass
class WorkloadRows:
    """One block of the kernels' workload table: a trace's rows for one engine block
    size (prompt tokens as hash ids, prompt block hashes, the output plan), numbered
    after the rows, hash ids, block hashes and authored ids already in the table."""
    parts: dict               # field of layout.Workload -> its arrays of the block
    n_hash_ids: int
    n_block_hashes: int
    n_authored: int


def workload_rows(workload, block_size: int, hash_base: int, phash_base: int,
                  authored_base: int) -> WorkloadRows:
    """The kernel workload rows of ``workload`` for ``block_size`` (0: an SGLang pool's
    rows, without block hashes), the one way both a new batch (``build.build_state``)
    and a grown one (``append_workload_rows``) lay them out."""
    input_len = workload.input_len.astype(np.int64)
    if block_size == 0:
        indptr = np.zeros(len(input_len) + 1, np.int64)
        phash = np.zeros(0, np.uint64)
    else:
        indptr = count_prompt_blocks(input_len, block_size)
        phash = np.empty(indptr[-1], np.uint64)
        hash_prompt_blocks(workload.hash_indptr, workload.hash_ids, input_len,
                           workload.trace_block_size, block_size, indptr, phash)
    plan, authored = kernel_output_plan(workload, authored_base)
    parts = dict(hash_indptr=workload.hash_indptr[:-1] + hash_base, hash_ids=workload.hash_ids,
                 trace_block_size=np.full(len(input_len), workload.trace_block_size, np.int64),
                 phash_indptr=indptr[:-1] + phash_base, phash=phash, out_plan=plan,
                 out_authored=authored)
    return WorkloadRows(parts, len(workload.hash_ids), len(phash), len(authored))


def append_workload_rows(state: KernelState, workload, block_sizes) -> dict:
    """Append the trace rows of ``workload`` once per engine block size (prompt tokens
    and prompt block hashes; block size 0: an SGLang pool's rows, without hashes);
    returns {(id(workload), block size): first table row}."""
    wl = state.wl
    rows = {}
    parts = {name: [getattr(wl, name)[:-1] if name.endswith("indptr") else getattr(wl, name)]
             for name in L.Workload._fields}
    n_rows = len(wl.trace_block_size)
    hash_end = int(wl.hash_indptr[-1])
    phash_end = int(wl.phash_indptr[-1])
    authored_end = len(wl.out_authored)
    for bs in dict.fromkeys(block_sizes):
        rows[(id(workload), bs)] = n_rows
        block = workload_rows(workload, bs, hash_end, phash_end, authored_end)
        for name, values in block.parts.items():
            parts[name].append(values)
        n_rows += len(workload.input_len)
        hash_end += block.n_hash_ids
        phash_end += block.n_block_hashes
        authored_end += block.n_authored
    parts["hash_indptr"].append(np.array([hash_end], np.int64))
    parts["phash_indptr"].append(np.array([phash_end], np.int64))
    state.wl = L.Workload(**{k: append_into(state.buffers, "wl." + k, v[0], v[1:]) for k, v in parts.items()})
    return rows


def _renumber(values: np.ndarray, new_q: np.ndarray) -> None:
    """Renumber the request rows among ``values`` in place (-1 and garbage past the
    old rows stay as they are: unused slots of a queue are never read)."""
    ok = (values >= 0) & (values < len(new_q) - 1)
    values[ok] = new_q[values[ok]]


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges [starts[i], starts[i] + lengths[i])."""
    lengths = np.asarray(lengths, np.int64)
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(np.asarray(starts, np.int64), lengths) + within


def add_rows_many(state: KernelState, items) -> None:
    """Give each simulation ``s`` of ``items`` (a list of (s, tpl, run_cap, wait_cap),
    each simulation at most once) the requests of ``tpl`` (a replay ``_SimTemplate``
    of the added rows, their workload rows already appended): their rows after s's,
    their leases at the end, their first turns merged into s's start order (open loop:
    by start time, after the old ones on ties; closed loop: after every old session),
    and ``run_cap`` / ``wait_cap`` slots (None: unchanged) in each of s's worker
    queues. Every array is rebuilt once for all of them (a batched Submit over many
    ranks costs one growth, not one per rank)."""
    rq, st, wk = state.rq, state.st, state.wk
    sm = st.i64
    n_sims = len(sm)
    q_off = sm[:, L.SM_Q_OFF].copy()
    q_len = sm[:, L.SM_Q_LEN].copy()
    p_off = sm[:, L.SM_PREFILL_Q_OFF].copy()
    m = np.zeros(n_sims, np.int64)      # rows added per simulation
    tpl_of = {}
    for s, tpl, _, _ in items:
        if s in tpl_of:
            raise ValueError(f"add_rows_many: simulation {s} appears twice")
        tpl_of[s] = tpl
        m[s] = len(tpl.rq_i)
    disagg = sm[:, L.SM_PREFILL_LEN] > 0
    n_q = len(rq.i64)
    n_logical = len(st.start_order)
    n_added = int(m.sum())

    # the new layout: logical regions in their old order (an empty region before a
    # non-empty one at the same offset), each grown by its simulation's new rows; then
    # the prefill regions of the disaggregated simulations likewise
    order = np.lexsort((np.arange(n_sims), q_len > 0, q_off))
    grown = q_len + m
    new_q_off = np.empty(n_sims, np.int64)
    new_q_off[order] = np.cumsum(grown[order]) - grown[order]
    n_logical_new = n_logical + n_added
    new_p_off = np.full(n_sims, -1, np.int64)
    pd_sims = np.flatnonzero(disagg)
    if len(pd_sims):
        porder = pd_sims[np.lexsort((pd_sims, q_len[pd_sims] > 0, p_off[pd_sims]))]
        new_p_off[porder] = n_logical_new + np.cumsum(grown[porder]) - grown[porder]
    # old row -> new row (the sentinel n_q -> the new end)
    new_q = np.empty(n_q + 1, np.int64)
    new_q[_segments(q_off, q_len)] = _segments(new_q_off, q_len)
    if len(pd_sims):
        new_q[_segments(p_off[pd_sims], q_len[pd_sims])] = _segments(new_p_off[pd_sims], q_len[pd_sims])
    n_new = n_q + n_added + int(m[pd_sims].sum())
    new_q[n_q] = n_new

    # request rows: the old ones renumbered, then the new ones written in place
    rq_i = np.empty((n_new, L.RQ_I_FIELDS), np.int64)
    rq_f = np.empty((n_new, L.RQ_F_FIELDS), np.float64)
    moved = rq.i64.copy()
    for col in L.REQUEST_I.columns_pointing_to("q"):
        _renumber(moved[:, col], new_q)
    rq_i[new_q[:-1]] = moved
    rq_f[new_q[:-1]] = rq.f64
    n_k = len(rq.lease)
    n_k_new = n_k
    a_new = {}
    for s, tpl in tpl_of.items():
        k = int(m[s])
        a = int(new_q_off[s] + q_len[s])  # s's first new logical row
        a_new[s] = a
        tpl.rq_i.write(rq_i[a:a + k], lease_off=n_k_new)
        rq_i[a:a + k, L.RQ_NEXT_TURN] = np.where(tpl.next_turn >= 0, tpl.next_turn + a, -1)
        tpl.rq_f.write(rq_f[a:a + k])
        n_k_new += tpl.lease_entries
        if disagg[s]:
            pa = int(new_p_off[s] + q_len[s])  # s's first new prefill row
            tpl.prefill_rq_i.write(rq_i[pa:pa + k], lease_off=n_k_new)
            rq_i[pa:pa + k, L.RQ_PEER] = np.arange(a, a + k)
            rq_i[a:a + k, L.RQ_PEER] = np.arange(pa, pa + k)
            rq_f[pa:pa + k] = L.REQUEST_F.new(k)
            n_k_new += tpl.prefill_lease_entries
    lease = append_into(state.buffers, "rq.lease", rq.lease, [np.full(n_k_new - n_k, L.NO_BLOCK, np.int32)])
    seq_hash = append_into(state.buffers, "rq.seq_hash", rq.seq_hash, [np.zeros(n_k_new - n_k, np.uint64)])
    state.rq = L.Requests(i64=rq_i, f64=rq_f, lease=lease, seq_hash=seq_hash)

    # simulations: offsets follow their rows
    sm[:, L.SM_Q_OFF] = new_q_off
    sm[:, L.SM_PREFILL_Q_OFF] = new_p_off
    for col in L.SIMULATION.columns_pointing_to("q"):
        if col not in (L.SM_Q_OFF, L.SM_PREFILL_Q_OFF):
            _renumber(sm[:, col], new_q)
    sm[:, L.SM_Q_LEN] = grown

    # per-request regions of the simulations (slices of n_logical at SM_Q_OFF): every
    # region moved as a whole, a grown one filled by its rule
    def regions(old: np.ndarray, fill) -> np.ndarray:
        out = np.zeros(n_logical_new, np.int64)
        out[_segments(new_q_off, q_len)] = old[_segments(q_off, q_len)]
        for s in tpl_of:
            out[new_q_off[s]:new_q_off[s] + grown[s]] = fill(s, old[q_off[s]:q_off[s] + q_len[s]])
        _renumber(out, new_q)
        return out

    def same_front(s, region: np.ndarray) -> np.ndarray:  # heaps: the prefix is the heap
        return np.concatenate([region, np.zeros(m[s], np.int64)])

    def unrolled_ring(s, region: np.ndarray) -> np.ndarray:  # the ring from its head at 0
        head, n = sm[s, L.SM_ACTQ_HEAD], sm[s, L.SM_ACTQ_LEN]
        out = np.zeros(len(region) + m[s], np.int64)
        if len(region):
            out[:n] = region[(head + np.arange(n)) % len(region)]
        return out

    # the start order: old entries renumbered; a grown simulation's merged with its new
    # first turns (already new numbers: they are past its old rows)
    start_order = np.zeros(n_logical_new, np.int64)
    start_order[_segments(new_q_off, q_len)] = new_q[st.start_order[_segments(q_off, q_len)]]
    for s, tpl in tpl_of.items():
        old = start_order[new_q_off[s]:new_q_off[s] + q_len[s]][:sm[s, L.SM_NUM_STARTS]].copy()
        firsts = tpl.firsts + a_new[s]
        ptr = sm[s, L.SM_START_PTR]
        if sm[s, L.SM_CONCURRENCY] == 0:
            # open loop: the unreleased old entries and the new ones by start time,
            # old first on ties (stable)
            rest = np.concatenate([old[ptr:], firsts])
            t = np.concatenate([rq_f[old[ptr:], L.RQF_START_MS], rq_f[firsts, L.RQF_START_MS]])
            merged = np.concatenate([old[:ptr], rest[np.argsort(t, kind="stable")]])
        else:
            merged = np.concatenate([old, firsts])
        start_order[new_q_off[s]:new_q_off[s] + grown[s]] = 0
        start_order[new_q_off[s]:new_q_off[s] + len(merged)] = merged
        sm[s, L.SM_NUM_STARTS] = len(merged)
    actq = regions(st.actq, unrolled_ring)
    for s in tpl_of:
        sm[s, L.SM_ACTQ_HEAD] = 0
    hlog = st.hlog
    if hlog.shape[1]:  # six lifecycle rows per disaggregated request
        rows_needed = int(sm[disagg, L.SM_Q_LEN].max(initial=0)) * len(L.HANDOFF_EVENT_NAMES)
        if rows_needed > hlog.shape[1]:
            hlog = np.zeros((hlog.shape[0], rows_needed, hlog.shape[2]))
            hlog[:, :st.hlog.shape[1]] = st.hlog
    state.st = st._replace(start_order=start_order, heap_q=regions(st.heap_q, same_front), actq=actq,
                           xfer_heap=regions(st.xfer_heap, same_front), hlog=hlog)

    # workers: request links renumbered, the grown simulations' queues resized
    wi = wk.i64
    for col in L.WORKER.columns_pointing_to("q"):
        _renumber(wi[:, col], new_q)
    run_caps = wi[:, L.WK_RUN_CAP].copy()
    wait_caps = wi[:, L.WK_WAIT_CAP].copy()
    for s, _, run_cap, wait_cap in items:
        for w in range(int(sm[s, L.SM_W_OFF]), int(sm[s, L.SM_W_OFF] + sm[s, L.SM_W_LEN])):
            if run_cap is not None:
                run_caps[w] = max(run_caps[w], min(run_cap, int(state.cfg.i64[w, L.CFG_MAX_NUM_SEQS]) + 1))
            if wait_cap is not None:
                wait_caps[w] = max(wait_caps[w], wait_cap)
    run_off = np.cumsum(run_caps) - run_caps
    wait_off = np.cumsum(wait_caps) - wait_caps
    run_q = np.zeros(int(run_caps.sum()), np.int64)
    n_run = wi[:, L.WK_RUN_LEN]
    run_q[_segments(run_off, n_run)] = wk.run_q[_segments(wi[:, L.WK_RUN_OFF], n_run)]
    wait_q = np.zeros(int(wait_caps.sum()), np.int64)
    same = wait_caps == wi[:, L.WK_WAIT_CAP]  # a ring of the same size: copied as it is
    wait_q[_segments(wait_off[same], wait_caps[same])] = \
        wk.wait_q[_segments(wi[same, L.WK_WAIT_OFF], wait_caps[same])]
    for w in np.flatnonzero(~same):  # a larger ring: the old one unrolled from its head at 0
        n = wi[w, L.WK_WAIT_LEN]
        pos = (wi[w, L.WK_WAIT_HEAD] + np.arange(n)) % wi[w, L.WK_WAIT_CAP]
        wait_q[wait_off[w]:wait_off[w] + n] = wk.wait_q[wi[w, L.WK_WAIT_OFF] + pos]
        wi[w, L.WK_WAIT_HEAD] = 0
    _renumber(run_q, new_q)
    _renumber(wait_q, new_q)
    wi[:, L.WK_RUN_OFF] = run_off
    wi[:, L.WK_RUN_CAP] = run_caps
    wi[:, L.WK_WAIT_OFF] = wait_off
    wi[:, L.WK_WAIT_CAP] = wait_caps
    state.wk = wk._replace(run_q=run_q, wait_q=wait_q)
    state.max_lease = max([state.max_lease] + [tpl.max_lease_blocks for tpl in tpl_of.values()])
