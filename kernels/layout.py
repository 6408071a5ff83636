"""State layout shared by every kernel: dtypes, sentinels, status codes and the
NamedTuple bundles that carry the batch state into ``@njit`` code.

Axes (first index of every array):

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
NO_TIME = np.nan                 # a time that has not happened

# Request status (``req_status[q]``): where a request is in its life.
RS_NOT_ARRIVED = 0
RS_WAITING = 1        # queued, never admitted
RS_RUNNING = 2
RS_PREEMPTED = 3      # queued again after preemption (recompute)
RS_DONE = 4

# Terminal status (``req_terminal[q]``), names follow the reference's records.
TERM_NONE = 0
TERM_COMPLETED = 1
TERM_REJECTED = 2
TERMINAL_STATUS_NAMES = ("", "completed", "rejected")

# Scheduling policy of a rank (``rank_policy[w]``).
POLICY_VLLM = 0
POLICY_TRTLLM = 1     # vLLM core with GUARANTEED_NO_EVICT capacity policy

# Worker role (``rank_role[w]``).
ROLE_AGGREGATED = 0
ROLE_PREFILL = 1
ROLE_DECODE = 2

# Timing model (``rank_timing[w]``).
TIMING_POLYNOMIAL = 0
TIMING_FIXED = 1

# Simulation status (``sim_status[s]``) returned by the replay kernel.
SIM_RUNNING = 0
SIM_DONE = 1
SIM_NEED_FLUSH = 2     # pass log full: the driver drains it and calls again
SIM_DEAD_END = 3       # requests in flight but nothing can ever happen again
SIM_ARENA_FULL = 4     # block arena smaller than the resident set: rerun with a larger arena
SIM_STATUS_NAMES = ("running", "done", "need_flush", "dead_end", "arena_full")

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


class RankConfig(NamedTuple):
    """Scheduler configuration per worker ``[w]`` (reference field names)."""
    num_gpu_blocks: np.ndarray          # int64[w]
    block_size: np.ndarray              # int64[w]
    max_num_seqs: np.ndarray            # int64[w]
    max_num_batched_tokens: np.ndarray  # int64[w]
    max_model_len: np.ndarray           # int64[w], -1 = no limit
    enable_prefix_caching: np.ndarray   # bool[w]
    enable_chunked_prefill: np.ndarray  # bool[w]
    preemption_fifo: np.ndarray         # bool[w] (False = lifo)
    policy: np.ndarray                  # int8[w] POLICY_*
    role: np.ndarray                    # int8[w] ROLE_*
    timing: np.ndarray                  # int8[w] TIMING_*
    fixed_prefill_ms: np.ndarray        # float64[w]
    fixed_decode_ms: np.ndarray         # float64[w]
    speedup_ratio: np.ndarray           # float64[w]
    decode_speedup_ratio: np.ndarray    # float64[w]


class Pool(NamedTuple):
    """Paged G1 block pools of every worker: per-worker ``[w]`` counters and
    per-block ``[b]`` / per-table-slot ``[t]`` arrays (global, sliced by offsets)."""
    blk_off: np.ndarray        # int64[w] first arena slot of worker w
    blk_len: np.ndarray        # int64[w] arena slots of worker w
    tab_off: np.ndarray        # int64[w] first prefix-table slot of worker w
    tab_mask: np.ndarray       # int64[w] table size - 1 (power of two)
    free_top: np.ndarray       # int64[w] number of free arena slots on the stack
    num_copies: np.ndarray     # int64[w] resident physical copies (private + cached)
    num_reserved: np.ndarray   # int64[w] capacity reserved but not committed
    lru_head: np.ndarray       # int32[w] oldest unreferenced cached copy
    lru_tail: np.ndarray       # int32[w]
    lru_len: np.ndarray        # int64[w]
    free_stack: np.ndarray     # int32[b] free arena slots (per-worker stacks)
    blk_hash: np.ndarray       # uint64[b] sequence hash of a cached copy
    blk_ref: np.ndarray        # int32[b] lease references
    blk_pin: np.ndarray        # int32[b] reservation pins
    blk_cached: np.ndarray     # bool[b] cache-visible (else private to one request)
    blk_prev: np.ndarray       # int32[b] LRU links
    blk_next: np.ndarray       # int32[b]
    blk_dup: np.ndarray        # int32[b] next copy of the same hash (FIFO of duplicates)
    tab: np.ndarray            # int32[t] primary copy of a hash, NO_BLOCK = empty


class Requests(NamedTuple):
    """Per-request state ``[q]`` and CSR rows ``[k]`` of every simulation."""
    # static inputs
    prompt_len: np.ndarray       # int64[q]
    max_output: np.ndarray       # int64[q] (TRT-LLM clamp applied by the driver)
    src_row: np.ndarray          # int64[q] row of the workload tables (tokens, prompt hashes)
    uuid_lo: np.ndarray          # uint64[q] canonical request uuid (ordinal), for synthetic tokens
    session: np.ndarray          # int64[q] session index (file order of first appearance)
    turn: np.ndarray             # int64[q] turn index inside the session
    next_turn: np.ndarray        # int64[q] next turn of the same session, -1 = last
    delay_ms: np.ndarray         # float64[q] think time before this turn (turn > 0)
    lease_off: np.ndarray        # int64[q] first CSR entry of the request's block rows
    # dynamic state
    status: np.ndarray           # int8[q] RS_*
    worker: np.ndarray           # int64[q] placement (global worker index), -1 = none yet
    generated: np.ndarray        # int64[q] output tokens appended so far
    num_computed: np.ndarray     # int64[q]
    allocated: np.ndarray        # int64[q] tokens covered by the lease (watermark)
    num_hashed: np.ndarray       # int64[q] leading blocks whose sequence hash is known
    preemptions: np.ndarray      # int64[q]
    admissions: np.ndarray       # int64[q]
    first_cached: np.ndarray     # int64[q] reused tokens at first admission, -1 = unset
    max_cached: np.ndarray       # int64[q] max reused tokens over admissions
    sched_stamp: np.ndarray      # int64[q] pass stamp of the last scheduling in a pass
    sched_tokens: np.ndarray     # int64[q] tokens scheduled in that pass
    sched_prompt: np.ndarray     # int64[q] prompt tokens scheduled in that pass
    sched_prefix: np.ndarray     # int64[q] prompt tokens computed or cached before it
    sched_terminal: np.ndarray   # bool[q] generation complete right after scheduling
    term_next: np.ndarray        # int64[q] intrusive list of terminals of an in-flight pass
    # records
    arrival_ms: np.ndarray       # float64[q]
    first_admit_ms: np.ndarray   # float64[q]
    first_token_ms: np.ndarray   # float64[q]
    second_token_ms: np.ndarray  # float64[q]
    last_token_ms: np.ndarray    # float64[q]
    terminal_ms: np.ndarray      # float64[q]
    terminal: np.ndarray         # int8[q] TERM_*
    committed_prefill: np.ndarray  # int64[q] prompt work committed at admissions
    # CSR rows
    lease: np.ndarray            # int32[k] physical block of each block entry
    seq_hash: np.ndarray         # uint64[k] sequence hash of each block entry


class Workload(NamedTuple):
    """Trace rows shared by all simulations: prompt tokens as CSR of interned
    hash ids, and prompt block hashes per distinct engine block size."""
    hash_indptr: np.ndarray      # int64[row+1]
    hash_ids: np.ndarray         # uint32[nnz] interned trace hash ids
    trace_block_size: np.ndarray  # int64[row]
    phash_indptr: np.ndarray     # int64[row+1] prompt block hashes (engine block size of the row's sims)
    phash: np.ndarray            # uint64[nnz]


class Workers(NamedTuple):
    """Event-loop state of every worker ``[w]``."""
    sim: np.ndarray              # int64[w] owning simulation
    run_off: np.ndarray          # int64[w] running-list slice
    run_len: np.ndarray          # int64[w]
    wait_off: np.ndarray         # int64[w] waiting ring slice
    wait_cap: np.ndarray         # int64[w]
    wait_head: np.ndarray        # int64[w]
    wait_len: np.ndarray         # int64[w]
    busy: np.ndarray             # bool[w] pass in flight
    pass_end_ms: np.ndarray      # float64[w]
    term_head: np.ndarray        # int64[w] first terminal of the in-flight pass
    stalled: np.ndarray          # bool[w] last pass had no effect; retry only after new work
    pass_stamp: np.ndarray       # int64[w] passes started so far
    preemptions_total: np.ndarray  # int64[w]
    run_q: np.ndarray            # int64[..] running lists
    wait_q: np.ndarray           # int64[..] waiting rings


class Sims(NamedTuple):
    """Event-loop state of every simulation ``[s]`` and its admission source."""
    q_off: np.ndarray            # int64[s] first request
    q_len: np.ndarray            # int64[s]
    w_off: np.ndarray            # int64[s] first worker
    w_len: np.ndarray            # int64[s]
    concurrency: np.ndarray      # int64[s] closed-loop session cap, 0 = open loop
    now_ms: np.ndarray           # float64[s]
    status: np.ndarray           # int8[s] SIM_*
    start_order: np.ndarray      # int64[..] first turns in admission order (per-sim slices at q_off)
    start_ms: np.ndarray         # float64[q] session start of a first turn (open loop)
    num_starts: np.ndarray       # int64[s] first turns of simulation s
    start_ptr: np.ndarray        # int64[s] next first turn to release
    heap_q: np.ndarray           # int64[..] follow-up turns waiting for their time (slices at q_off)
    heap_len: np.ndarray         # int64[s]
    ready_ms: np.ndarray         # float64[q] release time of a follow-up turn
    active_sessions: np.ndarray  # int64[s]
    rr_cursor: np.ndarray        # int64[s] round-robin placement cursor
    num_arrived: np.ndarray      # int64[s]
    num_terminal: np.ndarray     # int64[s]
    uuid_next: np.ndarray        # int64[s] canonical uuid ordinal of the next arrival
    token_stat: np.ndarray       # float64[s, TS_*] token-gap accumulators (kernels.sketch)
    token_hist: np.ndarray       # int64[s, bins] token-gap sketches
    pass_log: np.ndarray         # float64[s, rows, PL_NUM_COLUMNS]
    pass_log_len: np.ndarray     # int64[s]
