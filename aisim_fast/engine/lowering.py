"""Rank configs lowered into the kernels' configuration rows, the block pools' extents,
op-level timing tables."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from aisim_fast.config.payload import RankConfig, accept_rates
from aisim_fast.kernels.spec.sampler import accept_thresholds
from aisim_fast.kernels.schema import layout as L

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage
from aisim_fast.aic import timing as aic
from aisim_fast.engine.simulation import Simulation


@contextlib.contextmanager
def small_pages():
    """Allocate arrays the kernels touch sparsely without transparent huge pages:
    numpy asks for them on every array of 4 MiB or more, and then the first touch
    anywhere in a 2 MiB page zeroes all of it. A run uses a part of each worker's
    block arena and a few hundred bins of each simulation's 301 KiB sketch row;
    with small pages only those are ever materialized."""
    previous = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(previous)


def reset_pools(pool: L.Pool) -> None:
    """Every worker's pool empty, as ``kernels.kv.block_pool.pool_reset`` leaves it: no
    arena slot used yet (slots are initialized when first taken), empty prefix table
    and LRU."""
    pool.w64[:, [L.PW_FREE_TOP, L.PW_BUMP, L.PW_NUM_COPIES, L.PW_NUM_RESERVED, L.PW_LRU_LEN]] = 0
    pool.w64[:, [L.PW_LRU_HEAD, L.PW_LRU_TAIL]] = L.NO_BLOCK
    pool.tab[:] = L.NO_BLOCK


def pool_extents(sim: Simulation, first_worker: int):
    """(workers, rank) of each pool of a simulation whose first worker is given."""
    out = [(slice(first_worker + sim.prefill_ranks, first_worker + sim.prefill_ranks + sim.ranks),
            sim.rank)]
    if sim.disaggregated:
        out.append((slice(first_worker, first_worker + sim.prefill_ranks), sim.prefill_rank))
    return out


def with_aic_tables(cfg: L.RankConfig, sims: Sequence[Simulation], w_off: np.ndarray) -> L.RankConfig:
    """Give the AIC-timed workers of a batch their tables (kernels.timing.aic_table): one
    shared table per timing config, filled with every key known so far, and one
    per simulation and config for the keys met in the run."""
    uses = [tuple(dict.fromkeys(rank.aic for _, rank in pool_extents(sim, 0) if rank.aic is not None))
            for sim in sims]
    if not any(uses):
        return cfg
    keys, vals, meta, slots = aic.batch_tables(uses)
    for s, sim in enumerate(sims):
        for ws, rank in pool_extents(sim, int(w_off[s])):
            if rank.aic is not None:
                cfg.i64[ws, L.CFG_AIC_SHARED], cfg.i64[ws, L.CFG_AIC_LOCAL] = slots[(s, rank.aic)]
    return cfg._replace(aic_key=keys, aic_ms=vals, aic_meta=meta)


def rank_config_rows(cfg_i: np.ndarray, cfg_f: np.ndarray, ws: slice, rank: RankConfig,
                 handoff_latency_ms: float, dp_size: int = 1) -> None:
    """Write one pool's rank configuration into the rows ``ws`` of the config matrices
    (``dp_size``: attention-DP ranks per worker; their rank numbers are set apart)."""
    cfg_i[ws, L.CFG_NUM_GPU_BLOCKS] = rank.num_gpu_blocks
    cfg_i[ws, L.CFG_BLOCK_SIZE] = rank.block_size
    cfg_i[ws, L.CFG_MAX_NUM_SEQS] = rank.max_num_seqs
    cfg_i[ws, L.CFG_MAX_NUM_BATCHED_TOKENS] = rank.max_num_batched_tokens
    cfg_i[ws, L.CFG_MAX_MODEL_LEN] = -1 if rank.max_model_len is None else rank.max_model_len
    cfg_i[ws, L.CFG_PREFIX_CACHING] = rank.enable_prefix_caching
    cfg_i[ws, L.CFG_CHUNKED_PREFILL] = rank.enable_chunked_prefill
    cfg_i[ws, L.CFG_PREEMPTION_FIFO] = rank.preemption_mode == "fifo"
    cfg_i[ws, L.CFG_POLICY] = {"trtllm": L.POLICY_TRTLLM, "sglang": L.POLICY_SGLANG}.get(
        rank.backend, L.POLICY_VLLM)
    cfg_i[ws, L.CFG_ROLE] = {"aggregated": L.ROLE_AGGREGATED, "prefill": L.ROLE_PREFILL,
                             "decode": L.ROLE_DECODE}[rank.worker_type]
    cfg_i[ws, L.CFG_TIMING] = {"fixed": L.TIMING_FIXED, "aic": L.TIMING_AIC}.get(
        rank.timing_model, L.TIMING_POLYNOMIAL)
    cfg_i[ws, L.CFG_AIC_SHARED] = -1  # build_state gives AIC workers their tables
    cfg_i[ws, L.CFG_AIC_LOCAL] = -1
    cfg_i[ws, L.CFG_TRANSFER_MODE] = (L.TRANSFER_DESTINATION_MISSING
                                      if rank.kv_transfer_timing_mode == "destination_missing"
                                      else L.TRANSFER_FULL_PROMPT)
    cfg_f[ws, L.CFGF_FIXED_PREFILL_MS] = rank.fixed_prefill_ms
    cfg_f[ws, L.CFGF_FIXED_DECODE_MS] = rank.fixed_decode_ms
    cfg_f[ws, L.CFGF_SPEEDUP_RATIO] = rank.speedup_ratio
    cfg_f[ws, L.CFGF_DECODE_SPEEDUP_RATIO] = rank.decode_speedup_ratio
    cfg_f[ws, L.CFGF_KV_BANDWIDTH_GBS] = (np.nan if rank.kv_transfer_bandwidth is None
                                          else rank.kv_transfer_bandwidth)
    cfg_f[ws, L.CFGF_KV_BYTES_PER_TOKEN] = (np.nan if rank.kv_transfer_bytes_per_token is None
                                            else rank.kv_transfer_bytes_per_token)
    cfg_f[ws, L.CFGF_HANDOFF_LATENCY_MS] = handoff_latency_ms
    cfg_i[ws, L.CFG_DP_SIZE] = dp_size
    # the cadence acts with attention DP only (engine.md 5.7); 1 = every pass
    cfg_i[ws, L.CFG_PREFILL_CADENCE] = rank.prefill_schedule_interval if dp_size > 1 else 1
    if rank.aic_nextn is not None:
        cfg_i[ws, L.CFG_SPEC_NEXTN] = rank.aic_nextn
        thresholds = accept_thresholds(accept_rates(rank.aic_nextn, rank.aic_nextn_accept_rates))
        for i, threshold in enumerate(thresholds):
            cfg_i[ws, L.CFG_SPEC_ACCEPT_0 + i] = threshold
    if rank.backend == "sglang":
        cfg_i[ws, L.CFG_SG_MAX_PREFILL_TOKENS] = rank.sglang_max_prefill_tokens
        # attention DP splits the chunk budget over the ranks (engine.md 7.9)
        cfg_i[ws, L.CFG_SG_CHUNK_SIZE] = rank.sglang_chunked_prefill_size // dp_size
        cfg_i[ws, L.CFG_SG_CLIP] = rank.sglang_clip_max_new_tokens
        cfg_i[ws, L.CFG_SG_LPM] = rank.sglang_schedule_policy == "lpm"
        cfg_i[ws, L.CFG_SG_PD_INTERVAL] = rank.prefill_decode_interval
        cfg_i[ws, L.CFG_SG_HOST_LOOP] = rank.sglang_host_loop
        # the reference's f64 sequence: init, its floor, the decay step in this order
        # and makes admission more conservative (x0.3, engine.md 7.9)
        conservativeness = rank.sglang_schedule_conservativeness * (0.3 if dp_size > 1 else 1.0)
        init = 0.7 * conservativeness
        floor = init * 0.14
        cfg_f[ws, L.CFGF_SG_INIT_RATIO] = init
        cfg_f[ws, L.CFGF_SG_MIN_RATIO] = floor
        cfg_f[ws, L.CFGF_SG_DECAY_STEP] = (init - floor) / 600.0
