"""One rank driven command by command (``aisim_fast.protocol.rank``): the kernels behind the
rank protocol's Submit, CancelRequest, pass start and pass completion, over the same
state and scheduler code as the replay's event loop (``kernels.loop.event_loop``).

A rank is a simulation of one aggregated worker. The driver owns the clock: it
submits requests, starts a pass at a time of its choosing and completes it at the
pass end the start returned; nothing here advances time on its own. Every entry
takes an array of simulations, so one call steps many ranks (the batch form).
"""

import numpy as np
from numba import njit

from aisim_fast.kernels.disagg.handoff import (_drop_queued, accept_destination, activate_destination,
                                                cancel_destination, release_held_source, retry_destination)
from aisim_fast.kernels.jit import kernel
from aisim_fast.kernels.kv.block_pool import event_log_on, event_set_clock, kv_events_visible_at, note_event
from aisim_fast.kernels.loop.arrivals import _arrive, complete_pass
from aisim_fast.kernels.loop.backends import run_pass, sglang_run_pass
from aisim_fast.kernels.loop.rank_queues import wake
from aisim_fast.kernels.schema.layout import (ACC_SIZE, CFG_POLICY, CMD_APPLIED, EV_FINISHED, EVH_LEN,
                                              POLICY_SGLANG, RQ_ALLOCATED, RQ_GENERATED, RQ_STATUS,
                                              RQ_TERMINAL, RQ_WORKER, RQF_TERMINAL_MS, RS_DONE, RS_HELD,
                                              RS_PREEMPTED, RS_RESERVED, RS_RUNNING, RS_WAITING,
                                              SIM_ARENA_FULL, SIM_CAPACITY, SIM_RUNNING, SM_STATUS, SM_W_OFF,
                                              TERM_CANCELED, WK_BUSY, WK_CAP_GEN, WK_OVERFLOW, WK_WAIT_CAP,
                                              WK_WAIT_LEN)
from aisim_fast.kernels.sglang.core import drop_queued as sglang_drop_queued, effect_free_pass_gives_up
from aisim_fast.kernels.sglang.handoff import destination_impossible as sglang_destination_impossible
from aisim_fast.kernels.vllm.capacity import destination_impossible

# CancelRequest results (rank.CommandResult)
CANCEL_NOOP = 0
CANCEL_APPLIED = 1

# ReserveDestination results
RESERVE_IMPOSSIBLE = -1   # refused: the destination can never hold the prompt (nothing done)
RESERVE_ACCEPTED = 0

# what a destination retry reserved: a request row, or these
RETRY_NONE = -1           # nothing reserved (no head, attempted this generation, no room)
RETRY_ARENA_FULL = -2     # the block arena is exhausted: the rank cannot go on


@njit(cache=True, nogil=True)
def submit_requests(cfg, p, rq, wl, wk, sims, sim_ids, q_rows, now_ms):
    """Submit request row ``q_rows[i]`` to the rank (simulation) ``sim_ids[i]`` at
    ``now_ms[i]``: its prompt block hashes, the back of the waiting queue. Returns
    False for a rank whose waiting queue had no room (nothing written; the driver
    grows the queues and submits again)."""
    ok = np.ones(sim_ids.shape[0], np.bool_)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w0 = sims.i64[s, SM_W_OFF]
        if wk.i64[w0, WK_WAIT_LEN] >= wk.i64[w0, WK_WAIT_CAP]:
            ok[i] = False
            continue
        _arrive(cfg, p, rq, wl, wk, sims, s, q_rows[i], now_ms[i])
    return ok


@njit(cache=True, nogil=True)
def start_passes(cfg, p, rq, wl, wk, sims, sim_ids, now_ms, max_lease_blocks, max_block_size):
    """Start a pass on each rank ``sim_ids[i]`` at ``now_ms[i]``. The scheduler decides
    the whole pass now (admissions, preemptions, tokens, KV changes, as the
    reference's core does eagerly); its KV events become visible at its end. Returns
    (end_ms[i], had_effect[i]); a rank whose pass ran out of KV arena or queue room
    gets status SIM_ARENA_FULL / SIM_CAPACITY and end -inf."""
    acc = np.zeros(ACC_SIZE, np.int64)
    hits = np.empty(max_lease_blocks, np.int32)
    fresh = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    end_ms = np.empty(sim_ids.shape[0])
    had_effect = np.zeros(sim_ids.shape[0], np.bool_)
    events_on = event_log_on(p)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        sims.now_ms[s] = now_ms[i]
        sims.i64[s, SM_STATUS] = SIM_RUNNING
        if events_on:
            event_set_clock(p, s, now_ms[i])
        first_event = p.event_log[s, 0, EVH_LEN] if events_on else 0
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            end, effect, arena_full = sglang_run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms[i], acc, hits,
                                                      fresh, scratch_tokens)
        else:
            end, effect, arena_full = run_pass(cfg, p, rq, wl, wk, sims, s, w, now_ms[i], acc, hits, fresh,
                                               scratch_tokens)
        if arena_full or wk.i64[w, WK_OVERFLOW]:
            sims.i64[s, SM_STATUS] = SIM_ARENA_FULL if arena_full else SIM_CAPACITY
            end_ms[i] = -np.inf
            continue
        if events_on:
            kv_events_visible_at(p, s, first_event, end)
        wk.i64[w, WK_BUSY] = 1
        wk.pass_end_ms[w] = end
        end_ms[i] = end
        had_effect[i] = effect
    return end_ms, had_effect


@njit(cache=True, nogil=True)
def complete_passes(cfg, rq, wk, sims, sim_ids):
    """The pass in flight on each rank ``sim_ids[i]`` completes: its worker is idle
    again and its terminals leave the terminal list."""
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        sims.now_ms[s] = wk.pass_end_ms[w]
        complete_pass(cfg, rq, wk, sims, s, w)


@njit(cache=True, nogil=True)
def cancel_requests(cfg, p, rq, wk, sims, sim_ids, q_rows, now_ms):
    """CancelRequest of request row ``q_rows[i]`` on rank ``sim_ids[i]``: a request
    the rank's queues own (waiting, running, preempted) is dropped - vLLM releases
    its lease as a finish does, SGLang aborts it (``sglang.core.drop_queued``) - and
    its terminal is ``canceled`` (CANCEL_APPLIED); any other request is left alone
    (CANCEL_NOOP). The rank's capacity generation moves when KV was freed (vLLM: the
    request held blocks or ran; SGLang: pages freed or a lock released)."""
    result = np.zeros(sim_ids.shape[0], np.int64)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        q = q_rows[i]
        status = rq.i64[q, RQ_STATUS]
        if status != RS_WAITING and status != RS_RUNNING and status != RS_PREEMPTED:
            continue
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            moved = sglang_drop_queued(p.radix, rq, wk, w, q)
            if moved < 0:
                continue
            bump = moved == 1
        else:
            bump = rq.i64[q, RQ_ALLOCATED] > 0 or status == RS_RUNNING
            if not _drop_queued(cfg, p, rq, wk, w, q):
                continue
        rq.i64[q, RQ_STATUS] = RS_DONE
        rq.i64[q, RQ_TERMINAL] = TERM_CANCELED
        rq.f64[q, RQF_TERMINAL_MS] = now_ms[i]
        if bump:
            wk.i64[w, WK_CAP_GEN] += 1
        wake(wk, w)
        if event_log_on(p):
            event_set_clock(p, s, now_ms[i])
            note_event(p, w, EV_FINISHED, q, np.int64(TERM_CANCELED), rq.i64[q, RQ_GENERATED])
        result[i] = CANCEL_APPLIED
    return result


@njit(cache=True, nogil=True)
def release_sources(cfg, p, rq, wl, wk, sims, sim_ids, q_rows, now_ms, max_lease_blocks, max_block_size):
    """ReleaseSource (or CancelSource) of the held source row ``q_rows[i]`` on prefill
    rank ``sim_ids[i]``: its KV released as a finish does
    (``disagg.handoff.release_held_source``, the replay's own). Returns whether each
    was held (else nothing is done)."""
    path = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    held = np.zeros(sim_ids.shape[0], np.bool_)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        q = q_rows[i]
        if rq.i64[q, RQ_STATUS] != RS_HELD:
            continue
        if event_log_on(p):
            event_set_clock(p, s, now_ms[i])
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            release_held_source(cfg, p, rq, wl, wk, w, q, path, scratch_tokens, 1)
        else:
            release_held_source(cfg, p, rq, wl, wk, w, q, path, scratch_tokens, None)
        rq.f64[q, RQF_TERMINAL_MS] = now_ms[i]
        held[i] = True
    return held


# ---------------------------------------------------------------------------------
# decode ranks: destinations (disagg_handoff's, which the replay's actions use too)
# ---------------------------------------------------------------------------------
@kernel(cache=True, _nrt=False, inline="always")
def _retry(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens):
    """Retry the pending head of decode worker w: the reserved row, RETRY_NONE or
    RETRY_ARENA_FULL."""
    if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
        return retry_destination(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens, 1)
    return retry_destination(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens, None)


@njit(cache=True, nogil=True)
def reserve_destinations(cfg, p, rq, wl, wk, sims, sim_ids, q_rows, now_ms, in_flight, max_lease_blocks,
                         max_block_size):
    """ReserveDestination of request row ``q_rows[i]`` on decode rank ``sim_ids[i]``:
    RESERVE_IMPOSSIBLE when the rank could never hold the prompt (nothing done), else
    accepted into the pending FIFO and, with no pass in flight (``in_flight[i]``
    False), the head retried at once. Returns (result[i], reserved row[i]: a row the
    retry reserved, RETRY_NONE or RETRY_ARENA_FULL)."""
    hits = np.empty(max_lease_blocks, np.int32)
    fresh = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    result = np.zeros(sim_ids.shape[0], np.int64)
    reserved = np.full(sim_ids.shape[0], RETRY_NONE, np.int64)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        q = q_rows[i]
        sims.now_ms[s] = now_ms[i]
        if event_log_on(p):
            event_set_clock(p, s, now_ms[i])
        sglang = cfg.i64[w, CFG_POLICY] == POLICY_SGLANG
        if sglang_destination_impossible(cfg, rq, w, q) if sglang else destination_impossible(cfg, p, rq, w, q):
            result[i] = RESERVE_IMPOSSIBLE
            continue
        rq.i64[q, RQ_WORKER] = w
        if sglang:
            accept_destination(rq, wl, wk, w, q, 1)
        else:
            accept_destination(rq, wl, wk, w, q, None)
        if not in_flight[i]:
            reserved[i] = _retry(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens)
    return result, reserved


@njit(cache=True, nogil=True)
def activate_destinations(cfg, p, rq, wl, wk, sims, sim_ids, q_rows, now_ms, in_flight, max_lease_blocks,
                          max_block_size):
    """ActivateDestination of request row ``q_rows[i]`` on decode rank ``sim_ids[i]``:
    applied only to a reserved destination (its reservation committed, the request
    waiting at its arrival position); then, with no pass in flight, the pending head
    retried. Returns (applied[i], reserved row[i] as ``reserve_destinations``)."""
    hits = np.empty(max_lease_blocks, np.int32)
    fresh = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    applied = np.zeros(sim_ids.shape[0], np.bool_)
    reserved = np.full(sim_ids.shape[0], RETRY_NONE, np.int64)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        q = q_rows[i]
        if rq.i64[q, RQ_STATUS] != RS_RESERVED:
            continue
        sims.now_ms[s] = now_ms[i]
        if event_log_on(p):
            event_set_clock(p, s, now_ms[i])
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            activate_destination(cfg, p, rq, wk, w, q, 1)
        else:
            activate_destination(cfg, p, rq, wk, w, q, None)
        applied[i] = True
        if not in_flight[i]:
            reserved[i] = _retry(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens)
    return applied, reserved


@njit(cache=True, nogil=True)
def cancel_destinations(cfg, p, rq, wl, wk, sims, sim_ids, q_rows, now_ms, in_flight, max_lease_blocks,
                        max_block_size):
    """CancelDestination of request row ``q_rows[i]`` on decode rank ``sim_ids[i]``
    (``disagg.handoff.cancel_destination``: pending removed, reserved given back,
    activated dropped); applied, the pending head is retried when no pass is in
    flight. Returns (applied[i], reserved row[i])."""
    hits = np.empty(max_lease_blocks, np.int32)
    fresh = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    applied = np.zeros(sim_ids.shape[0], np.bool_)
    reserved = np.full(sim_ids.shape[0], RETRY_NONE, np.int64)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        q = q_rows[i]
        sims.now_ms[s] = now_ms[i]
        if event_log_on(p):
            event_set_clock(p, s, now_ms[i])
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            result = cancel_destination(cfg, p, rq, wk, q, 1)
        else:
            result = cancel_destination(cfg, p, rq, wk, q, None)
        if result != CMD_APPLIED:
            continue
        rq.f64[q, RQF_TERMINAL_MS] = now_ms[i]
        applied[i] = True
        if event_log_on(p):
            note_event(p, w, EV_FINISHED, q, np.int64(TERM_CANCELED), rq.i64[q, RQ_GENERATED])
        if not in_flight[i]:
            reserved[i] = _retry(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens)
    return applied, reserved


@njit(cache=True, nogil=True)
def retry_destinations(cfg, p, rq, wl, wk, sims, sim_ids, max_lease_blocks, max_block_size):
    """At a pass completion of decode rank ``sim_ids[i]``: retry its pending head (at
    the completion's time). Returns the reserved row[i] as ``reserve_destinations``."""
    hits = np.empty(max_lease_blocks, np.int32)
    fresh = np.empty(max_lease_blocks, np.int32)
    scratch_tokens = np.empty(max_block_size, np.uint32)
    reserved = np.full(sim_ids.shape[0], RETRY_NONE, np.int64)
    for i in range(sim_ids.shape[0]):
        s = sim_ids[i]
        w = sims.i64[s, SM_W_OFF]
        if event_log_on(p):
            event_set_clock(p, s, sims.now_ms[s])
        reserved[i] = _retry(cfg, p, rq, wl, wk, w, hits, fresh, scratch_tokens)
    return reserved


@njit(cache=True, nogil=True)
def destinations_impossible(cfg, p, rq, sims, sim_ids, q_rows):
    """Whether decode rank ``sim_ids[i]`` could never hold request row ``q_rows[i]``'s
    prompt (ReserveDestination is then refused); changes nothing."""
    out = np.zeros(sim_ids.shape[0], np.bool_)
    for i in range(sim_ids.shape[0]):
        w = sims.i64[sim_ids[i], SM_W_OFF]
        if cfg.i64[w, CFG_POLICY] == POLICY_SGLANG:
            out[i] = sglang_destination_impossible(cfg, rq, w, q_rows[i])
        else:
            out[i] = destination_impossible(cfg, p, rq, w, q_rows[i])
    return out


@njit(cache=True, nogil=True)
def effect_free_passes_give_up(cfg, wk, sims, sim_ids):
    """SGLang rank ``sim_ids[i]`` ran a zero-duration pass that changed nothing while
    holding work: the reference's replay runs it again at that instant while the
    pass still decays the new-token ratio and gives up after its retry limit
    (``sglang.core.effect_free_pass_gives_up``, which applies those decays). Returns
    whether each gives up."""
    out = np.zeros(sim_ids.shape[0], np.bool_)
    for i in range(sim_ids.shape[0]):
        out[i] = effect_free_pass_gives_up(cfg, wk, sims.i64[sim_ids[i], SM_W_OFF])
    return out
