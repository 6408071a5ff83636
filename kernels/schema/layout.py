"""State layout shared by every kernel: dtypes, sentinels, status codes and the
NamedTuple bundles that carry the batch state into ``@njit`` code.

Scalar state is owner-major: one int64 (or float64) matrix per owner kind, one
row per owner, one column per field (``rq.i64[q, RQ_GENERATED]``). Every column is
declared once, in a ``FieldTable`` below (name, initial value, the index space it
points into, doc); the ``RQ_*``-style constants, widths and fresh rows come from it. A pass touches
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

# ---------------------------------------------------------------------------------
# Field tables: every column of every state matrix, declared once
# ---------------------------------------------------------------------------------
class Field(NamedTuple):
    """One column of a state matrix."""
    name: str      # full constant name, e.g. "RQ_PROMPT_LEN"
    index: int     # column
    init: float    # value of a fresh row (before the driver writes it)
    ref: str       # the index space the value points into ("q" request, "w" worker,
                   # "k" lease entry, "" a plain value); -1 = none
    doc: str


class FieldTable:
    """The columns of one state matrix or log (``matrix`` ``owner`` x field): the names
    of the module constants ``<prefix><NAME>`` (their column numbers), the width, fresh
    rows (``new``) and a named view for export and debugging (``frame``)."""

    def __init__(self, prefix: str, matrix: str, dtype, rows):
        self.prefix, self.matrix, self.dtype = prefix, matrix, np.dtype(dtype)
        self.fields = tuple(Field(prefix + name, i, init, ref, doc)
                            for i, (name, init, ref, doc) in enumerate(rows))
        self.width = len(self.fields)

    def new(self, n: int) -> np.ndarray:
        """``n`` fresh rows: every column at its declared initial value."""
        out = np.empty((n, self.width), self.dtype)
        out[:] = np.array([f.init for f in self.fields], self.dtype)
        return out

    def frame(self, matrix: np.ndarray):
        """The matrix as a pandas DataFrame with one named column per field."""
        import pandas as pd
        return pd.DataFrame({f.name[len(self.prefix):].lower(): matrix[:, f.index]
                             for f in self.fields})

    def columns_pointing_to(self, ref: str) -> tuple[int, ...]:
        return tuple(f.index for f in self.fields if f.ref == ref)

    def indices(self) -> range:
        """The column numbers in declaration order, unpacked into the module's named
        constants right below each table (``RQ_A, RQ_B, ... = REQUEST_I.indices()``:
        what kernels read as compile-time constants and what an IDE sees);
        ``check_constants`` holds every name to its field at import."""
        return range(self.width)

    def export_names(self) -> tuple[str, ...]:
        """The columns' names in exported tables (the field names in lower case)."""
        return tuple(f.name[len(self.prefix):].lower() for f in self.fields)


def check_constants(table: FieldTable, namespace: dict) -> None:
    """Raise unless every field of ``table`` has its module constant in ``namespace``
    holding its column (the unpacked constants are in the tables' order)."""
    wrong = [f.name for f in table.fields if namespace.get(f.name) != f.index]
    if wrong:
        raise ImportError(f"layout constants out of step with the {table.matrix} table: {wrong}")





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
RS_TOKENIZING = 9     # arrived and placed, its prompt in its worker's tokenization pool
RS_FRONTEND = 10      # arrived and placed, in its SGLang worker's frontend stages

# Terminal status (``rq.i64[q, RQ_TERMINAL]``), names follow the reference's records.
TERM_NONE = 0
TERM_COMPLETED = 1
TERM_REJECTED = 2
TERM_FAILED = 3       # disaggregated: the destination can never hold the prompt
TERM_CANCELED = 4
TERM_NOT_SENT = 5     # a later turn of a session whose turn failed: never sent, no record
TERMINAL_STATUS_NAMES = ("", "completed", "rejected", "failed", "canceled", "not_sent")

# Results of an engine command (CancelSource / CancelDestination).
CMD_NOOP = 0
CMD_APPLIED = 1

# Scheduling policy of a rank (``cfg.i64[w, CFG_POLICY]``).
POLICY_VLLM = 0
POLICY_TRTLLM = 1     # vLLM core with GUARANTEED_NO_EVICT capacity policy
POLICY_SGLANG = 2     # SGLang scheduler over a radix cache (kernels.sglang.core)

# Worker role (``cfg.i64[w, CFG_ROLE]``).
ROLE_AGGREGATED = 0
ROLE_PREFILL = 1
ROLE_DECODE = 2

# Placement policy of a simulation (``sims.i64[s, SM_PLACEMENT]``, kernels.routing.placement).
PLACE_ROUND_ROBIN = 0  # the reference's: arrival i goes to worker i mod N
PLACE_RANDOM = 1       # uniform over the pool, from a seeded generator
PLACE_KV_ROUTER = 2    # Dynamo's KV router cost (kernels.routing.kv_router)
PLACEMENT_NAMES = ("round_robin", "random", "kv_router")

# Timing model (``cfg.i64[w, CFG_TIMING]``).
TIMING_POLYNOMIAL = 0
TIMING_FIXED = 1
TIMING_AIC = 2         # op-level tables (cfg.aic_*, kernels.timing.aic_table)

# Simulation status (``sims.i64[s, SM_STATUS]``) returned by the replay kernel.
SIM_RUNNING = 0
SIM_DONE = 1
SIM_NEED_FLUSH = 2     # pass log (or KV event log) full: the driver drains it and calls again
SIM_DEAD_END = 3       # requests in flight but nothing can ever happen again
SIM_ARENA_FULL = 4     # block arena smaller than the resident set: rerun with a larger arena
SIM_PAUSED = 5         # every instant up to the call's horizon drained: call again to go on
SIM_CAPACITY = 6       # a worker's running list or waiting ring had no room: rerun larger
SIM_EVENTS_FULL = 7     # the KV event log overflowed within one instant: rerun with a larger one
SIM_STATUS_NAMES = ("running", "done", "need_flush", "dead_end", "arena_full", "paused",
                    "capacity", "events_full")

# Handoff actions (``rq.i64[q, RQ_ACTION]`` of the logical request; SourceFirst
# order: one action in flight per handoff). The driver's coordinator
# (``aisim_fast.protocol.handoff.coordinator.ActionKind``) uses these same numbers.
ACT_NONE = -1
ACT_SUBMIT_PREFILL = 0
ACT_RESERVE = 1
ACT_START_TRANSFER = 2
ACT_ACTIVATE = 3
ACT_RELEASE = 4
ACT_CANCEL_SOURCE = 5
ACT_CANCEL_DESTINATION = 6
ACT_COMPLETE = 7       # the handoff is done (the coordinator's terminal action)
# SourceFirst: the action that follows each lifecycle fact. The kernels' handoff
# queues exactly these, and the driver's audit (aisim_fast.protocol.handoff.audit) holds the
# coordinator to them on every disaggregated run: one transition sequence.
NEXT_ON_ARRIVAL = ACT_SUBMIT_PREFILL
NEXT_ON_SOURCE_HELD = ACT_RESERVE
NEXT_ON_DESTINATION_RESERVED = ACT_START_TRANSFER
NEXT_ON_TRANSFER_COMPLETED = ACT_ACTIVATE
NEXT_ON_DESTINATION_ACTIVATED = ACT_RELEASE
NEXT_ON_SOURCE_RELEASED = ACT_COMPLETE
# DestinationFirst (SGLang): the decode slot is reserved before the prefill is
# submitted; the prefill starts once the reservation holds, and the transfer once
# the source is held. The rest is SourceFirst's (transfer -> activate -> release).
DF_NEXT_ON_ARRIVAL = ACT_RESERVE
DF_NEXT_ON_DESTINATION_RESERVED = ACT_SUBMIT_PREFILL
DF_NEXT_ON_SOURCE_HELD = ACT_START_TRANSFER

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
HANDOFF_LOG = FieldTable("HL_", "sims.hlog", np.float64, [
    ("EVENT", 0, "", "the lifecycle event, HE_*"),
    ("REQUEST", 0, "q", "the request (kernel row)"),
    ("TIME_MS", 0, "", "when it happened"),
    ("VALUE_A", 0, "", "see above"),
    ("VALUE_B", 0, "", "see above"),
])
(HL_EVENT, HL_REQUEST, HL_TIME_MS, HL_VALUE_A, HL_VALUE_B) = HANDOFF_LOG.indices()
HL_NUM_COLUMNS = HANDOFF_LOG.width

# KV transfer timing mode (``cfg.i64[w, CFG_TRANSFER_MODE]`` of a prefill worker).
TRANSFER_FULL_PROMPT = 0
TRANSFER_DESTINATION_MISSING = 1

# The per-pass log (``sims.pass_log[s, row, PL_*]``), one row per forward pass; the
# timing model's inputs are the prefill columns (isl sum = sum_prefill_kv_tokens +
# sum_prefill_prompt_tokens; none on decode workers) and the decode batch's own (a
# recomputed preempted request is in both).
PASS_LOG = FieldTable("PL_", "sims.pass_log", np.float64, [
    ("WORKER", 0, "w", "the worker (kernel worker: a rank under attention DP)"),
    ("START_MS", 0, "", "pass start"),
    ("END_MS", 0, "", "pass end"),
    ("NUM_PREFILL_REQUESTS", 0, "", "requests with prompt tokens in the pass"),
    ("SUM_PREFILL_TOKENS", 0, "", "prompt tokens computed"),
    ("SUM_PREFILL_KV_TOKENS", 0, "", "prompt tokens already in KV (prefix and earlier chunks)"),
    ("NUM_DECODE_REQUESTS", 0, "", "requests decoding one token"),
    ("SUM_DECODE_KV_TOKENS", 0, "", "their KV tokens"),
    ("NUM_ADMITTED", 0, "", "first admissions"),
    ("NUM_PREEMPTED", 0, "", "preemptions (vLLM) or retractions (SGLang)"),
    ("NUM_OUTPUT_TOKENS", 0, "", "tokens emitted at the pass end"),
    ("NUM_RUNNING", 0, "", "running requests after the pass's scheduling"),
    ("NUM_WAITING", 0, "", "waiting requests after it"),
    ("ACTIVE_BLOCKS", 0, "", "blocks referenced by requests"),
    ("INACTIVE_BLOCKS", 0, "", "cached blocks no request references"),
    ("SUM_PREFILL_PROMPT_TOKENS", 0, "", "the timing model's prefill prompt tokens"),
    ("TIMED_DECODE_REQUESTS", 0, "", "the timing model's decode batch"),
    ("TIMED_DECODE_KV_TOKENS", 0, "", "and its KV tokens"),
    ("RANK", 0, "", "the attention-DP rank of the worker that ran the pass (0 without)"),
])
(PL_WORKER, PL_START_MS, PL_END_MS, PL_NUM_PREFILL_REQUESTS, PL_SUM_PREFILL_TOKENS,
 PL_SUM_PREFILL_KV_TOKENS, PL_NUM_DECODE_REQUESTS, PL_SUM_DECODE_KV_TOKENS, PL_NUM_ADMITTED,
 PL_NUM_PREEMPTED, PL_NUM_OUTPUT_TOKENS, PL_NUM_RUNNING, PL_NUM_WAITING, PL_ACTIVE_BLOCKS,
 PL_INACTIVE_BLOCKS, PL_SUM_PREFILL_PROMPT_TOKENS, PL_TIMED_DECODE_REQUESTS,
 PL_TIMED_DECODE_KV_TOKENS, PL_RANK) = PASS_LOG.indices()
PASS_LOG_COLUMNS = PASS_LOG.export_names()
PL_NUM_COLUMNS = PASS_LOG.width

# The pass counters of one scheduler pass (``acc[ACC_*]``, an int64 scratch row per
# concurrent kernel call): the vLLM core's and SGLang's, in the same slots.
PASS_COUNTERS = FieldTable("ACC_", "acc", np.int64, [
    ("BUDGET", 0, "", "token budget left"),
    ("BATCH", 0, "", "requests in the prefill batch"),
    ("ISL", 0, "", "the prefill batch's input tokens (prefix + prompt)"),
    ("PREFIX", 0, "", "its prefix (already cached) tokens"),
    ("PREEMPTED_ANY", 0, "", "1 = the pass preempted"),
    ("ADMITTED", 0, "", "first admissions"),
    ("SCHEDULED_TOKENS", 0, "", "tokens scheduled"),
    ("REJECTED", 0, "", "requests rejected"),
    ("DECODE_BATCH", 0, "", "decode batch size (vllm.decode_step.classify)"),
    ("DECODE_KV", 0, "", "the decode batch's KV tokens"),
    ("COMPLETE", 0, "", "ready requests with nothing left to generate"),
])
(ACC_BUDGET, ACC_BATCH, ACC_ISL, ACC_PREFIX, ACC_PREEMPTED_ANY, ACC_ADMITTED, ACC_SCHEDULED_TOKENS,
 ACC_REJECTED, ACC_DECODE_BATCH, ACC_DECODE_KV, ACC_COMPLETE) = PASS_COUNTERS.indices()
ACC_SIZE = PASS_COUNTERS.width


# Rank configuration, per worker: cfg.i64[w, CFG_*] and cfg.f64[w, CFGF_*].
RANK_CONFIG_I = FieldTable("CFG_", "cfg.i64", np.int64, [
    ("NUM_GPU_BLOCKS", 0, "", "KV capacity in blocks"),
    ("BLOCK_SIZE", 0, "", "tokens per block"),
    ("MAX_NUM_SEQS", 0, "", "running requests at most"),
    ("MAX_NUM_BATCHED_TOKENS", 0, "", "token budget of a pass"),
    ("MAX_MODEL_LEN", -1, "", "prompt + output limit; -1 = none"),
    ("PREFIX_CACHING", 0, "", "1 = prefix caching on"),
    ("CHUNKED_PREFILL", 0, "", "1 = chunked prefill on"),
    ("PREEMPTION_FIFO", 0, "", "1 = preempt the oldest running request (else the newest)"),
    ("POLICY", 0, "", "scheduling policy, POLICY_*"),
    ("ROLE", 0, "", "worker role, ROLE_*"),
    ("TIMING", 0, "", "timing model, TIMING_*"),
    ("TRANSFER_MODE", 0, "", "KV transfer timing mode of a prefill worker, TRANSFER_*"),
    ("AIC_SHARED", -1, "", "AIC timing: table of every key known before the run (read only); -1 = none"),
    ("AIC_LOCAL", -1, "", "AIC timing: the simulation's table of keys met in the run"),
    ("ROUTER_PIN", 0, "", "kv_router: 1 = place on the trace row's worker (costs still computed)"),
    ("SG_MAX_PREFILL_TOKENS", 16384, "", "SGLang: prefill tokens of a pass at most"),
    ("SG_CHUNK_SIZE", 8192, "", "SGLang: chunked_prefill_size (a multiple of the page size)"),
    ("SG_CLIP", 4096, "", "SGLang: clip_max_new_tokens (the output reserve of a request at most)"),
    ("SG_LPM", 0, "", "SGLang: 1 = longest-prefix-match scheduling, 0 = fifo"),
    ("SG_PD_INTERVAL", 0, "", "SGLang: prefill_decode_interval (passes without prefill after one)"),
    ("DP_SIZE", 1, "", "attention-DP ranks of its logical worker (kernels.dp.attention_dp); 1 = a worker "
                       "is one rank"),
    ("DP_RANK", 0, "", "its rank in that group: the group's rank 0 is worker w - DP_RANK"),
    ("PREFILL_CADENCE", 1, "", "vLLM with attention DP: prefill_schedule_interval (prefills on every "
                               "N-th group pass unless capacity-bound; engine.md 5.7)"),
    ("TOK_SERVERS", 0, "", "tokenization pool: servers ahead of the worker's scheduler "
                           "(kernels.loop.tokenization); 0 = none"),
    ("SG_HOST_LOOP", 0, "", "SGLang: 1 = the host loop (kernels.sglang.host_loop): a pass selects "
                            "the next batch while the previous forward runs"),
    ("SPEC_NEXTN", 0, "", "speculative decoding (kernels.spec): draft tokens a verify pass checks "
                          "(aic_nextn); 0 = none"),
    ("SPEC_ACCEPT_0", 0, "", "speculation: draft 1's conditional acceptance as rand's Bernoulli "
                             "threshold (uint64 bits; -1 = always, no draw)"),
    ("SPEC_ACCEPT_1", 0, "", "draft 2's"),
    ("SPEC_ACCEPT_2", 0, "", "draft 3's"),
    ("SPEC_ACCEPT_3", 0, "", "draft 4's"),
    ("SPEC_ACCEPT_4", 0, "", "draft 5's"),
])
(CFG_NUM_GPU_BLOCKS, CFG_BLOCK_SIZE, CFG_MAX_NUM_SEQS, CFG_MAX_NUM_BATCHED_TOKENS,
 CFG_MAX_MODEL_LEN, CFG_PREFIX_CACHING, CFG_CHUNKED_PREFILL, CFG_PREEMPTION_FIFO, CFG_POLICY,
 CFG_ROLE, CFG_TIMING, CFG_TRANSFER_MODE, CFG_AIC_SHARED, CFG_AIC_LOCAL, CFG_ROUTER_PIN,
 CFG_SG_MAX_PREFILL_TOKENS, CFG_SG_CHUNK_SIZE, CFG_SG_CLIP, CFG_SG_LPM, CFG_SG_PD_INTERVAL,
 CFG_DP_SIZE, CFG_DP_RANK, CFG_PREFILL_CADENCE, CFG_TOK_SERVERS, CFG_SG_HOST_LOOP, CFG_SPEC_NEXTN,
 CFG_SPEC_ACCEPT_0, CFG_SPEC_ACCEPT_1, CFG_SPEC_ACCEPT_2, CFG_SPEC_ACCEPT_3,
 CFG_SPEC_ACCEPT_4) = RANK_CONFIG_I.indices()
SPEC_MAX_NEXTN = 5  # the reference's limit (aic_nextn in 1..=5)
# CFGF_KV_BANDWIDTH_GBS / CFGF_KV_BYTES_PER_TOKEN are NaN when not configured (the
# transfer then takes CFGF_HANDOFF_LATENCY_MS, the topology's fallback).
RANK_CONFIG_F = FieldTable("CFGF_", "cfg.f64", np.float64, [
    ("FIXED_PREFILL_MS", 0.0, "", "fixed timing: prefill part of a pass"),
    ("FIXED_DECODE_MS", 0.0, "", "fixed timing: decode part of a pass"),
    ("SPEEDUP_RATIO", 1.0, "", "modeled durations divided by this"),
    ("DECODE_SPEEDUP_RATIO", 1.0, "", "decode durations divided by this too"),
    ("KV_BANDWIDTH_GBS", np.nan, "", "KV transfer bandwidth, decimal GB/s"),
    ("KV_BYTES_PER_TOKEN", np.nan, "", "KV bytes per prompt token transferred"),
    ("HANDOFF_LATENCY_MS", 0.0, "", "transfer delay when the transfer model is incomplete"),
    ("ROUTER_CREDIT", 1.0, "", "kv_router: overlap_score_credit (blocks of prefill credited per cached block)"),
    ("ROUTER_LOAD_SCALE", 1.0, "", "kv_router: prefill_load_scale"),
    ("ROUTER_TEMPERATURE", 0.0, "", "kv_router: softmax temperature (0 = the lowest cost)"),
    ("SG_INIT_RATIO", 0.7, "", "SGLang: initial new-token ratio (0.7 x schedule_conservativeness)"),
    ("SG_MIN_RATIO", 0.098, "", "SGLang: its floor (init x 0.14)"),
    ("SG_DECAY_STEP", 0.001001, "", "SGLang: its decay per decode pass ((init - min) / 600)"),
    ("TOK_BASE_MS", 0.0, "", "tokenization pool: time of a request"),
    ("TOK_PER_TOKEN_MS", 0.0, "", "tokenization pool: time per prompt token"),
])
(CFGF_FIXED_PREFILL_MS, CFGF_FIXED_DECODE_MS, CFGF_SPEEDUP_RATIO, CFGF_DECODE_SPEEDUP_RATIO,
 CFGF_KV_BANDWIDTH_GBS, CFGF_KV_BYTES_PER_TOKEN, CFGF_HANDOFF_LATENCY_MS, CFGF_ROUTER_CREDIT,
 CFGF_ROUTER_LOAD_SCALE, CFGF_ROUTER_TEMPERATURE, CFGF_SG_INIT_RATIO, CFGF_SG_MIN_RATIO,
 CFGF_SG_DECAY_STEP, CFGF_TOK_BASE_MS, CFGF_TOK_PER_TOKEN_MS) = RANK_CONFIG_F.indices()
CFG_I_FIELDS = RANK_CONFIG_I.width
CFG_F_FIELDS = RANK_CONFIG_F.width

# Block pool, per worker: pool.w64[w, PW_*]; per arena slot: pool.b32[b, PB_*].
POOL_W = FieldTable("PW_", "pool.w64", np.int64, [
    ("BLK_OFF", 0, "b", "first arena slot of the worker"),
    ("BLK_LEN", 0, "", "arena slots of the worker"),
    ("TAB_OFF", 0, "", "first prefix-table slot"),
    ("TAB_MASK", 0, "", "prefix-table size - 1 (a power of two)"),
    ("FREE_TOP", 0, "", "slots given back, a stack in the PB_FREE_STACK column of the arena's first rows"),
    ("NUM_COPIES", 0, "", "resident copies (private and cached)"),
    ("NUM_RESERVED", 0, "", "blocks reserved and not yet copies"),
    ("LRU_HEAD", -1, "b", "oldest inactive cached copy (evicted first)"),
    ("LRU_TAIL", -1, "b", "newest inactive cached copy"),
    ("LRU_LEN", 0, "", "inactive cached copies"),
    ("BUMP", 0, "", "arena slots handed out so far; slots past it were never used and hold "
                    "garbage until block_pool._take_slot initializes them"),
    ("SIM", 0, "", "simulation of the worker (its KV event log row)"),
    ("PASS_NUM", 0, "", "the worker's pass counter as of its latest pass start (PB_PUB_PASS)"),
    ("EVICTED_OFF", 0, "", "kv_router: first slot of the worker's region of pool.evicted_hash"),
    ("EVICTED_CAP", 0, "", "kv_router: its slots (the worker's arena; 0 = the router does not read "
                           "this pool's prefix index)"),
    ("EVICTED_LEN", 0, "", "kv_router: hashes in it, all evicted by the pass numbered EVICTED_PASS"),
    ("EVICTED_PASS", -1, "", "kv_router: low 31 bits of PW_PASS_NUM of the pass that evicted them"),
])
(PW_BLK_OFF, PW_BLK_LEN, PW_TAB_OFF, PW_TAB_MASK, PW_FREE_TOP, PW_NUM_COPIES, PW_NUM_RESERVED,
 PW_LRU_HEAD, PW_LRU_TAIL, PW_LRU_LEN, PW_BUMP, PW_SIM, PW_PASS_NUM, PW_EVICTED_OFF, PW_EVICTED_CAP,
 PW_EVICTED_LEN, PW_EVICTED_PASS) = POOL_W.indices()
PW_FIELDS = POOL_W.width
# PB_DUP / PB_DUP_PREV link the copies of one hash oldest first; PB_DUP_TAIL is
# the newest copy, kept on the primary so appending a duplicate is O(1).
POOL_B = FieldTable("PB_", "pool.b32", np.int32, [
    ("FREE_STACK", -1, "b", "free-slot stack entry (rows [0, PW_FREE_TOP) of the arena)"),
    ("REF", 0, "", "lease references"),
    ("PIN", 0, "", "pins"),
    ("CACHED", 0, "", "1 = visible under its hash, else private"),
    ("PREV", -1, "b", "LRU: newer neighbour"),
    ("NEXT", -1, "b", "LRU: older neighbour"),
    ("DUP", -1, "b", "next (newer) copy of the same hash"),
    ("DUP_PREV", -1, "b", "previous (older) copy of the same hash"),
    ("DUP_TAIL", -1, "b", "on a primary: the newest copy of its hash"),
    ("PUB_PASS", 0, "", "low 31 bits of PW_PASS_NUM when this copy was published (the KV "
                        "router learns a block at the end of the pass that stored it)"),
])
(PB_FREE_STACK, PB_REF, PB_PIN, PB_CACHED, PB_PREV, PB_NEXT, PB_DUP, PB_DUP_PREV, PB_DUP_TAIL,
 PB_PUB_PASS) = POOL_B.indices()
PB_FIELDS = POOL_B.width

# Requests: rq.i64[q, RQ_*] and rq.f64[q, RQF_*].
# Disaggregated replay: a logical request (trace row) is served by two rows, the
# logical row itself on the decode side and a prefill row (``max_output`` 1) on the
# prefill side, linked both ways by RQ_PEER (-1 when aggregated). The logical row
# carries the handoff state.
REQUEST_I = FieldTable("RQ_", "rq.i64", np.int64, [
    ("PROMPT_LEN", 0, "", "prompt tokens"),
    ("MAX_OUTPUT", 0, "", "output budget (TRT-LLM: clamped to the pool)"),
    ("SRC_ROW", 0, "", "workload row (trace row at this block size)"),
    ("SESSION", 0, "", "session index"),
    ("SESSION_ROW", 0, "", "1 = its trace row names a session_id (SGLang KV events: its inserts "
                           "are Stored events of their own)"),
    ("TURN", 0, "", "turn index in its session"),
    ("NEXT_TURN", -1, "q", "next turn of the session"),
    ("LEASE_OFF", 0, "k", "first entry of its block lease / hash row"),
    ("UUID", 0, "", "arrival ordinal of the simulation, from 1 (synthetic output tokens)"),
    ("STATUS", RS_NOT_ARRIVED, "", "where it is in its life, RS_*"),
    ("WORKER", -1, "w", "worker serving it"),
    ("GENERATED", 0, "", "output tokens emitted"),
    ("NUM_COMPUTED", 0, "", "tokens computed (prompt and output)"),
    ("ALLOCATED", 0, "", "tokens its lease covers"),
    ("NUM_HASHED", 0, "", "lease entries whose sequence hash is known"),
    ("PREEMPTIONS", 0, "", "times preempted"),
    ("ADMISSIONS", 0, "", "times admitted"),
    ("FIRST_CACHED", -1, "", "cached tokens at its first admission; -1 = not admitted yet"),
    ("MAX_CACHED", 0, "", "largest cached tokens over its admissions"),
    ("SCHED_STAMP", 0, "", "stamp of the pass that last scheduled it"),
    ("SCHED_TOKENS", 0, "", "tokens it was scheduled in that pass"),
    ("SCHED_PROMPT", 0, "", "prompt tokens among them"),
    ("SCHED_PREFIX", 0, "", "prompt tokens computed before that pass"),
    ("SCHED_TERMINAL", 0, "", "1 = nothing left to generate after that pass"),
    ("TERM_NEXT", -1, "q", "next entry of its worker's terminal list"),
    ("TOKEN_NEXT", -1, "q", "attention DP: next request whose token of the group pass in flight "
                            "waits for the group's end to get its time"),
    ("TERMINAL", TERM_NONE, "", "how it ended, TERM_*"),
    ("NO_TOKEN_STATS", 0, "", "1 = its token gaps stay out of the token statistics (a request "
                              "a time cap leaves unfinished: the reference folds a request's "
                              "gaps when it completes)"),
    ("COMMITTED_PREFILL", 0, "", "tokens of pass chunks that computed prompt tokens"),
    ("SCHED_LEN", 0, "", "sequence length when last scheduled"),
    ("PEER", -1, "q", "disaggregated: the other row of the same logical request"),
    ("ACTION", ACT_NONE, "", "queued or deferred handoff action, ACT_*"),
    ("LINK", -1, "q", "next entry of a deferred-action or pending-destination list"),
    ("ORDINAL", 0, "", "decode-rank arrival ordinal"),
    ("ATTEMPT_GEN", 0, "", "capacity generation of its last failed reservation attempt"),
    ("RESERVED_HITS", 0, "", "reserved blocks reused from the decode rank's prefix cache"),
    ("RESERVED_FRESH", 0, "", "reserved fresh blocks"),
    ("XFER_SEQ", 0, "", "start order of its transfer: equal completion times pop in it"),
    ("REPUBLISHED", 0, "", "prompt blocks the decode rank published again after activation "
                           "(recomputed after a decode-side preemption let them be evicted)"),
    ("FAST_LIMIT", 0, "", "largest computed-token count the pass's fast path may reach without "
                          "completing a block or growing the lease (0 = unknown: take the full "
                          "schedule step, which sets it again)"),
    ("REPORTED", 0, "", "1 once its terminal was seen at its pass end (the state changes at pass "
                        "start, the outside world learns of it at the end)"),
    ("SCHED_CLASS", 0, "", "what it contributes to its pass's timing, CLASS_* of decode_step"),
    ("RT_PENDING", 0, "", "kv_router: its share of the worker's P_w until its first token"),
    ("RT_ACTIVE", 0, "", "kv_router: its prompt blocks counted in the worker's D_w (0 once released)"),
    ("PIN_WORKER", -1, "", "kv_router pin_to_trace_worker: the trace row's worker in the pool"),
    ("SG_CACHED", 0, "", "SGLang: page-aligned tokens of its prefix in the radix tree, locked "
                         "through SG_LAST"),
    ("SG_LAST", -1, "n", "SGLang: the locked tree node ending at SG_CACHED; -1 = no active lease"),
    ("SG_LPM_KEY", 0, "", "SGLang lpm: its sort key in the latest scan (deprioritized, -prefix)"),
    ("SG_LPM_RECORDED", 0, "", "SGLang lpm: 1 = its leading pages were recorded in the latest scan"),
    ("SG_READY_NEXT", -1, "q", "SGLang decode rank: next activated request of its worker's ready "
                               "list (prompt KV resident, waiting for a running slot)"),
    ("HL_DONE_STAMP", 0, "", "SGLang host loop: stamp of the pass whose forward gave its last token "
                             "(it stays in the batch until that forward is observed); 0 = none"),
    ("HL_COMMIT_STAMP", 0, "", "SGLang host loop: stamp of the pass whose forward materialized the "
                               "prefix it commits to the radix tree when observed; 0 = none"),
    ("HL_COMMIT_THROUGH", 0, "", "SGLang host loop: the tokens that commit covers"),
    ("HL_TOKENS_PENDING", 0, "", "SGLang host loop: its tokens counted by a forward and not yet "
                                 "observed (0-2: the forward in flight's, the one just launched)"),
    ("HL_TOKEN_STAMP", 0, "", "SGLang host loop: stamp of the pass that gave its newest pending token"),
])
(RQ_PROMPT_LEN, RQ_MAX_OUTPUT, RQ_SRC_ROW, RQ_SESSION, RQ_SESSION_ROW, RQ_TURN, RQ_NEXT_TURN,
 RQ_LEASE_OFF, RQ_UUID, RQ_STATUS, RQ_WORKER, RQ_GENERATED, RQ_NUM_COMPUTED, RQ_ALLOCATED,
 RQ_NUM_HASHED, RQ_PREEMPTIONS, RQ_ADMISSIONS, RQ_FIRST_CACHED, RQ_MAX_CACHED, RQ_SCHED_STAMP,
 RQ_SCHED_TOKENS, RQ_SCHED_PROMPT, RQ_SCHED_PREFIX, RQ_SCHED_TERMINAL, RQ_TERM_NEXT, RQ_TOKEN_NEXT,
 RQ_TERMINAL, RQ_NO_TOKEN_STATS, RQ_COMMITTED_PREFILL, RQ_SCHED_LEN, RQ_PEER, RQ_ACTION, RQ_LINK,
 RQ_ORDINAL, RQ_ATTEMPT_GEN, RQ_RESERVED_HITS, RQ_RESERVED_FRESH, RQ_XFER_SEQ, RQ_REPUBLISHED,
 RQ_FAST_LIMIT, RQ_REPORTED, RQ_SCHED_CLASS, RQ_RT_PENDING, RQ_RT_ACTIVE, RQ_PIN_WORKER,
 RQ_SG_CACHED, RQ_SG_LAST, RQ_SG_LPM_KEY, RQ_SG_LPM_RECORDED,
 RQ_SG_READY_NEXT, RQ_HL_DONE_STAMP, RQ_HL_COMMIT_STAMP, RQ_HL_COMMIT_THROUGH, RQ_HL_TOKENS_PENDING,
 RQ_HL_TOKEN_STAMP) = REQUEST_I.indices()
REQUEST_F = FieldTable("RQF_", "rq.f64", np.float64, [
    ("DELAY_MS", np.nan, "", "think time after the previous turn's terminal"),
    ("START_MS", np.nan, "", "trace timestamp of a first turn (scaled)"),
    ("READY_MS", np.nan, "", "release time of a later turn"),
    ("ARRIVAL_MS", np.nan, "", "arrival"),
    ("FIRST_ADMIT_MS", np.nan, "", "first admission"),
    ("FIRST_TOKEN_MS", np.nan, "", "first output token"),
    ("SECOND_TOKEN_MS", np.nan, "", "second output token"),
    ("LAST_TOKEN_MS", np.nan, "", "latest output token"),
    ("TERMINAL_MS", np.nan, "", "terminal (visible at its pass end)"),
    ("SOURCE_HELD_MS", np.nan, "", "disaggregated: prefill KV held"),
    ("DEST_RESERVED_MS", np.nan, "", "destination reserved"),
    ("DEST_ACTIVATED_MS", np.nan, "", "destination activated"),
    ("SOURCE_RELEASED_MS", np.nan, "", "source released"),
    ("TRANSFER_DONE_MS", np.nan, "", "KV transfer completed"),
    ("TOKENIZED_MS", np.nan, "", "tokenization pool: its prompt tokenized (it reaches its scheduler)"),
    ("RECEIVED_MS", np.nan, "", "SGLang host loop: the iteration that took it from the scheduler's "
                                "inbox began"),
    ("FRONTEND_READY_MS", np.nan, "", "SGLang frontend: it left the last stage for the scheduler's inbox"),
])
(RQF_DELAY_MS, RQF_START_MS, RQF_READY_MS, RQF_ARRIVAL_MS, RQF_FIRST_ADMIT_MS, RQF_FIRST_TOKEN_MS,
 RQF_SECOND_TOKEN_MS, RQF_LAST_TOKEN_MS, RQF_TERMINAL_MS, RQF_SOURCE_HELD_MS, RQF_DEST_RESERVED_MS,
 RQF_DEST_ACTIVATED_MS, RQF_SOURCE_RELEASED_MS, RQF_TRANSFER_DONE_MS, RQF_TOKENIZED_MS,
 RQF_RECEIVED_MS, RQF_FRONTEND_READY_MS) = REQUEST_F.indices()
RQ_I_FIELDS = REQUEST_I.width
RQ_F_FIELDS = REQUEST_F.width

# Workers (event loop side): wk.i64[w, WK_*].
WORKER = FieldTable("WK_", "wk.i64", np.int64, [
    ("SIM", 0, "", "simulation of the worker"),
    ("RUN_OFF", 0, "", "first slot of its running list in wk.run_q"),
    ("RUN_LEN", 0, "", "running requests"),
    ("WAIT_OFF", 0, "", "first slot of its waiting ring in wk.wait_q"),
    ("WAIT_CAP", 0, "", "waiting ring slots"),
    ("WAIT_HEAD", 0, "", "ring position of the waiting head"),
    ("WAIT_LEN", 0, "", "waiting requests"),
    ("BUSY", 0, "", "1 = a pass in flight (ends at wk.pass_end_ms)"),
    ("TERM_HEAD", -1, "q", "terminals (and held sources) of the pass in flight, output order"),
    ("STALLED", 0, "", "1 = nothing can change for it until new work reaches it"),
    ("PASS_STAMP", 0, "", "passes run"),
    ("PREEMPTIONS_TOTAL", 0, "", "preemptions so far"),
    ("TERM_TAIL", -1, "q", "last entry of the terminal list"),
    ("PEND_HEAD", -1, "q", "pending-destination FIFO head (linked by RQ_LINK)"),
    ("PEND_TAIL", -1, "q", "pending-destination FIFO tail"),
    ("PEND_LEN", 0, "", "pending destinations"),
    ("CAP_GEN", 0, "", "capacity generation, bumped whenever capacity or slots may have been freed"),
    ("DEFER_HEAD", -1, "q", "handoff actions deferred until its pass in flight ends"),
    ("DEFER_TAIL", -1, "q", "last deferred action"),
    ("ORDINAL_NEXT", 0, "", "next decode-rank arrival ordinal"),
    ("TRT_TAIL", 0, "", "TRT-LLM decode rank: blocks that reserved and activated-waiting "
                        "destinations still need to finish, held back from admissions"),
    ("OVERFLOW", 0, "", "on a simulation's first worker: 1 once a push of any of its workers found "
                        "the running list or waiting ring full (nothing was written; the event "
                        "loop ends the simulation with SIM_CAPACITY)"),
    ("SIM_W0", 0, "w", "first worker of its simulation"),
    ("LAST_PASS_NS", 0, "", "duration of its last pass (of a decode run's, their mean), in ns: "
                            "whether a decode run would hold enough passes to pay (event loop)"),
    ("STAT_ROW", 0, "", "row of sims.token_stat / token_hist its token gaps go to: its "
                        "simulation's, or its own while its simulation's workers are "
                        "independent (SM_INDEPENDENT; merged when the simulation ends)"),
    ("RUN_CAP", 0, "", "running list slots"),
    # kv_router view of the worker (kernels.routing.kv_router)
    ("RT_PREFILL_TOKENS", 0, "", "P_w: prompt tokens still to prefill of requests routed here"),
    ("RT_FREED_TOKENS", 0, "", "part of P_w the pass in flight releases at its end (first tokens)"),
    ("RT_ACTIVE_BLOCKS", 0, "", "D_w: complete prompt blocks of requests active here (distinct ones aggregated)"),
    ("RT_OFF", 0, "", "first slot of its active-block multiset in wk.rt_key / rt_count"),
    ("RT_MASK", -1, "", "multiset slots in use - 1 (a power of two); -1 = none"),
    ("RT_USED", 0, "", "multiset slots taken: by a block active here, or released and not yet "
                       "dropped by a rebuild"),
    ("RT_LIMIT", 0, "", "multiset slots its region holds, the most RT_MASK + 1 grows to"),
    ("SG_RATIO_BITS", 0, "", "SGLang: the new-token ratio (float64 bits)"),
    ("SG_PREFILL_ROUNDS", 0, "", "SGLang: passes left before prefill may run again (the interval)"),
    ("SG_READY_HEAD", -1, "q", "SGLang decode rank: oldest activated request not running yet "
                               "(the reference's prebuilt-ready FIFO, linked by RQ_SG_READY_NEXT)"),
    ("SG_READY_TAIL", -1, "q", "SGLang decode rank: newest entry of the ready list"),
    ("SG_READY_LEN", 0, "", "SGLang decode rank: entries of the ready list"),
    ("DP_CURSOR", 0, "", "attention DP, on a group's rank 0: round-robin cursor over its ranks"),
    ("DP_WAVE", 0, "", "attention DP, on a group's rank 0: group passes since the group was last "
                       "drained (the reference's wave step)"),
    ("RESERVED_LEN", 0, "", "disaggregated decode rank: destinations reserved and not yet activated"),
    ("SG_PASS_FLAGS", 0, "", "SGLang attention-DP rank: what its pass of the group pass in flight "
                             "did (sglang_core.PASS_*), for the group's end"),
    ("CAPACITY_BOUND", 0, "", "vLLM cadence: 1 = the last pass that could prefill left requests "
                              "waiting (the next passes prefill whatever the cadence)"),
    ("TOK_OFF", 0, "", "tokenization pool: first of its servers' free times in wk.tok_free_ms"),
    ("HL_IN_FLIGHT", 0, "", "SGLang host loop: 1 = a forward whose result is not observed yet"),
    ("HL_IN_FLIGHT_END_BITS", 0, "", "SGLang host loop: when that forward ends (float64 bits)"),
    ("HL_GPU_FREE_BITS", 0, "", "SGLang host loop: when the GPU is free of launched forwards (float64 bits)"),
    ("FE_STAGES", 0, "", "SGLang frontend: its stages (kernels.sglang.frontend); 0 = none"),
    ("FE_STAGE_OFF", 0, "", "SGLang frontend: its first stage's row of wk.fe_stage"),
    ("FE_NOW_BITS", 0, "", "SGLang frontend: the time its pools were advanced to (float64 bits)"),
    ("SPEC_WORD", 0, "", "speculation: next word of its acceptance stream (kernels.spec.sampler)"),
    ("SPEC_BLOCK", -1, "", "speculation: the stream block held in wk.spec_rng[w, 8:24]; -1 = none"),
])
(WK_SIM, WK_RUN_OFF, WK_RUN_LEN, WK_WAIT_OFF, WK_WAIT_CAP, WK_WAIT_HEAD, WK_WAIT_LEN, WK_BUSY,
 WK_TERM_HEAD, WK_STALLED, WK_PASS_STAMP, WK_PREEMPTIONS_TOTAL, WK_TERM_TAIL, WK_PEND_HEAD,
 WK_PEND_TAIL, WK_PEND_LEN, WK_CAP_GEN, WK_DEFER_HEAD, WK_DEFER_TAIL, WK_ORDINAL_NEXT, WK_TRT_TAIL,
 WK_OVERFLOW, WK_SIM_W0, WK_LAST_PASS_NS, WK_STAT_ROW, WK_RUN_CAP, WK_RT_PREFILL_TOKENS,
 WK_RT_FREED_TOKENS, WK_RT_ACTIVE_BLOCKS, WK_RT_OFF, WK_RT_MASK, WK_RT_USED, WK_RT_LIMIT,
 WK_SG_RATIO_BITS, WK_SG_PREFILL_ROUNDS, WK_SG_READY_HEAD, WK_SG_READY_TAIL, WK_SG_READY_LEN,
 WK_DP_CURSOR, WK_DP_WAVE, WK_RESERVED_LEN, WK_SG_PASS_FLAGS, WK_CAPACITY_BOUND, WK_TOK_OFF,
 WK_HL_IN_FLIGHT, WK_HL_IN_FLIGHT_END_BITS, WK_HL_GPU_FREE_BITS, WK_FE_STAGES, WK_FE_STAGE_OFF,
 WK_FE_NOW_BITS, WK_SPEC_WORD, WK_SPEC_BLOCK) = WORKER.indices()
WK_FIELDS = WORKER.width

# Simulations: sims.i64[s, SM_*]. Disaggregated simulations: workers [W_OFF, W_OFF +
# PREFILL_LEN) are the prefill pool, the rest the decode pool (0 prefill workers =
# aggregated).
SIMULATION = FieldTable("SM_", "sims.i64", np.int64, [
    ("Q_OFF", 0, "q", "first request row"),
    ("Q_LEN", 0, "", "logical requests (trace rows)"),
    ("W_OFF", 0, "w", "first worker"),
    ("W_LEN", 0, "", "workers (both pools)"),
    ("CONCURRENCY", 0, "", "closed-loop session cap; 0 = open loop"),
    ("STATUS", SIM_RUNNING, "", "SIM_*"),
    ("NUM_STARTS", 0, "", "first turns in the start order"),
    ("START_PTR", 0, "", "next entry of the start order"),
    ("HEAP_LEN", 0, "", "follow-up turns waiting for their release time"),
    ("ACTIVE_SESSIONS", 0, "", "sessions in flight"),
    ("RR_CURSOR", 0, "", "round-robin cursor of the aggregated or prefill pool"),
    ("NUM_ARRIVED", 0, "", "requests arrived"),
    ("NUM_TERMINAL", 0, "", "requests terminal (never-sent turns included)"),
    ("NUM_NOT_SENT", 0, "", "session turns never sent: their session ended at a failed turn"),
    ("UUID_NEXT", 1, "", "next request uuid"),
    ("PASS_LOG_LEN", 0, "", "rows of the pass log in use"),
    ("RESUME_WORKER", -1, "w", "a call that returned to flush the pass log in the middle of an "
                               "instant's drive resumes the drive at this worker (-1: a new drain)"),
    ("PREFILL_LEN", 0, "", "prefill workers (0 = aggregated)"),
    ("DECODE_CURSOR", 0, "", "round-robin cursor of the decode pool"),
    ("ACTQ_HEAD", 0, "", "FIFO handoff action queue: head (a ring in sims.actq at Q_OFF)"),
    ("ACTQ_LEN", 0, "", "queued handoff actions"),
    ("XFER_LEN", 0, "", "transfers in flight (a heap in sims.xfer_heap at Q_OFF)"),
    ("OPEN_HANDOFFS", 0, "", "sources not released"),
    ("XFER_SEQ", 0, "", "transfers started"),
    ("HLOG_LEN", 0, "", "rows of the handoff journal in use"),
    ("DECODE_RUN_PASSES", 0, "", "passes run inside decode runs (kernels.vllm.decode_run)"),
    ("PLACEMENT", PLACE_ROUND_ROBIN, "", "placement policy, PLACE_* (kernels.routing.placement)"),
    ("RNG_STATE", 0, "", "splitmix64 state of seeded random placement"),
    ("PREFILL_Q_OFF", -1, "q", "disaggregated: first prefill row (its rows are contiguous, in "
                               "the order of their logical rows); -1 = aggregated"),
    ("RT_LOG_LEN", 0, "", "kv_router decisions logged (sims.rt_log rows)"),
    ("BUSY_LEN", 0, "", "workers with a pass in flight (wk.busy_heap from SM_W_OFF)"),
    ("DEAD_IN_FLIGHT", -1, "", "a dead end the reference reports for one worker (SGLang: an "
                               "effect-free zero-duration pass it does not retry): that worker's "
                               "requests in flight; -1 = the whole simulation's"),
    ("GROUP_PASS", 0, "", "attention DP: 1 while the ranks of a group pass run (tokens wait "
                          "for the group's end, kernels.dp.attention_dp)"),
    ("TOKEN_HEAD", -1, "q", "attention DP: first request with a token waiting for the group's end"),
    ("TOKEN_TAIL", -1, "q", "attention DP: last one"),
    ("INDEPENDENT", 0, "", "1 = its workers share nothing between releases (a routed open-loop "
                           "single-turn aggregated run without logs): a decode run goes on past "
                           "other workers' pass ends (kernels.vllm.decode_run.quiet_until_ms)"),
    ("DEST_FIRST", 0, "", "disaggregated: 1 = DestinationFirst handoff order (SGLang: the decode "
                          "slot is reserved at arrival, the prefill submitted once it holds), "
                          "0 = SourceFirst (vLLM, TRT-LLM)"),
    ("FRONTEND", 0, "", "1 = some worker has SGLang frontend stages (their completions are "
                        "instants of the event loop: kernels.sglang.frontend)"),
    ("AGENTIC", 0, "", "1 = its requests are an agentic dependency graph, released by "
                       "kernels.agentic.release (sims.ag_*)"),
    ("AG_PLAY_OFF", 0, "", "agentic: its first play (row of sims.ag_play)"),
    ("AG_NEXT_PLAY", 0, "", "agentic lanes: the next play a freed lane starts (row of sims.ag_play)"),
    ("AG_PLAY_END", 0, "", "agentic: past its last play"),
    ("AG_SEQ", 0, "", "agentic: sends and feedback batches (a pass end's terminals, a failed "
                      "handoff) so far, in the order they happen (the lifecycle's order)"),
])
(SM_Q_OFF, SM_Q_LEN, SM_W_OFF, SM_W_LEN, SM_CONCURRENCY, SM_STATUS, SM_NUM_STARTS, SM_START_PTR,
 SM_HEAP_LEN, SM_ACTIVE_SESSIONS, SM_RR_CURSOR, SM_NUM_ARRIVED, SM_NUM_TERMINAL, SM_NUM_NOT_SENT,
 SM_UUID_NEXT, SM_PASS_LOG_LEN, SM_RESUME_WORKER, SM_PREFILL_LEN, SM_DECODE_CURSOR, SM_ACTQ_HEAD,
 SM_ACTQ_LEN, SM_XFER_LEN, SM_OPEN_HANDOFFS, SM_XFER_SEQ, SM_HLOG_LEN, SM_DECODE_RUN_PASSES,
 SM_PLACEMENT, SM_RNG_STATE, SM_PREFILL_Q_OFF, SM_RT_LOG_LEN, SM_BUSY_LEN, SM_DEAD_IN_FLIGHT,
 SM_GROUP_PASS, SM_TOKEN_HEAD, SM_TOKEN_TAIL, SM_INDEPENDENT, SM_DEST_FIRST, SM_FRONTEND,
 SM_AGENTIC, SM_AG_PLAY_OFF, SM_AG_NEXT_PLAY, SM_AG_PLAY_END, SM_AG_SEQ) = SIMULATION.indices()
SM_FIELDS = SIMULATION.width

STATE_TABLES = (RANK_CONFIG_I, RANK_CONFIG_F, POOL_W, POOL_B, REQUEST_I, REQUEST_F, WORKER,
                SIMULATION)


# AIC timing tables (kernels.timing.aic_table): open-addressing hash tables laid end to end
# in cfg.aic_key / cfg.aic_ms (keys: packed timing keys, AIC_EMPTY = free slot;
# values: raw ms), described by cfg.aic_meta[t, AICM_*].
AIC_EMPTY = -1
AICM_TIMING = 0   # the timing's id in the driver (aisim_fast.aic.timing)
AICM_COUNT = 1    # keys held
AICM_OFF = 2      # first slot
AICM_MASK = 3     # slots - 1 (a power of two)
AICM_FIELDS = 4
_NO_AIC_KEYS = np.full(0, AIC_EMPTY, np.int64)
_NO_AIC_MS = np.zeros(0, np.float64)
_NO_AIC_META = np.zeros((0, AICM_FIELDS), np.int64)


class Features(NamedTuple):
    """Which optional features a batch's kernels compile, by the type of each field:
    None leaves the feature's code out, ``True`` compiles it in (kernels.features:
    the gates, and ``features_of``, which derives them from the configuration)."""
    kv_router: object = None     # KV-aware placement (kernels.routing.kv_router)
    attention_dp: object = None  # ranks of dp_size behind one pass barrier (kernels.dp.attention_dp)
    trtllm: object = None        # TRT-LLM's capacity policy (kernels.trtllm.policy)
    aic: object = None           # op-level timing tables (kernels.timing.aic_table)
    tokenization: object = None  # a tokenization pool ahead of the schedulers (kernels.loop.tokenization)
    sglang_host_loop: object = None  # SGLang's overlapped host loop (kernels.sglang.host_loop)
    sglang_frontend: object = None   # SGLang's frontend stages (kernels.sglang.frontend)
    speculation: object = None   # speculative decoding's multi-token passes (kernels.spec)
    agentic: object = None       # requests released by a dependency graph (kernels.agentic)


class RankConfig(NamedTuple):
    """Scheduler configuration per worker (reference field names, see CFG_*), the
    AIC timing tables its workers read (none by default), and the optional kernel
    features the batch compiles (none by default)."""
    i64: np.ndarray   # int64[w, CFG_I_FIELDS]; max_model_len -1 = no limit
    f64: np.ndarray   # float64[w, CFG_F_FIELDS]
    aic_key: np.ndarray = _NO_AIC_KEYS     # int64[slot] packed timing keys of every table
    aic_ms: np.ndarray = _NO_AIC_MS        # float64[slot] raw duration of each key
    aic_meta: np.ndarray = _NO_AIC_META    # int64[t, AICM_FIELDS]
    features: Features = Features()


# The engine event log (opt-in, ``Pool.event_log[s, 1 + row, EV_*]``): one row per
# fact of a simulation's engines, in the order they happen, at the virtual time the
# engine decides it (a pass start, a handoff action). Row 0 of a simulation is its
# header: events so far (past the rows: dropped, counted) and the time of the events
# now. Values are int64; hashes and times are stored as the bit patterns of their
# uint64 / float64 values. One array, not several: every kernel call passes the pool
# bundle, and its size shows.
#
#   kind            EV_A                EV_B                    EV_C
#   KV_STORED       block hash          parent block hash       KV_FIRST / KV_FIRST_WITH_PARENT / KV_NEXT
#   KV_REMOVED      block hash          -                       KV_FIRST / KV_NEXT
#   ADMITTED        request row         cached prompt tokens    admissions so far
#   PREEMPTED       request row         running before          active blocks before
#   FINISHED        request row         TERM_* (0 = source held) tokens generated
#   OUTPUT          request row         token ordinal (from 1)  1 = its last token
#   PRESSURE        request's blocks    active blocks after     waiting before (-1: none)
#   PRESSURE_SGLANG logical available   required blocks         -
#
# A preemption (vLLM) or retraction (SGLang) is one pressure event of the seed's
# PressureEvent: its PREEMPTED row, then a PRESSURE row (the request's active blocks
# before, the worker's active blocks after, the waiting requests before; SGLang's
# scheduler exposes no waiting count), then on SGLang a PRESSURE_SGLANG row (the
# logically available and the required blocks of the retraction decision). The rows
# of one event are consecutive: an event's rows are written in one kernel step.
#
# KV_STORED: a block hash became visible on a worker (its first resident copy was
# published); KV_REMOVED: the last resident copy of a hash was evicted - the facts the
# reference reports as KV events, one row per block. EV_C groups the rows into the
# reference's events: KV_NEXT continues the event of the row before (Stored:
# consecutive blocks of one request that became visible in one step; Removed: the
# evictions of one reservation), KV_FIRST starts one (Stored: at block 0, no parent),
# KV_FIRST_WITH_PARENT starts a Stored event whose parent is EV_B. A Stored row also
# holds the block's tokens-only hash (EV_TOKENS_HASH), its request (EV_REQUEST, a
# kernel row) and block index (EV_BLOCK); other kinds leave those 0. The time of a KV
# row is when the reference makes it visible: the end of the pass that caused it, or
# the time of the handoff command that caused it (commands run on idle workers only:
# an action for a busy one waits for its pass end). OUTPUT (opt-in on top, header EVH_OUTPUTS): one
# row per emitted token at its pass end (the time the outside world sees it; the
# other kinds carry the pass start), so the log is time-ordered per worker only.
EV_KV_STORED = 0
EV_KV_REMOVED = 1
EV_ADMITTED = 2
EV_PREEMPTED = 3
EV_FINISHED = 4
EV_OUTPUT = 5
EV_PRESSURE = 6
EV_PRESSURE_SGLANG = 7
EV_KV_REPORTED = 8  # a worker reports its KV rows logged since its last report, at EV_TIME_BITS
EV_KIND_NAMES = ("stored", "removed", "admitted", "preempted", "finished", "output", "pressure",
                 "pressure_sglang", "reported")
EVENT_LOG = FieldTable("EV_", "pool.event_log", np.int64, [
    ("KIND", 0, "", "EV_KV_STORED ... EV_KV_REPORTED"),
    ("WORKER", 0, "w", "the worker"),
    ("A", 0, "", "see the kinds above"),
    ("B", 0, "", "see the kinds above"),
    ("C", 0, "", "see the kinds above"),
    ("TIME_BITS", 0, "", "the time (float64 bits)"),
    ("TOKENS_HASH", 0, "", "KV_STORED: the block's tokens-only hash"),
    ("REQUEST", 0, "q", "KV_STORED: the request (kernel row)"),
    ("BLOCK", 0, "", "KV_STORED: the block index in the request"),
])
(EV_KIND, EV_WORKER, EV_A, EV_B, EV_C, EV_TIME_BITS, EV_TOKENS_HASH, EV_REQUEST,
 EV_BLOCK) = EVENT_LOG.indices()
EV_NUM_COLUMNS = EVENT_LOG.width
(KV_FIRST, KV_FIRST_WITH_PARENT, KV_NEXT) = range(3)  # EV_C of KV rows
EVH_LEN = 0            # header row: events so far
EVH_CLOCK_BITS = 1     # header row: time of the events now (float64 bits)
EVH_OUTPUTS = 2        # header row: 1 = log every output token too (EV_OUTPUT)
EVH_KV = 3             # header row: 1 = log KV Stored / Removed facts (0: engine facts only)
_NO_EVENT_LOG = np.zeros((0, 0, EV_NUM_COLUMNS), np.int64)


# SGLang radix cache (kernels.sglang.radix), per worker: radix.w64[w, RW_*]; per
# page slot: radix.pg32[b, RP_*] and radix.pg_key[b]; per tree node: radix.nd[n, RN_*].
# A node's edge is a chain of pages (RP_NEXT / RP_PREV, head to tail = oldest to
# newest position), so splits, appends and tail evictions move no keys.
RADIX_W = FieldTable("RW_", "radix.w64", np.int64, [
    ("PAGE_OFF", 0, "b", "first page slot of the worker"),
    ("PAGE_LEN", 0, "", "page slots of the worker (resident pages at most)"),
    ("PAGE_CAP", 0, "", "the pool: num_gpu_blocks pages (free = PAGE_CAP - PAGES_USED)"),
    ("PAGE_FREE_TOP", 0, "", "pages given back: a stack in the RP_FREE_STACK column"),
    ("PAGE_BUMP", 0, "", "page slots handed out so far (the rest never used)"),
    ("PAGES_USED", 0, "", "pages in use (tree or leases)"),
    ("NODE_OFF", 0, "n", "first node slot (the root)"),
    ("NODE_LEN", 0, "", "node slots of the worker"),
    ("NODE_FREE_TOP", 0, "", "nodes given back: a stack in the RN_FREE_STACK column"),
    ("NODE_BUMP", 1, "", "node slots handed out so far (the root is slot 0)"),
    ("TAB_OFF", 0, "", "first child-table slot"),
    ("TAB_MASK", 0, "", "child-table size - 1 (a power of two)"),
    ("HEAP_OFF", 0, "", "first slot of the evictable-leaf heap"),
    ("HEAP_LEN", 0, "", "heap entries (some stale: checked when popped)"),
    ("HEAP_CAP", 0, "", "heap slots"),
    ("CLOCK", 0, "", "logical access clock (every read returns a larger value)"),
    ("EVICTABLE", 0, "", "tokens in unlocked tree nodes"),
    ("PROTECTED", 0, "", "tokens in locked tree nodes (root excluded)"),
    ("PAGE_SIZE", 1, "", "tokens per page"),
    ("INSERT_SHARED", 0, "", "keys the last insert found in the tree already (their pages not taken)"),
    ("SIM", 0, "", "the worker's simulation (its row of the event log)"),
    ("KV_RUN", 0, "", "KV events: the worker's open event (rows not yet reported, the latest "
                      "its): KV_RUN_NONE, KV_RUN_REMOVED (a Removed row continues it) or "
                      "KV_RUN_STORED (a Stored insert chained to its last block continues it)"),
    ("KV_TAIL_HASH", 0, "", "KV events: the last block hash of the open Stored event (as int64)"),
    ("KV_UNREPORTED", 0, "", "KV events: the worker's KV rows logged since its last report"),
    ("DECODE_PASSES", 0, "", "passes without a prefill batch since the run's start (the "
                             "reference reports KV events at every DECODE_LOG_INTERVAL-th)"),
])
(RW_PAGE_OFF, RW_PAGE_LEN, RW_PAGE_CAP, RW_PAGE_FREE_TOP, RW_PAGE_BUMP, RW_PAGES_USED, RW_NODE_OFF,
 RW_NODE_LEN, RW_NODE_FREE_TOP, RW_NODE_BUMP, RW_TAB_OFF, RW_TAB_MASK, RW_HEAP_OFF, RW_HEAP_LEN,
 RW_HEAP_CAP, RW_CLOCK, RW_EVICTABLE, RW_PROTECTED, RW_PAGE_SIZE, RW_INSERT_SHARED, RW_SIM,
 RW_KV_RUN, RW_KV_TAIL_HASH, RW_KV_UNREPORTED, RW_DECODE_PASSES) = RADIX_W.indices()
RW_FIELDS = RADIX_W.width
KV_RUN_NONE, KV_RUN_REMOVED, KV_RUN_STORED = 0, 1, 2
RADIX_P = FieldTable("RP_", "radix.pg32", np.int32, [
    ("NEXT", -1, "b", "next (newer) page of the same edge"),
    ("PREV", -1, "b", "previous (older) page of the same edge"),
    ("IN_TREE", 0, "", "1 = the page belongs to a tree edge, 0 = to a lease alone (or free)"),
    ("FREE_STACK", -1, "b", "free-page stack entry (rows [0, RW_PAGE_FREE_TOP) of the slots)"),
    ("RUN_LAST", -1, "b", "in the tree: the last page of its run, a stretch of its edge's pages "
                          "with equal keys (runs need not be maximal; matching skips them)"),
    ("RUN_LEFT", 0, "", "in the tree: pages from this one to RUN_LAST, both included"),
])
(RP_NEXT, RP_PREV, RP_IN_TREE, RP_FREE_STACK, RP_RUN_LAST, RP_RUN_LEFT) = RADIX_P.indices()
RP_FIELDS = RADIX_P.width
RADIX_N = FieldTable("RN_", "radix.nd", np.int64, [
    ("PARENT", -1, "n", "parent node; -1 = the root"),
    ("HEAD", -1, "b", "first page of the edge"),
    ("TAIL", -1, "b", "last page of the edge"),
    ("LEN", 0, "", "pages of the edge"),
    ("LOCK", 0, "", "requests locking the node (through their path)"),
    ("TIME", 0, "", "last access (logical clock)"),
    ("CHILDREN", 0, "", "child nodes"),
    ("FREE_STACK", -1, "n", "free-node stack entry"),
])
(RN_PARENT, RN_HEAD, RN_TAIL, RN_LEN, RN_LOCK, RN_TIME, RN_CHILDREN,
 RN_FREE_STACK) = RADIX_N.indices()
RN_FIELDS = RADIX_N.width
_NO_RADIX_W = np.zeros((0, RW_FIELDS), np.int64)
_NO_RADIX_P = np.zeros((0, RP_FIELDS), np.int32)
_NO_RADIX_N = np.zeros((0, RN_FIELDS), np.int64)


class Radix(NamedTuple):
    """SGLang radix caches of every worker (global arrays sliced by RW_*_OFF); empty
    when no worker runs SGLang."""
    w64: np.ndarray = _NO_RADIX_W                    # int64[w, RW_FIELDS]
    pg32: np.ndarray = _NO_RADIX_P                   # int32[b, RP_FIELDS]
    pg_key: np.ndarray = np.zeros(0, np.uint64)      # uint64[b] page key of a tree page
    nd: np.ndarray = _NO_RADIX_N                     # int64[n, RN_FIELDS]
    tab: np.ndarray = np.zeros(0, np.int32)          # int32[t] child of (parent, first key); -1 empty
    heap_time: np.ndarray = np.zeros(0, np.int64)    # int64[h] evictable-leaf heap: access time
    heap_node: np.ndarray = np.zeros(0, np.int64)    # int64[h] and node
    # KV events (the pool's event log, the same array, when KV facts are logged): the
    # sequence hash of each tree page, set when it enters the tree, for its Removed
    # event; empty when no KV event is logged
    pg_hash: np.ndarray = np.zeros(0, np.uint64)     # uint64[b]
    event_log: np.ndarray = _NO_EVENT_LOG            # int64[s, 1 + rows, EV_NUM_COLUMNS]


class Pool(NamedTuple):
    """Paged G1 block pools of every worker (global arrays sliced by PW_BLK_OFF /
    PW_TAB_OFF): counters per worker, links and counts per arena slot, and the
    opt-in engine event log per simulation (no event rows = off; the default is empty)."""
    w64: np.ndarray       # int64[w, PW_FIELDS]
    b32: np.ndarray       # int32[b, PB_FIELDS] (free stack, refs, pins, cached flag, LRU, duplicates)
    blk_hash: np.ndarray  # uint64[b] sequence hash of a cached copy
    tab: np.ndarray       # int32[t] primary copy of a hash, NO_BLOCK = empty slot
    # uint64[g]: per worker the router reads (PW_EVICTED_*), the hashes that were in the
    # prefix table when the pass in flight started and that it evicted: the router
    # learns of a removal, as of a store, at the end of that pass
    evicted_hash: np.ndarray
    event_log: np.ndarray = _NO_EVENT_LOG     # int64[s, 1 + rows, EV_NUM_COLUMNS]; 1 row = off
    radix: Radix = Radix()                    # SGLang workers' radix caches (empty otherwise)


class Requests(NamedTuple):
    """Per-request state of every simulation (one row per request), plus the CSR
    block rows."""
    i64: np.ndarray       # int64[q, RQ_I_FIELDS]
    f64: np.ndarray       # float64[q, RQ_F_FIELDS]
    lease: np.ndarray     # int32[k] physical block of each block entry
    seq_hash: np.ndarray  # uint64[k] sequence hash of each block entry


class Workload(NamedTuple):
    """Trace rows shared by all simulations: prompt tokens as CSR of interned
    hash ids, prompt block hashes for the engine block size of the row, and where
    its output token ids come from."""
    hash_indptr: np.ndarray       # int64[row+1]
    hash_ids: np.ndarray          # uint32[nnz] interned trace hash ids
    trace_block_size: np.ndarray  # int64[row]
    phash_indptr: np.ndarray      # int64[row+1]
    phash: np.ndarray             # uint64[nnz]
    # the output token ids of each row (kernels.trace.output_plan.output_token_ids): >= 0 the
    # plan stream word of its first token, < 0 its authored ids at out_authored[-1 - x]
    out_plan: np.ndarray          # int64[row]
    out_authored: np.ndarray      # uint32[nnz]


_NO_RT_KEY = np.zeros(0, np.uint64)
_NO_RT_COUNT = np.zeros(0, np.int32)
# kv_router decision log (``sims.rt_log[s, row, RL_*]``, one row per decision; the
# costs of every worker of the pool in ``sims.rt_costs[s, row, worker]``)
ROUTING_LOG = FieldTable("RL_", "sims.rt_log", np.float64, [
    ("REQUEST", 0, "q", "the request (kernel row)"),
    ("WORKER", 0, "", "the worker chosen (in its pool)"),
    ("COST", 0, "", "its cost"),
    ("OVERLAP", 0, "", "its prefix overlap in blocks"),
    ("BEST_OVERLAP", 0, "", "the pool's best overlap"),
    ("TIED", 0, "", "workers tied at the lowest cost"),
    ("TIME_MS", 0, "", "when it was decided"),
    ("POOL", 0, "", "the pool it placed in, ROUTE_*"),
])
(RL_REQUEST, RL_WORKER, RL_COST, RL_OVERLAP, RL_BEST_OVERLAP, RL_TIED, RL_TIME_MS,
 RL_POOL) = ROUTING_LOG.indices()
RL_NUM_COLUMNS = ROUTING_LOG.width
# the pool a decision placed in (RL_POOL), and the cost each pool's router computes
# (kernels.routing.kv_router)
ROUTE_AGGREGATED, ROUTE_PREFILL, ROUTE_DECODE = 0, 1, 2
ROUTE_POOL_NAMES = ("aggregated", "prefill", "decode")
_NO_RT_LOG = np.zeros((0, 0, RL_NUM_COLUMNS))
_NO_RT_COSTS = np.zeros((0, 0, 0))


_NO_TOK_FREE = np.zeros(0, np.float64)

# SGLang frontend stages (kernels.sglang.frontend): wk.fe_stage[g, FS_*], one row per
# stage of every worker with a frontend (its rows from WK_FE_STAGE_OFF)
FRONTEND_STAGE = FieldTable("FS_", "wk.fe_stage", np.int64, [
    ("WORKERS", 1, "", "jobs it serves at once"),
    ("SLOT_OFF", 0, "", "first of its job slots in wk.fe_slot_q / fe_slot_rem"),
    ("ACTIVE", 0, "", "jobs in service (slots from SLOT_OFF)"),
    ("WAIT_HEAD", -1, "q", "oldest job waiting for a worker (linked by RQ_LINK)"),
    ("WAIT_TAIL", -1, "q", "newest job waiting"),
    ("SCALE_OFF", 0, "", "first of its concurrency_scale values in wk.fe_scale"),
    ("SCALE_LEN", 0, "", "concurrency_scale values (service time x value at index jobs - 1)"),
    ("SERVICE_BITS", 0, "", "service time of a job alone, ms (float64 bits)"),
])
(FS_WORKERS, FS_SLOT_OFF, FS_ACTIVE, FS_WAIT_HEAD, FS_WAIT_TAIL, FS_SCALE_OFF, FS_SCALE_LEN,
 FS_SERVICE_BITS) = FRONTEND_STAGE.indices()
FS_FIELDS = FRONTEND_STAGE.width
_NO_FE_STAGE = np.zeros((0, FS_FIELDS), np.int64)
_NO_FE_Q = np.zeros(0, np.int64)
_NO_FE_F = np.zeros(0, np.float64)
_NO_SPEC_RNG = np.zeros((0, 24), np.uint32)


class Workers(NamedTuple):
    """Event-loop state of every worker."""
    i64: np.ndarray          # int64[w, WK_FIELDS]
    pass_end_ms: np.ndarray  # float64[w]
    run_q: np.ndarray        # int64[..] running lists (slices at WK_RUN_OFF)
    wait_q: np.ndarray       # int64[..] waiting rings (slices at WK_WAIT_OFF)
    # int64[w] per simulation (slices at SM_W_OFF), a min-heap of its busy workers by
    # (pass end, worker): the next instant and the passes ending at it without a scan
    busy_heap: np.ndarray = np.zeros(0, np.int64)
    # uint8[w] 1 = the worker may be able to start a pass (its pass ended, or work or
    # room reached it: rank_queues.wake); the drive visits only these
    ready: np.ndarray = np.zeros(0, np.uint8)
    rt_key: np.ndarray = _NO_RT_KEY      # uint64[..] kv_router active-block multisets (WK_RT_OFF)
    rt_count: np.ndarray = _NO_RT_COUNT  # int32[..] their counts (0 = free or no longer active)
    # float64[..] when each tokenization server of a worker is next free (WK_TOK_OFF,
    # CFG_TOK_SERVERS slots); empty when no worker has a pool
    tok_free_ms: np.ndarray = _NO_TOK_FREE
    # SGLang frontend stages (kernels.sglang.frontend); empty when no worker has them
    fe_stage: np.ndarray = _NO_FE_STAGE    # int64[g, FS_FIELDS]
    fe_slot_q: np.ndarray = _NO_FE_Q       # int64[..] the job in each slot
    fe_slot_rem: np.ndarray = _NO_FE_F     # float64[..] the fraction of its service still owed
    fe_slot_due: np.ndarray = _NO_FE_Q     # int64[..] scratch: 1 = the job completes at the deadline
    fe_scale: np.ndarray = _NO_FE_F        # float64[..] concurrency_scale values
    # uint32[w, 24] speculation (kernels.spec.sampler): each worker's acceptance stream,
    # its 8 ChaCha key words then the 16 words of the block WK_SPEC_BLOCK; empty when
    # no worker speculates
    spec_rng: np.ndarray = _NO_SPEC_RNG


# Agentic dependency graphs (kernels.agentic.release): per logical request row
# ``sims.ag_q[q, AGQ_*]``, its out-edges ``sims.ag_edge[e, AGE_*]`` (delay in
# ``sims.ag_edge_ms[e]``), and per play ``sims.ag_play[g, AGP_*]`` (its roots' earliest
# not_before in ``sims.ag_play_ms[g]``). Empty unless some simulation is agentic.
AGENTIC_REQUEST = FieldTable("AGQ_", "sims.ag_q", np.int64, [
    ("DEPS_LEFT", 0, "", "dependencies not yet fired (0: a root, or released)"),
    ("EDGE_OFF", 0, "", "first of its out-edges in sims.ag_edge"),
    ("EDGE_LEN", 0, "", "out-edges"),
    ("PLAY", -1, "", "its play (row of sims.ag_play)"),
    ("PLAY_NEXT", -1, "q", "next request of its play in node order"),
    ("SENT_SEQ", -1, "", "SM_AG_SEQ of its send"),
    ("ENDED_SEQ", -1, "", "SM_AG_SEQ of the feedback batch that reported its terminal"),
])
(AGQ_DEPS_LEFT, AGQ_EDGE_OFF, AGQ_EDGE_LEN, AGQ_PLAY, AGQ_PLAY_NEXT, AGQ_SENT_SEQ,
 AGQ_ENDED_SEQ) = AGENTIC_REQUEST.indices()
AGQ_FIELDS = AGENTIC_REQUEST.width
AGENTIC_EDGE = FieldTable("AGE_", "sims.ag_edge", np.int64, [
    ("CHILD", 0, "q", "the request the edge releases"),
    ("TRIGGER", 0, "", "AG_TRIGGER_*: what of the source fires it"),
])
(AGE_CHILD, AGE_TRIGGER) = AGENTIC_EDGE.indices()
AGE_FIELDS = AGENTIC_EDGE.width
AG_TRIGGER_DISPATCH = 0    # the source is sent
AG_TRIGGER_COMPLETION = 1  # the source completes
AGENTIC_PLAY = FieldTable("AGP_", "sims.ag_play", np.int64, [
    ("FIRST", -1, "q", "its first request in node order (linked by AGQ_PLAY_NEXT)"),
    ("NODES", 0, "", "requests"),
    ("COMPLETED", 0, "", "requests completed"),
    ("PENDING", 0, "", "requests sent and not yet ended"),
    ("FAILED", 0, "", "1 once a request of it was rejected, canceled or failed"),
    ("FINISHED", 0, "", "1 once every request completed, or it failed with its sent requests ended"),
    ("LANE", -1, "", "the lane it runs on (-1: no lanes, or not started yet): a lane freed by its "
                     "play's finish starts the next play waiting (SM_AG_NEXT_PLAY)"),
])
(AGP_FIRST, AGP_NODES, AGP_COMPLETED, AGP_PENDING, AGP_FAILED, AGP_FINISHED,
 AGP_LANE) = AGENTIC_PLAY.indices()
AGP_FIELDS = AGENTIC_PLAY.width
_NO_AG_Q = np.zeros((0, AGQ_FIELDS), np.int64)
_NO_AG_EDGE = np.zeros((0, AGE_FIELDS), np.int64)
_NO_AG_PLAY = np.zeros((0, AGP_FIELDS), np.int64)
_NO_AG_MS = np.zeros(0, np.float64)


class Sims(NamedTuple):
    """Event-loop state of every simulation and its admission source."""
    i64: np.ndarray          # int64[s, SM_FIELDS]
    now_ms: np.ndarray       # float64[s]
    start_order: np.ndarray  # int64[q] first turns in release order (slices at SM_Q_OFF)
    heap_q: np.ndarray       # int64[q] follow-up turns by release time (slices at SM_Q_OFF)
    actq: np.ndarray         # int64[q] disaggregated handoff action ring (slices at SM_Q_OFF)
    xfer_heap: np.ndarray    # int64[q] transfers in flight by completion time (slices at SM_Q_OFF)
    token_stat: np.ndarray   # float64[s, TOKEN_STAT_WIDTH] token-gap accumulators (kernels.stats.sketch)
    token_hist: np.ndarray   # int64[s, TOKEN_HIST_WIDTH]
    pass_log: np.ndarray     # float64[s, rows, PL_NUM_COLUMNS]
    hlog: np.ndarray         # float64[s, rows, HL_NUM_COLUMNS] handoff journal (0 rows = off)
    rt_log: np.ndarray = _NO_RT_LOG      # float64[s, rows, RL_NUM_COLUMNS] kv_router decisions
    rt_costs: np.ndarray = _NO_RT_COSTS  # float64[s, rows, workers] every worker's cost
    # agentic dependency graphs (kernels.agentic.release; empty unless some simulation is)
    ag_q: np.ndarray = _NO_AG_Q          # int64[q, AGQ_FIELDS] per logical request row
    ag_nb_ms: np.ndarray = _NO_AG_MS     # float64[q] its not_before (re-based, sped up)
    ag_edge: np.ndarray = _NO_AG_EDGE    # int64[e, AGE_FIELDS] out-edges, by source
    ag_edge_ms: np.ndarray = _NO_AG_MS   # float64[e] each edge's delay
    ag_play: np.ndarray = _NO_AG_PLAY    # int64[g, AGP_FIELDS] per play
    ag_play_ms: np.ndarray = _NO_AG_MS   # float64[g] its roots' earliest not_before


for _table in [value for value in globals().values() if isinstance(value, FieldTable)]:
    check_constants(_table, globals())
