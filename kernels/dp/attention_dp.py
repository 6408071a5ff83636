"""Attention data parallelism: a logical worker of ``dp_size`` ranks behind one pass
barrier, as the reference's grouped engine runs it (engine.md §3.3, replay.md §5.6).

Each rank is a kernel worker of its own (queues, KV pool, config row), numbered
consecutively per logical worker (``CFG_DP_RANK``; rank 0 leads the group). The group
has one pass in flight at a time: when it is free and any rank has work, every rank
with work runs its pass at ``now`` in rank order, and the group's pass ends at the
latest rank end. Every rank's outputs become visible then: its tokens get their
time from the group's end (``loop.token_output.token_times``), and so do its terminals,
its pass-log rows and its KV events. A rank without work still waits for the
barrier. The busy heap holds the group's rank 0 only; its completion completes
every rank in rank order.

Placement is the reference's two-level rotation: the pool cursor picks the logical
worker, then the worker's own cursor (``WK_DP_CURSOR``) picks its rank.

The event loop (``kernels.loop.event_loop``) drives the group; the functions here are
its pieces.

vLLM ranks keep the reference's prefill cadence (engine.md 5.7): with
``prefill_schedule_interval`` N > 1 a rank defers prefill work on group passes whose
wave step (``WK_DP_WAVE`` on rank 0: group passes since the group was last drained)
is not a multiple of N, unless its last pass that could prefill left requests
waiting (``WK_CAPACITY_BOUND``) or it has no decode to protect.

Disaggregated pools group their ranks the same way, each pool with its own
``dp_size``; their placement is one flat rotation over every rank of the pool (the
reference's pool round robin), so no rank cursor there.

SGLang's ``prefill_decode_interval`` counts group passes: each rank notes what its
pass did and the group's end applies the countdown to every rank
(``sglang.core.finish_group_pass``).

The kv_router routes over every rank of a pool (``kernels.routing.kv_router``): each rank has
its own prefill load, active blocks and prefix index, as Dynamo's router sees the
(worker, dp_rank) pairs. A rank that sits out a group pass has no pass of its own in
flight (``kv.block_pool.NO_PASS``): everything it stored or evicted is seen.

Not simulated with attention DP (the configuration refuses it): the rank protocol."""

import numpy as np

from aisim_fast.kernels.features import gate
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on
from aisim_fast.kernels.loop.token_output import token_times
from aisim_fast.kernels.routing.placement import place
from aisim_fast.kernels.schema.layout import (CFG_DP_RANK, CFG_DP_SIZE, CFG_PREFILL_CADENCE, EV_KIND,
                                              EV_KV_REMOVED, EV_KV_REPORTED, EV_TIME_BITS, EVH_LEN, PL_END_MS,
                                              RQ_NUM_COMPUTED, RQ_PROMPT_LEN, RQ_TERM_NEXT, RQF_TERMINAL_MS,
                                              SM_GROUP_PASS, SM_PASS_LOG_LEN, SM_RR_CURSOR, SM_TOKEN_HEAD,
                                              SM_TOKEN_TAIL, WK_BUSY, WK_CAPACITY_BOUND, WK_DP_CURSOR,
                                              WK_DP_WAVE, WK_PEND_LEN, WK_RESERVED_LEN, WK_RUN_LEN,
                                              WK_RUN_OFF, WK_SG_PREFILL_ROUNDS, WK_SG_READY_LEN, WK_STALLED,
                                              WK_TERM_HEAD, WK_WAIT_LEN)


@kernel(cache=True, _nrt=False)
def place_rank(cfg, wk, sims, s, w0, n_workers):
    """The rank a new request of the pool ``[w0, w0 + n_workers)`` goes to: the pool's
    placement picks the logical worker, its cursor the rank."""
    dp = cfg.i64[w0, CFG_DP_SIZE]
    lead = w0 + dp * place(sims, s, 0, n_workers // dp, SM_RR_CURSOR)
    cursor = wk.i64[lead, WK_DP_CURSOR]
    wk.i64[lead, WK_DP_CURSOR] = cursor + 1
    return lead + cursor % dp


@kernel(cache=True, _nrt=False, inline="always")
def rank_queued(wk, w):
    """Rank w holds requests it can schedule (running, waiting, or activated ones of an
    SGLang decode rank waiting for a slot)."""
    return wk.i64[w, WK_RUN_LEN] > 0 or wk.i64[w, WK_WAIT_LEN] > 0 or wk.i64[w, WK_SG_READY_LEN] > 0


@kernel(cache=True, _nrt=False, inline="always")
def rank_has_work(wk, w):
    """Rank w would run a pass now (the reference's ready rank; one whose last pass
    changed nothing waits for new work, as a lone worker does). An SGLang rank still
    counting down its prefill_decode_interval runs (zero-duration) passes of the
    countdown too."""
    return (wk.i64[w, WK_STALLED] == 0 and rank_queued(wk, w)) or wk.i64[w, WK_SG_PREFILL_ROUNDS] > 0


@kernel(cache=True, _nrt=False)
def reset_wave_if_drained(wk, lead, dp):
    """A group none of whose ranks owns a request any more (queued, running, or a
    destination pending or reserved) counts its passes from 0 again (the reference's
    wave step, read by vLLM's prefill cadence). A prefill rank's held sources are
    not counted: on a prefill rank no running request is past its prompt, so the
    cadence never defers there."""
    for w in range(lead, lead + dp):
        if rank_queued(wk, w) or wk.i64[w, WK_PEND_LEN] > 0 or wk.i64[w, WK_RESERVED_LEN] > 0:
            return
    wk.i64[lead, WK_DP_WAVE] = 0


@kernel(cache=True, _nrt=False)
def group_has_work(wk, lead, dp):
    if wk.i64[lead, WK_BUSY] != 0:
        return False
    for w in range(lead, lead + dp):
        if rank_has_work(wk, w):
            return True
    return False


@kernel(cache=True, _nrt=False)
def group_woken(wk, lead, dp):
    """Whether something woke any rank of the group since its last drive (clears it)."""
    woken = False
    for w in range(lead, lead + dp):
        if wk.ready[w] != 0:
            woken = True
            wk.ready[w] = 0
    return woken


@kernel(cache=True, _nrt=False)
def begin_group_pass(sims, s):
    """The ranks' tokens from now on wait for the group's end."""
    sims.i64[s, SM_GROUP_PASS] = 1
    sims.i64[s, SM_TOKEN_HEAD] = -1
    sims.i64[s, SM_TOKEN_TAIL] = -1


@kernel(cache=True, _nrt=False)
def end_group_pass(cfg, p, rq, wk, sims, s, lead, dp, end_ms, first_log_row, first_event):
    """Every output of the group pass that started when the pass log had
    ``first_log_row`` rows and the event log ``first_event`` events becomes visible at
    the group's end ``end_ms``; every rank is busy until then."""
    sims.i64[s, SM_GROUP_PASS] = 0
    wk.i64[lead, WK_DP_WAVE] += 1
    token_times(cfg, p, rq, wk, sims, s, end_ms)
    for w in range(lead, lead + dp):
        q = wk.i64[w, WK_TERM_HEAD]
        while q >= 0:
            rq.f64[q, RQF_TERMINAL_MS] = end_ms
            q = rq.i64[q, RQ_TERM_NEXT]
        wk.i64[w, WK_BUSY] = 1
        wk.pass_end_ms[w] = end_ms
    for row in range(first_log_row, min(sims.i64[s, SM_PASS_LOG_LEN], sims.pass_log.shape[1])):
        sims.pass_log[s, row, PL_END_MS] = end_ms  # (the driver names the rank's worker)
    if event_log_on(p):
        # KV facts (vLLM) and reports (SGLang) of the ranks: at the barrier
        n = min(p.event_log[s, 0, EVH_LEN], p.event_log.shape[1] - 1)
        bits = np.float64(end_ms).view(np.int64)
        for r in range(first_event + 1, n + 1):
            kind = p.event_log[s, r, EV_KIND]
            if kind <= EV_KV_REMOVED or kind == EV_KV_REPORTED:
                p.event_log[s, r, EV_TIME_BITS] = bits


@kernel(cache=True, _nrt=False)
def defers_prefills(cfg, rq, wk, w):
    """Whether vLLM rank w defers prefill work in the group pass starting now (the
    reference's cadence, engine.md 5.7): off the cadence, not capacity-bound, and with
    a running request past its prompt (a decode to protect)."""
    cadence = cfg.i64[w, CFG_PREFILL_CADENCE]
    if cadence <= 1 or wk.i64[w, WK_CAPACITY_BOUND] != 0:
        return False
    if wk.i64[w - cfg.i64[w, CFG_DP_RANK], WK_DP_WAVE] % cadence == 0:
        return False
    off = wk.i64[w, WK_RUN_OFF]
    for j in range(wk.i64[w, WK_RUN_LEN]):
        q = wk.run_q[off + j]
        if rq.i64[q, RQ_NUM_COMPUTED] >= rq.i64[q, RQ_PROMPT_LEN]:
            return True
    return False


# The group's entry points behind the attention_dp feature gate (kernels.features):
# a batch of lone workers compiles none of them.
place_rank_gated = gate("attention_dp", place_rank, np.int64(0))
reset_wave_if_drained_gated = gate("attention_dp", reset_wave_if_drained)
group_has_work_gated = gate("attention_dp", group_has_work, False)
group_woken_gated = gate("attention_dp", group_woken, False)
begin_group_pass_gated = gate("attention_dp", begin_group_pass)
end_group_pass_gated = gate("attention_dp", end_group_pass)
defers_prefills_gated = gate("attention_dp", defers_prefills, False)
