"""State layout shared by every kernel: dtypes, sentinels, status codes and the
NamedTuple bundles that carry the batch state into ``@njit`` code.

Scalar state is owner-major: one int64 (or float64) matrix per owner kind, one
row per owner, one column per field (``rq.i64[q, RQ_GENERATED]``). A pass touches
a dozen fields of each running request, which then share one or two cache lines;
and a kernel receives ~25 arrays instead of ~100, so Numba compiles the call graph
several times faster and each call reference-counts far fewer array handles.
Columns are copied out once per run for Arrow export.

Axes (owner axis first):

* ``s`` - simulation in the batch;
* ``w`` - worker (one logical engine; with ``dp_size == 1`` a worker is one rank);
* ``q`` - request (one trace row / turn) of one simulation, global over the batch;
* ``b`` - physical KV block slot of a rank's arena, global over the batch;
* ``k`` - entry of a per-request CSR row (block lease, block hashes);
* ``t`` - slot of a rank's open-addressing prefix table, global over the batch.

Per-rank and per-simulation slices of the global arrays are located with
``*_off`` offsets, so one kernel call can run any mix of simulations and each
simulation touches only its own rows (``prange`` over simulations is safe).
"""

from typing import NamedTuple

import numpy as np

NO_BLOCK = np.int32(-1)          # empty lease entry / empty table slot / list end

# Request status (``rq.i64[q, RQ_STATUS]``): where a request is in its life.
RS_NOT_ARRIVED = 0
RS_WAITING = 1        # queued, never admitted
RS_RUNNING = 2
RS_PREEMPTED = 3      # queued again after preemption (recompute)
RS_DONE = 4
RS_HELD = 5           # prefill (source) side finished, KV held until ReleaseSource
RS_PENDING_DEST = 6   # decode side accepted, in the rank's pending-destination FIFO
RS_RESERVED = 7       # decode side reserved, waiting for the transfer
RS_ACTIVATED = 8      # decode side activated: queued with its prompt KV resident

# Terminal status (``rq.i64[q, RQ_TERMINAL]``), names follow the reference's records.
TERM_NONE = 0
TERM_COMPLETED = 1
TERM_REJECTED = 2
TERM_FAILED = 3       # disaggregated: the destination can never hold the prompt
TERM_CANCELED = 4
TERMINAL_STATUS_NAMES = ("", "completed", "rejected", "failed", "canceled")

# Results of an engine command (CancelSource / CancelDestination).
CMD_NOOP = 0
CMD_APPLIED = 1

# Scheduling policy of a rank (``cfg.i64[w, CFG_POLICY]``).
POLICY_VLLM = 0
POLICY_TRTLLM = 1     # vLLM core with GUARANTEED_NO_EVICT capacity policy

# Worker role (``cfg.i64[w, CFG_ROLE]``).
ROLE_AGGREGATED = 0
ROLE_PREFILL = 1
ROLE_DECODE = 2

# Placement policy of a simulation (``sims.i64[s, SM_PLACEMENT]``, kernels.placement).
PLACE_ROUND_ROBIN = 0  # the reference's: arrival i goes to worker i mod N
PLACE_RANDOM = 1       # uniform over the pool, from a seeded generator
PLACEMENT_NAMES = ("round_robin", "random")

# Timing model (``cfg.i64[w, CFG_TIMING]``).
TIMING_POLYNOMIAL = 0
TIMING_FIXED = 1

# Simulation status (``sims.i64[s, SM_STATUS]``) returned by the replay kernel.
SIM_RUNNING = 0
SIM_DONE = 1
SIM_NEED_FLUSH = 2     # pass log full: the driver drains it and calls again
SIM_DEAD_END = 3       # requests in flight but nothing can ever happen again
SIM_ARENA_FULL = 4     # block arena smaller than the resident set: rerun with a larger arena
SIM_PAUSED = 5         # every instant up to the call's horizon drained: call again to go on
SIM_CAPACITY = 6       # a worker's running list or waiting ring had no room: rerun larger
SIM_STATUS_NAMES = ("running", "done", "need_flush", "dead_end", "arena_full", "paused",
                    "capacity")

# Handoff actions queued by the disaggregated replay (``rq.i64[q, RQ_ACTION]`` of the
# logical request; SourceFirst order: one action in flight per handoff).
ACT_NONE = 0
ACT_SUBMIT_PREFILL = 1
ACT_RESERVE = 2
ACT_START_TRANSFER = 3
ACT_ACTIVATE = 4
ACT_RELEASE = 5

# Handoff lifecycle journal (``hlog[s, row, HL_*]``, opt-in): one row per event of
# the normalized lifecycle, in the order the simulation produced them.
HE_SOURCE_HELD = 0
HE_DESTINATION_ACCEPTED = 1
HE_DESTINATION_RESERVED = 2
HE_DESTINATION_ACTIVATED = 3
HE_SOURCE_RELEASED = 4
HE_COMPLETED = 5       # the request is terminal and its source released
HANDOFF_EVENT_NAMES = ("SourceHeld", "DestinationAccepted", "DestinationReserved",
                       "DestinationActivated", "SourceReleased", "Completed")
# HL_VALUE_A: DestinationReserved -> transferable prompt tokens; DestinationActivated ->
# prompt blocks that became visible on the decode rank at activation.
# HL_VALUE_B: DestinationActivated -> prompt blocks already visible there before it
# that the reservation did not reuse.
(HL_EVENT, HL_REQUEST, HL_TIME_MS, HL_VALUE_A, HL_VALUE_B) = range(5)
HL_NUM_COLUMNS = 5

# KV transfer timing mode (``cfg.i64[w, CFG_TRANSFER_MODE]`` of a prefill worker).
TRANSFER_FULL_PROMPT = 0
TRANSFER_DESTINATION_MISSING = 1

# Columns of the per-pass log (``pass_log[s, row, col]``), one row per forward pass.
PL_WORKER = 0
PL_START_MS = 1
PL_END_MS = 2
PL_NUM_PREFILL_REQUESTS = 3
PL_SUM_PREFILL_TOKENS = 4
PL_SUM_PREFILL_KV_TOKENS = 5
PL_NUM_DECODE_REQUESTS = 6
PL_SUM_DECODE_KV_TOKENS = 7
PL_NUM_ADMITTED = 8
PL_NUM_PREEMPTED = 9
PL_NUM_OUTPUT_TOKENS = 10
PL_NUM_RUNNING = 11
PL_NUM_WAITING = 12
PL_ACTIVE_BLOCKS = 13
PL_INACTIVE_BLOCKS = 14
PASS_LOG_COLUMNS = (
    "worker", "start_ms", "end_ms", "num_prefill_requests", "sum_prefill_tokens",
    "sum_prefill_kv_tokens", "num_decode_requests", "sum_decode_kv_tokens",
    "num_admitted", "num_preempted", "num_output_tokens", "num_running", "num_waiting",
    "active_blocks", "inactive_blocks",
)
PL_NUM_COLUMNS = len(PASS_LOG_COLUMNS)


# Rank configuration, per worker: cfg.i64[w, CFG_*] and cfg.f64[w, CFGF_*].
(CFG_NUM_GPU_BLOCKS, CFG_BLOCK_SIZE, CFG_MAX_NUM_SEQS, CFG_MAX_NUM_BATCHED_TOKENS,
 CFG_MAX_MODEL_LEN, CFG_PREFIX_CACHING, CFG_CHUNKED_PREFILL, CFG_PREEMPTION_FIFO, CFG_POLICY,
 CFG_ROLE, CFG_TIMING, CFG_TRANSFER_MODE) = range(12)
CFG_I_FIELDS = 12
# CFGF_KV_BANDWIDTH_GBS / CFGF_KV_BYTES_PER_TOKEN are NaN when not configured (the
# transfer then takes CFGF_HANDOFF_LATENCY_MS, the topology's fallback).
(CFGF_FIXED_PREFILL_MS, CFGF_FIXED_DECODE_MS, CFGF_SPEEDUP_RATIO,
 CFGF_DECODE_SPEEDUP_RATIO, CFGF_KV_BANDWIDTH_GBS, CFGF_KV_BYTES_PER_TOKEN,
 CFGF_HANDOFF_LATENCY_MS) = range(7)
CFG_F_FIELDS = 7

# Block pool, per worker: pool.w64[w, PW_*]; per arena slot: pool.b32[b, PB_*].
(PW_BLK_OFF, PW_BLK_LEN, PW_TAB_OFF, PW_TAB_MASK, PW_FREE_TOP, PW_NUM_COPIES, PW_NUM_RESERVED,
 PW_LRU_HEAD, PW_LRU_TAIL, PW_LRU_LEN, PW_BUMP) = range(11)
PW_FIELDS = 11
# PW_BUMP: arena slots handed out so far; slots past it were never used and hold
# garbage until block_pool._take_slot initializes them. PW_FREE_TOP: slots given
# back, a stack in the PB_FREE_STACK column of the arena's first rows.
# PB_DUP / PB_DUP_PREV link the copies of one hash oldest first; PB_DUP_TAIL is
# the newest copy, kept on the primary so appending a duplicate is O(1).
(PB_FREE_STACK, PB_REF, PB_PIN, PB_CACHED, PB_PREV, PB_NEXT, PB_DUP, PB_DUP_PREV,
 PB_DUP_TAIL) = range(9)
PB_FIELDS = 9

# Requests: rq.i64[q, RQ_*] and rq.f64[q, RQF_*].
(RQ_PROMPT_LEN, RQ_MAX_OUTPUT, RQ_SRC_ROW, RQ_SESSION, RQ_TURN, RQ_NEXT_TURN, RQ_LEASE_OFF,
 RQ_UUID, RQ_STATUS, RQ_WORKER, RQ_GENERATED, RQ_NUM_COMPUTED, RQ_ALLOCATED, RQ_NUM_HASHED,
 RQ_PREEMPTIONS, RQ_ADMISSIONS, RQ_FIRST_CACHED, RQ_MAX_CACHED, RQ_SCHED_STAMP, RQ_SCHED_TOKENS,
 RQ_SCHED_PROMPT, RQ_SCHED_PREFIX, RQ_SCHED_TERMINAL, RQ_TERM_NEXT, RQ_TERMINAL,
 RQ_COMMITTED_PREFILL, RQ_SCHED_LEN, RQ_PEER, RQ_ACTION, RQ_LINK, RQ_ORDINAL, RQ_ATTEMPT_GEN,
 RQ_RESERVED_HITS, RQ_RESERVED_FRESH, RQ_XFER_SEQ, RQ_REPUBLISHED, RQ_FAST_LIMIT,
 RQ_REPORTED, RQ_SCHED_CLASS) = range(39)
RQ_I_FIELDS = 39
# RQ_FAST_LIMIT: the largest computed-token count the pass's fast path may reach
# without completing a block or growing the lease (0 = unknown: take the full
# schedule_request path, which sets it again).
# Disaggregated replay: a logical request (trace row) is served by two rows, the
# logical row itself on the decode side and a prefill row (``max_output`` 1) on the
# prefill side, linked both ways by RQ_PEER (-1 when aggregated). The logical row
# carries the handoff state: RQ_ACTION (queued/deferred action, ACT_*), RQ_LINK (next
# entry of a deferred-action or pending-destination list), RQ_ORDINAL (decode-rank
# arrival ordinal), RQ_ATTEMPT_GEN (capacity generation of its last failed
# reservation attempt), RQ_RESERVED_HITS / RQ_RESERVED_FRESH (reserved blocks),
# RQ_XFER_SEQ (start order of its transfer: equal completion times pop in it),
# RQ_REPUBLISHED (prompt blocks the decode rank published again after activation,
# i.e. recomputed after a decode-side preemption had let them be evicted),
# RQ_REPORTED (1 once its terminal was seen at its pass end: the state changes
# at pass start, the outside world learns of it at the end).
(RQF_DELAY_MS, RQF_START_MS, RQF_READY_MS, RQF_ARRIVAL_MS, RQF_FIRST_ADMIT_MS, RQF_FIRST_TOKEN_MS,
 RQF_SECOND_TOKEN_MS, RQF_LAST_TOKEN_MS, RQF_TERMINAL_MS, RQF_SOURCE_HELD_MS,
 RQF_DEST_RESERVED_MS, RQF_DEST_ACTIVATED_MS, RQF_SOURCE_RELEASED_MS, RQF_TRANSFER_DONE_MS) = range(14)
RQ_F_FIELDS = 14

# Workers (event loop side): wk.i64[w, WK_*].
(WK_SIM, WK_RUN_OFF, WK_RUN_LEN, WK_WAIT_OFF, WK_WAIT_CAP, WK_WAIT_HEAD, WK_WAIT_LEN, WK_BUSY,
 WK_TERM_HEAD, WK_STALLED, WK_PASS_STAMP, WK_PREEMPTIONS_TOTAL, WK_TERM_TAIL, WK_PEND_HEAD,
 WK_PEND_TAIL, WK_PEND_LEN, WK_CAP_GEN, WK_DEFER_HEAD, WK_DEFER_TAIL, WK_ORDINAL_NEXT,
 WK_TRT_TAIL, WK_OVERFLOW, WK_RUN_CAP) = range(23)
WK_FIELDS = 23
# WK_TERM_HEAD/TAIL: terminals (and held sources) of the pass in flight, in output
# order. WK_PEND_*: pending-destination FIFO (linked by RQ_LINK). WK_CAP_GEN: the
# capacity generation (bumped whenever capacity or slots may have been freed).
# WK_DEFER_*: handoff actions deferred until this worker's pass in flight ends.
# WK_TRT_TAIL (TRT-LLM decode rank): blocks that reserved-not-activated and
# activated-waiting destinations still need to finish, held back from admissions.
# WK_OVERFLOW: 1 once a push found the running list or waiting ring full (nothing
# was written; the event loop ends the simulation with SIM_CAPACITY).

# Simulations: sims.i64[s, SM_*].
(SM_Q_OFF, SM_Q_LEN, SM_W_OFF, SM_W_LEN, SM_CONCURRENCY, SM_STATUS, SM_NUM_STARTS,
 SM_START_PTR, SM_HEAP_LEN, SM_ACTIVE_SESSIONS, SM_RR_CURSOR, SM_NUM_ARRIVED,
 SM_NUM_TERMINAL, SM_UUID_NEXT, SM_PASS_LOG_LEN, SM_RESUME_WORKER, SM_PREFILL_LEN,
 SM_DECODE_CURSOR, SM_ACTQ_HEAD, SM_ACTQ_LEN, SM_XFER_LEN, SM_OPEN_HANDOFFS, SM_XFER_SEQ,
 SM_HLOG_LEN, SM_DECODE_RUN_PASSES, SM_PLACEMENT, SM_RNG_STATE) = range(27)
SM_FIELDS = 27
# Disaggregated simulations: workers [W_OFF, W_OFF + PREFILL_LEN) are the prefill
# pool, the rest the decode pool (0 prefill workers = aggregated). SM_ACTQ_*: the
# FIFO handoff action queue (a ring in ``actq`` at Q_OFF); SM_XFER_LEN: transfers in
# flight (a heap in ``xfer_heap`` at Q_OFF); SM_OPEN_HANDOFFS: sources not released.
# SM_DECODE_RUN_PASSES: passes run inside decode runs (kernels.decode_run), of all
# passes (the workers' WK_PASS_STAMP).
# SM_PLACEMENT: placement policy (PLACE_*); SM_RR_CURSOR / SM_DECODE_CURSOR are the
# round-robin cursors of the (prefill) pool and the decode pool; SM_RNG_STATE: the
# splitmix64 state of seeded random placement (kernels.placement).
# SM_RESUME_WORKER: a kernel call that returned to flush the pass log in the middle
# of an instant's drive resumes the drive at this worker (-1: start a new drain).


class RankConfig(NamedTuple):
    """Scheduler configuration per worker (reference field names, see CFG_*)."""
    i64: np.ndarray   # int64[w, CFG_I_FIELDS]; max_model_len -1 = no limit
    f64: np.ndarray   # float64[w, CFG_F_FIELDS]


class Pool(NamedTuple):
    """Paged G1 block pools of every worker (global arrays sliced by PW_BLK_OFF /
    PW_TAB_OFF): counters per worker, links and counts per arena slot."""
    w64: np.ndarray       # int64[w, PW_FIELDS]
    b32: np.ndarray       # int32[b, PB_FIELDS] (free stack, refs, pins, cached flag, LRU, duplicates)
    blk_hash: np.ndarray  # uint64[b] sequence hash of a cached copy
    tab: np.ndarray       # int32[t] primary copy of a hash, NO_BLOCK = empty slot


class Requests(NamedTuple):
    """Per-request state of every simulation (one row per request), plus the CSR
    block rows."""
    i64: np.ndarray       # int64[q, RQ_I_FIELDS]
    f64: np.ndarray       # float64[q, RQ_F_FIELDS]
    lease: np.ndarray     # int32[k] physical block of each block entry
    seq_hash: np.ndarray  # uint64[k] sequence hash of each block entry


class Workload(NamedTuple):
    """Trace rows shared by all simulations: prompt tokens as CSR of interned
    hash ids, and prompt block hashes for the engine block size of the row."""
    hash_indptr: np.ndarray       # int64[row+1]
    hash_ids: np.ndarray          # uint32[nnz] interned trace hash ids
    trace_block_size: np.ndarray  # int64[row]
    phash_indptr: np.ndarray      # int64[row+1]
    phash: np.ndarray             # uint64[nnz]


class Workers(NamedTuple):
    """Event-loop state of every worker."""
    i64: np.ndarray          # int64[w, WK_FIELDS]
    pass_end_ms: np.ndarray  # float64[w]
    run_q: np.ndarray        # int64[..] running lists (slices at WK_RUN_OFF)
    wait_q: np.ndarray       # int64[..] waiting rings (slices at WK_WAIT_OFF)


class Sims(NamedTuple):
    """Event-loop state of every simulation and its admission source."""
    i64: np.ndarray          # int64[s, SM_FIELDS]
    now_ms: np.ndarray       # float64[s]
    start_order: np.ndarray  # int64[q] first turns in release order (slices at SM_Q_OFF)
    heap_q: np.ndarray       # int64[q] follow-up turns by release time (slices at SM_Q_OFF)
    actq: np.ndarray         # int64[q] disaggregated handoff action ring (slices at SM_Q_OFF)
    xfer_heap: np.ndarray    # int64[q] transfers in flight by completion time (slices at SM_Q_OFF)
    token_stat: np.ndarray   # float64[s, TOKEN_STAT_WIDTH] token-gap accumulators (kernels.sketch)
    token_hist: np.ndarray   # int64[s, TOKEN_HIST_WIDTH]
    pass_log: np.ndarray     # float64[s, rows, PL_NUM_COLUMNS]
    hlog: np.ndarray         # float64[s, rows, HL_NUM_COLUMNS] handoff journal (0 rows = off)
