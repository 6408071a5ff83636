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

from aisim_fast.growing_arrays import append_into
from aisim_fast.kernels import layout as L
from aisim_fast.kernels.prompt_blocks import count_prompt_blocks, hash_prompt_blocks


@dataclass
class KernelState:
    """The arrays of one batch as the kernels take them (see kernels.layout)."""
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


def append_workload_rows(state: KernelState, workload, block_sizes) -> dict:
    """Append the trace rows of ``workload`` once per engine block size (prompt tokens
    and prompt block hashes; block size 0: an SGLang pool's rows, without hashes);
    returns {(id(workload), block size): first table row}."""
    wl = state.wl
    rows = {}
    parts = dict(hash_indptr=[wl.hash_indptr[:-1]], hash_ids=[wl.hash_ids],
                 trace_block_size=[wl.trace_block_size], phash_indptr=[wl.phash_indptr[:-1]],
                 phash=[wl.phash], out_plan=[wl.out_plan], out_authored=[wl.out_authored])
    n_rows = len(wl.trace_block_size)
    hash_end = int(wl.hash_indptr[-1])
    phash_end = int(wl.phash_indptr[-1])
    input_len = workload.input_len.astype(np.int64)
    for bs in dict.fromkeys(block_sizes):
        rows[(id(workload), bs)] = n_rows
        if bs == 0:  # an SGLang pool's rows: no hashes (replay._table_key)
            indptr = np.zeros(len(input_len) + 1, np.int64)
            phash = np.zeros(0, np.uint64)
        else:
            indptr = count_prompt_blocks(input_len, bs)
            phash = np.empty(indptr[-1], np.uint64)
            hash_prompt_blocks(workload.hash_indptr, workload.hash_ids, input_len,
                               workload.trace_block_size, bs, indptr, phash)
        parts["hash_indptr"].append(workload.hash_indptr[:-1] + hash_end)
        parts["hash_ids"].append(workload.hash_ids)
        parts["trace_block_size"].append(np.full(len(input_len), workload.trace_block_size, np.int64))
        parts["phash_indptr"].append(indptr[:-1] + phash_end)
        parts["phash"].append(phash)
        plan, authored = kernel_output_plan(workload, sum(len(a) for a in parts["out_authored"]))
        parts["out_plan"].append(plan)
        parts["out_authored"].append(authored)
        n_rows += len(input_len)
        hash_end += len(workload.hash_ids)
        phash_end += len(phash)
    parts["hash_indptr"].append(np.array([hash_end], np.int64))
    parts["phash_indptr"].append(np.array([phash_end], np.int64))
    state.wl = L.Workload(**{k: append_into(state.buffers, "wl." + k, v[0], v[1:]) for k, v in parts.items()})
    return rows



def _renumber(values: np.ndarray, new_q: np.ndarray) -> None:
    """Renumber the request rows among ``values`` in place (-1 and garbage past the
    old rows stay as they are: unused slots of a queue are never read)."""
    ok = (values >= 0) & (values < len(new_q) - 1)
    values[ok] = new_q[values[ok]]


def add_rows(state: KernelState, s: int, tpl, run_cap: int | None, wait_cap: int | None) -> None:
    """Give simulation ``s`` the requests of ``tpl`` (a replay ``_SimTemplate`` of the
    added rows, their workload rows already appended): their rows after s's, their
    leases at the end, their first turns merged into s's start order (open loop: by
    start time, after the old ones on ties; closed loop: after every old session),
    and ``run_cap`` / ``wait_cap`` slots (None: unchanged) in each of s's worker
    queues."""
    rq, st, wk = state.rq, state.st, state.wk
    sm = st.i64
    m = len(tpl.rq_i)
    q_off = sm[:, L.SM_Q_OFF].copy()
    q_len = sm[:, L.SM_Q_LEN].copy()
    p_off = sm[:, L.SM_PREFILL_Q_OFF].copy()
    disagg = sm[s, L.SM_PREFILL_LEN] > 0
    n_q = len(rq.i64)
    n_logical = len(st.start_order)

    # new row of every old row: +m past s's logical rows (that includes every prefill
    # row), +m more past s's prefill rows
    shift = np.zeros(n_q + 1, np.int64)
    shift[q_off[s] + q_len[s]:] += m
    if disagg:
        shift[p_off[s] + q_len[s]:] += m
    new_q = np.arange(n_q + 1, dtype=np.int64) + shift
    a_new = q_off[s] + q_len[s]            # s's first new logical row
    pa_new = p_off[s] + m + q_len[s]       # s's first new prefill row (disaggregated)

    # request rows: the old ones renumbered, then the new ones written in place
    n_new = n_q + (2 * m if disagg else m)
    rq_i = np.empty((n_new, L.RQ_I_FIELDS), np.int64)
    rq_f = np.empty((n_new, L.RQ_F_FIELDS), np.float64)
    rq_i[new_q[:-1]] = rq.i64
    rq_f[new_q[:-1]] = rq.f64
    moved = rq_i[new_q[:-1]]
    for col in L.REQUEST_I.columns_pointing_to("q"):
        _renumber(moved[:, col], new_q)
    rq_i[new_q[:-1]] = moved
    n_k = len(rq.lease)
    rows = tpl.rq_i.copy()
    rows[:, L.RQ_LEASE_OFF] += n_k
    rows[:, L.RQ_NEXT_TURN] = np.where(tpl.next_turn >= 0, tpl.next_turn + a_new, -1)
    rq_i[a_new:a_new + m] = rows
    rq_f[a_new:a_new + m] = tpl.rq_f
    n_k_new = n_k + tpl.lease_entries
    if disagg:
        prows = tpl.prefill_rq_i.copy()
        prows[:, L.RQ_LEASE_OFF] += n_k_new
        prows[:, L.RQ_PEER] = np.arange(a_new, a_new + m)
        rq_i[a_new:a_new + m, L.RQ_PEER] = np.arange(pa_new, pa_new + m)
        rq_i[pa_new:pa_new + m] = prows
        rq_f[pa_new:pa_new + m] = L.REQUEST_F.new(m)
        n_k_new += tpl.prefill_lease_entries
    lease = append_into(state.buffers, "rq.lease", rq.lease, [np.full(n_k_new - n_k, L.NO_BLOCK, np.int32)])
    seq_hash = append_into(state.buffers, "rq.seq_hash", rq.seq_hash, [np.zeros(n_k_new - n_k, np.uint64)])
    state.rq = L.Requests(i64=rq_i, f64=rq_f, lease=lease, seq_hash=seq_hash)

    # simulations: offsets follow their rows
    new_q_off = q_off + shift[q_off]
    new_q_off[s] = q_off[s]
    new_p_off = np.where(p_off >= 0, p_off + shift[np.maximum(p_off, 0)], -1)
    if disagg:
        new_p_off[s] = p_off[s] + m
    sm[:, L.SM_Q_OFF] = new_q_off
    sm[:, L.SM_PREFILL_Q_OFF] = new_p_off
    for col in L.SIMULATION.columns_pointing_to("q"):
        if col not in (L.SM_Q_OFF, L.SM_PREFILL_Q_OFF):
            _renumber(sm[:, col], new_q)
    sm[s, L.SM_Q_LEN] = q_len[s] + m

    # per-request regions of the simulations (slices of n_logical at SM_Q_OFF)
    def regions(old: np.ndarray, fill_s) -> np.ndarray:
        out = np.zeros(n_logical + m, np.int64)
        for i in range(len(q_off)):
            if i != s:
                out[new_q_off[i]:new_q_off[i] + q_len[i]] = old[q_off[i]:q_off[i] + q_len[i]]
        out[q_off[s]:q_off[s] + q_len[s] + m] = fill_s(old[q_off[s]:q_off[s] + q_len[s]])
        _renumber(out, new_q)
        return out

    def same_front(region: np.ndarray) -> np.ndarray:  # heaps: the prefix is the heap
        return np.concatenate([region, np.zeros(m, np.int64)])

    def unrolled_ring(region: np.ndarray) -> np.ndarray:  # the ring from its head at 0
        head, n = sm[s, L.SM_ACTQ_HEAD], sm[s, L.SM_ACTQ_LEN]
        out = np.zeros(len(region) + m, np.int64)
        if len(region):
            out[:n] = region[(head + np.arange(n)) % len(region)]
        return out

    firsts = tpl.firsts + a_new  # new numbers (not renumbered below: they are past old rows)
    n_starts, ptr = sm[s, L.SM_NUM_STARTS], sm[s, L.SM_START_PTR]

    def merged_starts(region: np.ndarray) -> np.ndarray:
        old = new_q[region[:n_starts]]
        if sm[s, L.SM_CONCURRENCY] == 0:
            # open loop: the unreleased old entries and the new ones by start time,
            # old first on ties (stable)
            rest = np.concatenate([old[ptr:], firsts])
            t = np.concatenate([rq_f[old[ptr:], L.RQF_START_MS], rq_f[firsts, L.RQF_START_MS]])
            order = np.concatenate([old[:ptr], rest[np.argsort(t, kind="stable")]])
        else:
            order = np.concatenate([old, firsts])
        out = np.zeros(len(region) + m, np.int64)
        out[:len(order)] = order
        return out

    # the start order's entries are renumbered inside merged_starts (it mixes in new rows)
    start_order = np.zeros(n_logical + m, np.int64)
    for i in range(len(q_off)):
        if i != s:
            start_order[new_q_off[i]:new_q_off[i] + q_len[i]] = new_q[st.start_order[q_off[i]:q_off[i] + q_len[i]]]
    start_order[q_off[s]:q_off[s] + q_len[s] + m] = merged_starts(st.start_order[q_off[s]:q_off[s] + q_len[s]])
    actq = regions(st.actq, unrolled_ring)
    sm[s, L.SM_ACTQ_HEAD] = 0
    sm[s, L.SM_NUM_STARTS] = n_starts + len(firsts)
    hlog = st.hlog
    if hlog.shape[1]:  # six lifecycle rows per disaggregated request
        rows_needed = int(sm[s, L.SM_Q_LEN]) * len(L.HANDOFF_EVENT_NAMES)
        if disagg and rows_needed > hlog.shape[1]:
            hlog = np.zeros((hlog.shape[0], rows_needed, hlog.shape[2]))
            hlog[:, :st.hlog.shape[1]] = st.hlog
    state.st = st._replace(start_order=start_order, heap_q=regions(st.heap_q, same_front), actq=actq,
                           xfer_heap=regions(st.xfer_heap, same_front), hlog=hlog)

    # workers: request links renumbered, s's queues resized
    wi = wk.i64
    for col in L.WORKER.columns_pointing_to("q"):
        _renumber(wi[:, col], new_q)
    ws = range(int(sm[s, L.SM_W_OFF]), int(sm[s, L.SM_W_OFF] + sm[s, L.SM_W_LEN]))
    run_caps = wi[:, L.WK_RUN_CAP].copy()
    wait_caps = wi[:, L.WK_WAIT_CAP].copy()
    for w in ws:
        if run_cap is not None:
            run_caps[w] = max(run_caps[w], min(run_cap, int(state.cfg.i64[w, L.CFG_MAX_NUM_SEQS]) + 1))
        if wait_cap is not None:
            wait_caps[w] = max(wait_caps[w], wait_cap)
    run_q = np.zeros(int(run_caps.sum()), np.int64)
    wait_q = np.zeros(int(wait_caps.sum()), np.int64)
    run_off = np.cumsum(run_caps) - run_caps
    wait_off = np.cumsum(wait_caps) - wait_caps
    for w in range(len(wi)):
        n = wi[w, L.WK_RUN_LEN]
        run_q[run_off[w]:run_off[w] + n] = wk.run_q[wi[w, L.WK_RUN_OFF]:wi[w, L.WK_RUN_OFF] + n]
        n = wi[w, L.WK_WAIT_LEN]
        if wait_caps[w] == wi[w, L.WK_WAIT_CAP]:
            wait_q[wait_off[w]:wait_off[w] + wait_caps[w]] = \
                wk.wait_q[wi[w, L.WK_WAIT_OFF]:wi[w, L.WK_WAIT_OFF] + wait_caps[w]]
        else:  # a larger ring: the old one unrolled from its head at 0
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
    state.max_lease = max(state.max_lease, tpl.max_lease_blocks)
