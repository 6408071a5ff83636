"""A batch of simulations lowered into the kernels' structure-of-arrays state."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aisim_fast.engine import reused_buffers
from aisim_fast.engine.agentic_state import agentic_state
from aisim_fast.engine.frames import handoff_log_rows
from aisim_fast.engine.grow import workload_rows
from aisim_fast.engine.lowering import pool_extents, reset_pools, small_pages, with_aic_tables
from aisim_fast.engine.memory import check_state_fits
from aisim_fast.engine.simulation import Simulation, router_config
from aisim_fast.engine.split import workers_independent
from aisim_fast.engine.templates import (SIM_SETTINGS, SimTemplate, fresh_row, pow2_at_least, sim_template,
                                         table_key)
from aisim_fast.kernels.features import features_of, union
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.sglang import radix as sglang_radix
from aisim_fast.kernels.spec.sampler import stream_key
from aisim_fast.kernels.stats import sketch

DEFAULT_PASS_LOG_ROWS = 65536


# slots of a KV-router active-block multiset to begin with (kernels.routing.kv_router grows it)
ROUTER_INITIAL_SLOTS = 1024


def build_state(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
                record_handoffs: bool = False, event_rows: int = 0, log_outputs: bool = False,
                log_kv: bool = True, independent_workers: bool = False, features=None):
    """Allocate and initialise the kernel state of a batch (``event_rows`` > 0: an engine
    event log of that many rows per simulation; ``log_outputs``: every output token in
    it too; ``log_kv``: the KV Stored / Removed facts too, else engine facts only).
    ``independent_workers``: the simulations whose workers share nothing between
    releases (``workers_independent``; the batch logs nothing and does not grow) run
    so (``SM_INDEPENDENT``), each worker folding its token gaps into a row of its own
    after the simulations' rows (``BatchRun`` merges them when the simulation ends).
    ``features`` (``layout.Features``): optional kernel code to compile in beyond what
    the batch reaches (one compiled set for every rank group, say)."""
    n_sims = len(sims)
    # workload tables: one block of rows per distinct (trace, engine block size)
    table_rows: dict[tuple[int, int], int] = {}
    tables = []
    n_rows = 0
    for sim in sims:
        for rank in [sim.rank] + ([sim.prefill_rank] if sim.disaggregated else []):
            key = table_key(sim.workload, rank)
            if key not in table_rows:
                table_rows[key] = n_rows
                tables.append((sim.workload, key[1]))
                n_rows += len(sim.workload.input_len)
    parts = {name: [] for name in L.Workload._fields}
    distinct_prompt_blocks: dict[tuple[int, int], int] = {}
    hash_base = phash_base = authored_base = 0
    for wl, bs in tables:
        block = workload_rows(wl, bs, hash_base, phash_base, authored_base)
        if bs != 0:
            distinct_prompt_blocks[(id(wl), bs)] = len(np.unique(block.parts["phash"]))
        for name, values in block.parts.items():
            parts[name].append(values)
        hash_base += block.n_hash_ids
        phash_base += block.n_block_hashes
        authored_base += block.n_authored
    parts["hash_indptr"].append(np.array([hash_base], np.int64))
    parts["phash_indptr"].append(np.array([phash_base], np.int64))
    workload = L.Workload(**{name: np.concatenate(values) for name, values in parts.items()})

    q_len = np.array([len(s.workload.input_len) for s in sims], np.int64)
    q_off = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int64)
    w_len = np.array([s.ranks + s.prefill_ranks for s in sims], np.int64)
    w_off = np.concatenate([[0], np.cumsum(w_len)[:-1]]).astype(np.int64)
    n_logical = int(q_len.sum())
    # the prefill rows of disaggregated simulations follow every logical row
    p_len = np.where([s.disaggregated for s in sims], q_len, 0).astype(np.int64)
    p_off = n_logical + np.concatenate([[0], np.cumsum(p_len)[:-1]]).astype(np.int64)
    n_q = n_logical + int(p_len.sum())
    n_w = int(w_len.sum())

    # every simulation's template first: the state's size is known before any of it
    # is allocated, and a batch that cannot fit is refused in one line
    templates: dict[tuple, SimTemplate] = {}
    memo: dict = {}  # what templates of one workload or pool share
    sim_templates = []
    for sim in sims:
        key = (id(sim.workload),) + tuple(getattr(sim, f.name) for f in SIM_SETTINGS)
        if key not in templates:
            templates[key] = sim_template(sim, table_rows, distinct_prompt_blocks, memo)
        sim_templates.append(templates[key])
    check_state_fits(sims, sim_templates, n_q, pass_log_rows, event_rows)

    # per-request state, field-major (see kernels.schema.layout)
    # every row is written from its simulation's template below
    rq_i = reused_buffers.empty("request_fields", (n_q, L.RQ_I_FIELDS), np.int64)
    rq_f = reused_buffers.empty("request_times", (n_q, L.RQ_F_FIELDS), np.float64)
    n_k = 0  # lease entries so far: each row's lease follows the previous one
    start_order = np.zeros(n_logical, np.int64)
    cfg_i = np.zeros((n_w, L.CFG_I_FIELDS), np.int64)
    cfg_f = np.zeros((n_w, L.CFG_F_FIELDS), np.float64)
    sm_i = L.SIMULATION.new(n_sims)
    arena = np.empty(n_w, np.int64)
    nodes = np.zeros(n_w, np.int64)
    run_cap = np.empty(n_w, np.int64)
    wait_cap = np.empty(n_w, np.int64)
    lease_ranges = []  # (first, end) lease entries of each vLLM / TRT-LLM simulation
    for s, sim in enumerate(sims):
        tpl = sim_templates[s]
        a, n = int(q_off[s]), int(q_len[s])
        sl = slice(a, a + n)
        if sim.rank.backend != "sglang":
            lease_ranges.append((n_k, n_k + tpl.lease_entries + (tpl.prefill_lease_entries
                                                                  if sim.disaggregated else 0)))
        tpl.rq_i.write(rq_i[sl], lease_off=n_k)
        n_k += tpl.lease_entries
        tpl.rq_f.write(rq_f[sl])
        rq_i[sl, L.RQ_NEXT_TURN] = np.where(tpl.next_turn >= 0, tpl.next_turn + a, -1)
        start_order[a:a + len(tpl.firsts)] = tpl.firsts + a
        sm_i[s, L.SM_NUM_STARTS] = len(tpl.firsts)
        sm_i[s, L.SM_CONCURRENCY] = sim.concurrency
        if sim.disaggregated:
            pa = int(p_off[s])
            psl = slice(pa, pa + n)
            tpl.prefill_rq_i.write(rq_i[psl], lease_off=n_k)
            rq_f[psl] = fresh_row(L.REQUEST_F)
            n_k += tpl.prefill_lease_entries
            rq_i[psl, L.RQ_PEER] = np.arange(a, a + n)
            rq_i[sl, L.RQ_PEER] = np.arange(pa, pa + n)
        for first, n_workers, pool in tpl.pools:
            ws = slice(int(w_off[s]) + first, int(w_off[s]) + first + n_workers)
            arena[ws], run_cap[ws], wait_cap[ws] = pool.arena, pool.run_cap, pool.wait_cap
            nodes[ws] = pool.nodes
            cfg_i[ws] = pool.cfg_i
            cfg_f[ws] = pool.cfg_f
            cfg_i[ws, L.CFG_DP_RANK] = np.arange(n_workers) % pool.cfg_i[L.CFG_DP_SIZE]
    cfg = with_aic_tables(L.RankConfig(i64=cfg_i, f64=cfg_f), sims, w_off)

    # a block lease starts empty; an SGLang lease is written before it is read (a page
    # per position as the request takes it), and filling its tens of megabytes would
    # cost a 10k-request SGLang replay 5-10 ms of its ~100
    lease = reused_buffers.empty("lease", n_k, np.int32)
    for first, end in lease_ranges:
        lease[first:end] = L.NO_BLOCK
    # a key is written before it is read (RQ_NUM_HASHED counts the written ones)
    rq = L.Requests(i64=rq_i, f64=rq_f, lease=lease,
                    seq_hash=reused_buffers.empty("seq_hash", n_k, np.uint64))

    # SGLang workers keep their KV in a radix cache (kernels.sglang.radix), sized like
    # the block arena it replaces: a page slot per resident page, a node per page
    sglang = cfg_i[:, L.CFG_POLICY] == L.POLICY_SGLANG
    radix = {}
    if sglang.any():
        radix = dict(radix=sglang_radix.make_radix(
            np.where(sglang, cfg_i[:, L.CFG_NUM_GPU_BLOCKS], 0), np.where(sglang, nodes, 0),
            page_size=np.where(sglang, cfg_i[:, L.CFG_BLOCK_SIZE], 1), page_slots=np.where(sglang, arena, 0),
            empty=reused_buffers.empty))
        arena = np.where(sglang, 1, arena)
    tab_size = np.array([pow2_at_least(2 * a) for a in arena], np.int64)
    pool_w = L.POOL_W.new(n_w)
    pool_w[:, L.PW_BLK_OFF] = np.concatenate([[0], np.cumsum(arena)[:-1]])
    pool_w[:, L.PW_BLK_LEN] = arena
    pool_w[:, L.PW_TAB_OFF] = np.concatenate([[0], np.cumsum(tab_size)[:-1]])
    pool_w[:, L.PW_TAB_MASK] = tab_size - 1
    n_b = int(arena.sum())
    # arena slots are initialized when first used (block_pool._take_slot)
    with small_pages():
        b32 = reused_buffers.empty("block_fields", (n_b, L.PB_FIELDS), np.int32)
        blk_hash = reused_buffers.empty("block_hash", n_b, np.uint64)
    pool_w[:, L.PW_SIM] = np.repeat(np.arange(n_sims), w_len)
    # the workers whose prefix index a kv_router reads (aggregated and prefill pools): a
    # region of pool.evicted_hash each, as large as the arena (a pass evicts each copy
    # at most once); only its first PW_EVICTED_LEN slots are read
    overlap_aware = np.repeat([sim.placement == "kv_router" for sim in sims], w_len) \
        & (cfg_i[:, L.CFG_ROLE] != L.ROLE_DECODE)
    evicted_cap = np.where(overlap_aware, arena, 0)
    pool_w[:, L.PW_EVICTED_OFF] = np.concatenate([[0], np.cumsum(evicted_cap)[:-1]])
    pool_w[:, L.PW_EVICTED_CAP] = evicted_cap
    evicted_hash = np.zeros(0, np.uint64)
    if evicted_cap.any():
        with small_pages():
            evicted_hash = reused_buffers.empty("router_evicted", int(evicted_cap.sum()), np.uint64)
    event_log = {}
    if event_rows > 0:  # row 0 of each simulation is its header (len, clock)
        event_log = dict(event_log=np.zeros((n_sims, 1 + event_rows, L.EV_NUM_COLUMNS), np.int64))
        event_log["event_log"][:, 0, L.EVH_OUTPUTS] = 1 if log_outputs else 0
        event_log["event_log"][:, 0, L.EVH_KV] = 1 if log_kv else 0
        if radix and log_kv:
            # the radix caches log their KV events into the same log, with the
            # sequence hash of every page slot for its Removed event
            rad = radix["radix"]
            rad.w64[:, L.RW_SIM] = np.repeat(np.arange(n_sims), w_len)
            radix["radix"] = rad._replace(pg_hash=np.empty(len(rad.pg_key), np.uint64),
                                          event_log=event_log["event_log"])
    pool = L.Pool(w64=pool_w, b32=b32, blk_hash=blk_hash,
                  tab=reused_buffers.empty("block_table", int(tab_size.sum()), np.int32),
                  evicted_hash=evicted_hash, **event_log, **radix)
    reset_pools(pool)

    wk_i = L.WORKER.new(n_w)
    wk_i[:, L.WK_SIM] = np.repeat(np.arange(n_sims), w_len)
    wk_i[:, L.WK_STAT_ROW] = wk_i[:, L.WK_SIM]
    # an independent simulation logs nothing (the order of its rows would depend on how
    # its decode runs were cut)
    unlogged = independent_workers and not pass_log_rows and not event_rows and not log_outputs
    independent = [s for s, sim in enumerate(sims) if unlogged and workers_independent(sim)]
    n_stat_rows = n_sims
    for s in independent:
        ws = slice(int(w_off[s]), int(w_off[s] + w_len[s]))
        wk_i[ws, L.WK_STAT_ROW] = np.arange(n_stat_rows, n_stat_rows + w_len[s])
        n_stat_rows += int(w_len[s])
    wk_i[:, L.WK_SIM_W0] = np.repeat(w_off, w_len)
    wk_i[:, L.WK_RUN_OFF] = np.concatenate([[0], np.cumsum(run_cap)[:-1]])
    wk_i[:, L.WK_WAIT_OFF] = np.concatenate([[0], np.cumsum(wait_cap)[:-1]])
    wk_i[:, L.WK_WAIT_CAP] = wait_cap
    wk_i[:, L.WK_RUN_CAP] = run_cap
    wk_i[sglang, L.WK_SG_RATIO_BITS] = cfg_f[sglang, L.CFGF_SG_INIT_RATIO].view(np.int64)
    routed = [s for s, sim in enumerate(sims) if sim.placement == "kv_router"]
    router_state = {}
    if routed:
        # per worker of a routed aggregated simulation, a multiset of its active prompt
        # blocks: room for every distinct complete prompt block of the trace, twice
        # over (a disaggregated pool's router counts blocks without the set)
        rt_slots = np.ones(n_w, np.int64)
        for s in routed:
            sim = sims[s]
            ws = slice(int(w_off[s]), int(w_off[s] + w_len[s]))
            if not sim.disaggregated:
                rt_slots[ws] = pow2_at_least(
                    2 * distinct_prompt_blocks[(id(sim.workload), sim.rank.block_size)] + 16)
            router = router_config(sim)
            cfg_f[ws, L.CFGF_ROUTER_CREDIT] = router.overlap_score_credit
            cfg_f[ws, L.CFGF_ROUTER_LOAD_SCALE] = router.prefill_load_scale
            cfg_f[ws, L.CFGF_ROUTER_TEMPERATURE] = router.router_temperature
            cfg_i[ws, L.CFG_ROUTER_PIN] = router.pin_to_trace_worker
        wk_i[:, L.WK_RT_OFF] = np.concatenate([[0], np.cumsum(rt_slots)[:-1]])
        wk_i[:, L.WK_RT_LIMIT] = rt_slots
        # each multiset starts in the first slots of its region and grows in the kernel
        # (kv_router._make_room): a worker holds a few hundred active blocks at once
        # where its region has room for every distinct block of the trace
        in_use = np.minimum(rt_slots, ROUTER_INITIAL_SLOTS)
        wk_i[:, L.WK_RT_MASK] = in_use - 1
        # a slot's key is read only once its count says it was taken, and the counts
        # only where the multiset is (a rebuild fills what it grows into): reused
        # buffers, whose pages a previous run has mapped already; small pages, as each
        # region is used from its start only (a huge page would zero 2 MiB for the
        # first 1,024 slots of a few workers)
        with small_pages():
            rt_count = reused_buffers.empty("router_counts", int(rt_slots.sum()), np.int32)
            rt_key = reused_buffers.empty("router_keys", int(rt_slots.sum()), np.uint64)
        for w in np.flatnonzero(rt_slots > 1):
            rt_count[wk_i[w, L.WK_RT_OFF]:wk_i[w, L.WK_RT_OFF] + in_use[w]] = -1  # RT_NEVER_USED
        router_state = dict(rt_key=rt_key, rt_count=rt_count)
    tokenization_state = {}
    tokenized = [s for s, sim in enumerate(sims) if sim.tokenization is not None]
    if tokenized:
        # a pool of servers ahead of every worker that takes arrivals (aggregated: each;
        # disaggregated: each prefill worker, numbered first; kernels.loop.tokenization),
        # all free at 0
        servers = np.zeros(n_w, np.int64)
        for s in tokenized:
            tok = sims[s].tokenization
            takes = sims[s].prefill_ranks if sims[s].disaggregated else int(w_len[s])
            ws = slice(int(w_off[s]), int(w_off[s]) + takes)
            # with attention DP the logical worker's first rank holds the pool of all its ranks
            servers[ws] = np.where(cfg_i[ws, L.CFG_DP_RANK] == 0, tok.workers, 0)
            cfg_f[ws, L.CFGF_TOK_BASE_MS] = tok.base_ms
            cfg_f[ws, L.CFGF_TOK_PER_TOKEN_MS] = tok.per_input_token_ms
        cfg_i[:, L.CFG_TOK_SERVERS] = servers
        wk_i[:, L.WK_TOK_OFF] = np.concatenate([[0], np.cumsum(servers)[:-1]])
        tokenization_state = dict(tok_free_ms=np.zeros(int(servers.sum())))
    frontend_state = _frontend_state(sims, w_off, w_len, wk_i)
    spec_state = _speculation_state(sims, w_off, cfg_i)
    wk = L.Workers(i64=wk_i, pass_end_ms=np.zeros(n_w),
                   run_q=np.zeros(int(run_cap.sum()), np.int64),
                   wait_q=np.zeros(int(wait_cap.sum()), np.int64),
                   busy_heap=np.zeros(n_w, np.int64), ready=np.ones(n_w, np.uint8), **router_state,
                   **tokenization_state, **frontend_state, **spec_state)
    sm_i[:, L.SM_Q_OFF] = q_off
    sm_i[:, L.SM_Q_LEN] = q_len
    sm_i[:, L.SM_W_OFF] = w_off
    sm_i[:, L.SM_W_LEN] = w_len
    sm_i[:, L.SM_PREFILL_LEN] = [sim.prefill_ranks for sim in sims]
    sm_i[:, L.SM_PLACEMENT] = [L.PLACEMENT_NAMES.index(sim.placement) for sim in sims]
    sm_i[:, L.SM_RNG_STATE] = [sim.placement_seed for sim in sims]
    sm_i[:, L.SM_PREFILL_Q_OFF] = np.where([s.disaggregated for s in sims], p_off, -1)
    # the handoff order is the backend's (spec/replay.md 5.2): SGLang reserves first
    sm_i[:, L.SM_DEST_FIRST] = [s.disaggregated and s.rank.backend == "sglang" for s in sims]
    sm_i[independent, L.SM_INDEPENDENT] = 1
    sm_i[:, L.SM_FRONTEND] = [sim.rank.frontend is not None and not sim.disaggregated for sim in sims]
    decisions = max([int(q_len[s]) * (2 if sims[s].disaggregated else 1) for s in routed], default=0)
    with small_pages():
        token_stat, token_hist = sketch.token_stats_new(n_stat_rows)
    graphs = agentic_state(sims, q_off, n_logical, sm_i, rq_f)
    sim_state = L.Sims(
        i64=sm_i, now_ms=np.zeros(n_sims), start_order=start_order,
        heap_q=np.zeros(n_logical, np.int64), actq=np.zeros(n_logical, np.int64),
        xfer_heap=np.zeros(n_logical, np.int64),
        token_stat=token_stat, token_hist=token_hist,
        pass_log=np.zeros((n_sims, pass_log_rows, L.PL_NUM_COLUMNS)),
        hlog=np.zeros((n_sims, handoff_log_rows(sims) if record_handoffs else 0, L.HL_NUM_COLUMNS)),
        # one decision per request of a routed simulation, two when disaggregated
        **(dict(rt_log=np.zeros((n_sims, decisions, L.RL_NUM_COLUMNS)),
                rt_costs=np.zeros((n_sims, decisions, int(w_len[routed].max()))))
           if routed else {}),
        **graphs,
    )
    max_lease = max([t.max_lease_blocks for t in templates.values()], default=1)
    max_bs = int(cfg_i[:, L.CFG_BLOCK_SIZE].max())
    # the optional kernel code this batch reaches, and only that, compiles
    reached = features_of(cfg_i, sm_i)
    cfg = cfg._replace(features=reached if features is None else union(reached, features))
    return cfg, pool, rq, workload, wk, sim_state, max_lease, max_bs


def _speculation_state(sims, w_off, cfg_i) -> dict:
    """Each speculating rank's acceptance stream (kernels.spec.sampler): rand's StdRng
    seeded ``aic_mtp_seed + worker * dp_size + dp_rank``, the worker numbered within its
    pool; none when no rank speculates."""
    if not (cfg_i[:, L.CFG_SPEC_NEXTN] > 0).any():
        return {}
    spec_rng = np.zeros((len(cfg_i), 24), np.uint32)
    for s, sim in enumerate(sims):
        for ws, rank in pool_extents(sim, int(w_off[s])):
            if rank.aic_nextn is None:
                continue
            for w in range(ws.start, ws.stop):
                dp_size = int(cfg_i[w, L.CFG_DP_SIZE])
                worker_rank = rank.for_worker((w - ws.start) // dp_size, dp_size)
                spec_rng[w, :8] = stream_key(worker_rank.aic_mtp_seed + int(cfg_i[w, L.CFG_DP_RANK]))
    return dict(spec_rng=spec_rng)


def _frontend_state(sims, w_off, w_len, wk_i) -> dict:
    """SGLang frontend stages (kernels.sglang.frontend) of every worker whose rank has
    them (aggregated only: they feed the host loop): a stage row per stage and worker,
    its job slots and concurrency_scale values; every pool idle at 0."""
    rows, scales = [], []
    slots = 0
    for s, sim in enumerate(sims):
        if sim.rank.frontend is None or sim.disaggregated:
            continue
        for w in range(int(w_off[s]), int(w_off[s]) + int(w_len[s])):
            wk_i[w, L.WK_FE_STAGES] = len(sim.rank.frontend)
            wk_i[w, L.WK_FE_STAGE_OFF] = len(rows)
            for workers, service_ms, scale in sim.rank.frontend:
                row = L.FRONTEND_STAGE.new(1)[0]
                row[L.FS_WORKERS] = workers
                row[L.FS_SLOT_OFF] = slots
                row[L.FS_SCALE_OFF] = len(scales)
                row[L.FS_SCALE_LEN] = len(scale)
                row[L.FS_SERVICE_BITS] = np.float64(service_ms).view(np.int64)
                rows.append(row)
                scales.extend(scale)
                slots += workers
    if not rows:
        return {}
    return dict(fe_stage=np.array(rows, np.int64), fe_slot_q=np.full(slots, -1, np.int64),
                fe_slot_rem=np.zeros(slots), fe_slot_due=np.zeros(slots, np.int64),
                fe_scale=np.array(scales, np.float64))
