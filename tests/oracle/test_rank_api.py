"""The rank protocol API (``aisim_fast.protocol.rank``): one rank driven command by command.

Two kinds of evidence. (1) The reference's single-worker runs with per-token
artifacts (``tests/data/kv_events``, tiny20) replayed by hand through a ``Rank`` - each
trace row submitted at its arrival, passes started when the rank is idle and
completed at their end, as the replay's drain does - reproduce every output token id
and time and every KV event of the reference. (2) The engine acceptance scenarios of
spec/engine.md section 13 that concern one aggregated rank, and every command's result
in every request state.
"""

from __future__ import annotations

import numpy as np
import pytest

from aisim_fast.engine.simulation import setup_workload
from aisim_fast.protocol.rank import Rank, RankGroup, synthetic_output_tokens
from aisim_fast.protocol.types import (APPLIED, NOOP, ActivateDestination, CancelDestination, CancelRequest,
                                       CancelSource, DestinationAccepted, DestinationReserved, Output,
                                       RankError, ReleaseSource, Removed, Request, ReserveDestination,
                                       SourceHeld, Stored, Submit, SubmitHandoffPrefill, Submitted)
from aisim_fast.trace.workload import load_mooncake, prompt_tokens, sequence_tokens
from support.kv_artifacts import ARTIFACT_CASES, artifact_case, reference_kv_events, reference_tokens
from support.lanes import lane
from support.paths import DATA_DIR

KV_CASES = [name for name in ARTIFACT_CASES if not name.startswith("sglang")]


def _session_trace(name):
    """Whether the run's trace has rows naming a session_id: the reference's replay
    gives a session turn's SGLang inserts Stored events of their own, which a rank
    cannot know (the protocol's Request carries no session), so those runs are not
    driven through a rank here."""
    trace = DATA_DIR / "kv_events" / name / "trace.jsonl"
    return load_mooncake(trace).session_row is not None


SGLANG_KV_CASES = [name for name in ARTIFACT_CASES if name.startswith("sglang") and not _session_trace(name)]


# ---------------------------------------------------------------------------------
# a trace replayed by hand through one rank
# ---------------------------------------------------------------------------------
def drive_trace(rank: Rank, workload):
    """Replay ``workload`` on one rank as the reference's aggregated drain does:
    at each instant the pass ending now completes, the requests due now are submitted
    in release order, then an idle rank with work starts a pass (a pass ending at the
    same instant completes and the rank goes again). Later turns of a session are
    due their think time after the previous turn's completed output.
    Returns ({row: [(token id, time)]}, [(time, KvEvent)])."""
    n = workload.num_requests
    due = [(float(workload.start_ms[q]), int(workload.session[q]), 0, q) for q in workload.order]
    next_turn = {}
    by_session: dict = {}
    for q in range(n):
        by_session.setdefault(int(workload.session[q]), []).append(q)
    for rows in by_session.values():
        for a, b in zip(rows, rows[1:]):
            next_turn[a] = b
    tokens: dict = {}
    events = []
    row_of_id = {}

    def submit(q, now):
        prompt = prompt_tokens(workload, q)
        out = sequence_tokens(workload, q, len(prompt), int(workload.output_len[q]))
        rid = f"row{q}"
        row_of_id[rid] = q
        effects = rank.apply(Submit(Request(rid, prompt.tolist(), int(workload.output_len[q]), out.tolist())), now)
        assert effects.result == Submitted(rid)

    def completed(effects, now):
        for o in effects.outputs:
            q = row_of_id[o.request_id]
            if o.token_id is not None:
                tokens.setdefault(q, []).append((o.token_id, now))
            if o.completed and q in next_turn:
                nq = next_turn[q]
                due.append((now + float(workload.delay_ms[nq]), int(workload.session[nq]),
                            int(workload.turn_index[nq]), nq))
        events.extend((now, e) for e in effects.kv_events)

    due.sort()
    now = due[0][0]
    end = None
    while True:
        if end is not None and end == now:
            completed(rank.complete_pass(), now)
            end = None
        due.sort()
        while due and due[0][0] <= now:
            submit(due.pop(0)[3], now)
        while end is None and rank.has_work:
            start = rank.start_pass(now)
            if start.end_ms > now:
                end = start.end_ms
                break
            effects = rank.complete_pass()
            completed(effects, now)
            if not (start.admissions or effects.outputs or start.pressure_events):
                break  # nothing changes until new work arrives
        t_next = min([d[0] for d in due] + ([end] if end is not None else []), default=None)
        if t_next is None:
            break
        now = t_next
    return tokens, events


def _event_rows(events):
    """(time, KvEvent) pairs as ``kv_artifacts.reference_kv_events`` tuples."""
    rows = []
    for at, e in events:
        if isinstance(e.data, Stored):
            for k, b in enumerate(e.data.blocks):
                rows.append((e.event_id, at, "stored", k, b.block_hash, e.data.parent_hash, b.tokens_hash))
        else:
            for k, h in enumerate(e.data.block_hashes):
                rows.append((e.event_id, at, "removed", k, h, None, None))
    return rows


def _driven(name):
    """The reference run ``name`` replayed by hand through one rank: (its tokens and
    KV events, the reference's tokens and KV events)."""
    setup, artifacts = artifact_case(name)
    workload = setup_workload(setup)  # a trace, or a synthetic session load
    tokens, events = drive_trace(Rank(setup.rank), workload)
    gold_tokens = reference_tokens(artifacts, workload)
    assert sum(map(len, gold_tokens.values())) > 0
    return tokens, _event_rows(events), gold_tokens, reference_kv_events(artifacts)


@pytest.mark.parametrize("name", lane(KV_CASES))
def test_a_rank_driven_by_hand_reproduces_the_references_tokens_and_kv_events(name):
    tokens, events, gold_tokens, gold_events = _driven(name)
    assert tokens == gold_tokens
    assert len(gold_events) > 0
    assert events == gold_events


# ---------------------------------------------------------------------------------
# engine acceptance scenarios (spec/engine.md section 13) on one rank
# ---------------------------------------------------------------------------------
def _rank(**fields):
    cfg = {"backend": "vllm", "block_size": 4, "enable_chunked_prefill": True}
    cfg.update(fields)
    return Rank(cfg)


def _req(rid, tokens, n_out=None, planned=None):
    return Submit(Request(rid, list(tokens), len(planned) if planned is not None else n_out, planned))


def _step(rank, now=None):
    """One pass started at ``now`` (default: the last pass end) and completed."""
    now = _step.clock.get(id(rank), 0.0) if now is None else now
    start = rank.start_pass(now)
    assert start is not None, "the rank had nothing to run"
    done = rank.complete_pass()
    _step.clock[id(rank)] = start.end_ms
    return start, done


_step.clock = {}


def test_synthetic_output_tokens_are_the_references():
    assert synthetic_output_tokens(1, 4).tolist() == [2515880452, 3600266899, 2716793611, 2249174135]
    assert synthetic_output_tokens(2, 1).tolist() == [1927195132]


def test_unified_pass_admits_both_and_emits_the_first_token_only():
    """13: capacity 6, budget 12, max_seqs 3, no prefix cache, two 8-token prompts."""
    rank = _rank(num_gpu_blocks=6, max_num_batched_tokens=12, max_num_seqs=3, enable_prefix_caching=False)
    rank.apply(_req(1, range(8), 2), 0.0)
    rank.apply(_req(2, range(8), 2), 0.0)
    start, done = _step(rank, 0.0)
    assert [a.request_id for a in start.admissions] == [1, 2]
    assert done.outputs == (Output(1, 2515880452, completed=False, cached_tokens=0),)
    assert done.metrics.running_requests == 2 and done.metrics.active_blocks == 3


def test_running_requests_go_first():
    """14: budget 4, two 8-token prompts: after two passes R1 emitted, R2 never ran."""
    rank = _rank(num_gpu_blocks=16, max_num_batched_tokens=4)
    rank.apply(_req(1, range(8), 4), 0.0)
    rank.apply(_req(2, range(100, 108), 4), 0.0)
    first, _ = _step(rank, 0.0)
    second, done = _step(rank)
    assert [a.request_id for a in first.admissions] == [1] and second.admissions == ()
    assert [o.request_id for o in done.outputs] == [1]
    assert done.metrics.waiting_requests == 1


def test_lifo_preemption_is_a_pressure_event():
    """15: capacity 6, budget 16, max_seqs 2, two 8-token prompts of 8 outputs."""
    rank = _rank(num_gpu_blocks=6, max_num_batched_tokens=16, max_num_seqs=2)
    rank.apply(_req(1, range(8), 8), 0.0)
    rank.apply(_req(2, range(100, 108), 8), 0.0)
    events = []
    for _ in range(6):
        start, done = _step(rank)
        events.extend((start.start_ms, e) for e in start.pressure_events)
        if events:
            break
    assert len(events) == 1
    at, e = events[0]
    assert e.kind == "vllm_preemption" and e.request_id == 2 and e.at_ms == at
    assert (e.state_before.running_requests, e.state_after.running_requests) == (2, 1)
    assert (e.state_before.waiting_requests, e.state_after.waiting_requests) == (0, 1)
    assert e.state_after.active_blocks < e.state_before.active_blocks
    assert e.request_active_blocks_before > 0
    assert e.logical_available_blocks_before is None and e.required_blocks_before is None
    assert done.metrics.preemptions_total == 1


def test_fifo_head_of_line_blocks_the_follower():
    """16: holder 16 tokens, blocked 12, follower 4 (one output each), capacity 6."""
    rank = _rank(num_gpu_blocks=6, max_num_batched_tokens=16, max_num_seqs=3)
    rank.apply(_req("holder", range(16), 1), 0.0)
    rank.apply(_req("blocked", range(100, 112), 1), 0.0)
    rank.apply(_req("follower", range(200, 204), 1), 0.0)
    start, done = _step(rank, 0.0)
    assert [a.request_id for a in start.admissions] == ["holder"] and start.pressure_events == ()
    assert [(o.request_id, o.completed) for o in done.outputs] == [("holder", True)]
    start, _ = _step(rank)
    assert [a.request_id for a in start.admissions][0] == "blocked"


def test_a_physically_impossible_prompt_is_rejected_and_the_follower_admitted():
    """17: capacity 4 blocks of 4, a 20-token prompt and a 4-token follower."""
    rank = _rank(num_gpu_blocks=4)
    rank.apply(_req("big", range(20), 2), 0.0)
    rank.apply(_req("small", range(100, 104), 2), 0.0)
    start, done = _step(rank, 0.0)
    assert [a.request_id for a in start.admissions] == ["small"] and start.pressure_events == ()
    assert done.outputs[-1] == Output("big", None, completed=True, rejected=True)


def test_max_model_len_rejects_long_prompts_and_stops_generation():
    """18: max_model_len 8: a 9-token prompt is rejected; a 7-token prompt with 4
    outputs emits one token, completed."""
    rank = _rank(num_gpu_blocks=64, max_model_len=8)
    rank.apply(_req("long", range(9), 1), 0.0)
    rank.apply(_req("short", range(100, 107), 4), 0.0)
    _, done = _step(rank, 0.0)
    by_id = {o.request_id: o for o in done.outputs}
    assert by_id["long"] == Output("long", None, completed=True, rejected=True)
    assert by_id["short"].token_id is not None and by_id["short"].completed


def test_zero_output_requests_end_without_a_token():
    """19: prompt 4, max_output 0: a terminal output, cached 0 then 4 on a repeat."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("a", range(4), 0), 0.0)
    _, done = _step(rank, 0.0)
    assert done.outputs == (Output("a", None, completed=True, cached_tokens=0),)
    assert done.metrics.active_blocks == 0 and done.forward_pass_metrics.num_decode_requests == 0
    rank.apply(_req("b", range(4), 0), 1.0)
    _, done = _step(rank, 1.0)
    assert done.outputs == (Output("b", None, completed=True, cached_tokens=4),)
    fpm = done.forward_pass_metrics
    assert fpm.num_prefill_requests == 0 and fpm.num_decode_requests == 0


def test_recompute_rule_reuses_all_but_the_last_block():
    """20: a repeated 8-token prompt reuses 4 tokens (its last block is recomputed)."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("seed", range(8), 1), 0.0)
    _step(rank, 0.0)
    rank.apply(_req("again", range(8), 1), 10.0)
    start, done = _step(rank, 10.0)
    assert start.admissions[0].reused_input_tokens == 4
    assert done.metrics.active_blocks == 0


def test_same_pass_reuse_stores_the_blocks_once():
    """21: two identical 8-token prompts in one pass: reused 0 then 4, one Stored."""
    rank = _rank(num_gpu_blocks=8, max_num_batched_tokens=16)
    rank.apply(_req(1, range(8), 4), 0.0)
    rank.apply(_req(2, range(8), 4), 0.0)
    start, done = _step(rank, 0.0)
    assert [(a.request_id, a.reused_input_tokens) for a in start.admissions] == [(1, 0), (2, 4)]
    assert done.metrics.active_blocks == 3
    stored = [e for e in done.kv_events if isinstance(e.data, Stored)]
    assert len(done.kv_events) == 1 and len(stored[0].data.blocks) == 2
    assert stored[0].data.parent_hash is None and stored[0].event_id == 0


def test_a_block_completed_by_generated_tokens_is_reused():
    """23: prompt [0,1,2] with planned [3,9]; after pass 1 a request [0..4] reuses 4."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("gen", [0, 1, 2], planned=[3, 9]), 0.0)
    _step(rank, 0.0)
    rank.apply(_req("probe", [0, 1, 2, 3, 4], 1), 1.0)
    start, done = _step(rank)
    assert [(a.request_id, a.reused_input_tokens) for a in start.admissions] == [("probe", 4)]
    assert len(done.kv_events) == 1 and isinstance(done.kv_events[0].data, Stored)


def test_sampled_tokens_are_allocated_when_computed():
    """24: capacity 4, two 4-token prompts: 2 blocks after pass 1, 4 after pass 2."""
    rank = _rank(num_gpu_blocks=4)
    rank.apply(_req(1, range(4), 3), 0.0)
    rank.apply(_req(2, range(100, 104), 3), 0.0)
    _, done = _step(rank, 0.0)
    assert done.metrics.active_blocks == 2
    start, done = _step(rank)
    assert done.metrics.active_blocks == 4 and start.pressure_events == ()


def test_a_finished_requests_tail_block_is_evicted_first():
    """25: capacity 2, an 8-token prompt with one output completes in one pass and
    keeps both blocks cached; a 1-block request evicts only its tail (one Removed
    event with that block's hash); a probe of its first 4 tokens still reuses 4."""
    rank = _rank(num_gpu_blocks=2)
    rank.apply(_req("seed", range(8), 1), 0.0)
    _, done = _step(rank, 0.0)
    assert done.outputs[0].completed and done.metrics.active_blocks == 0
    (stored,) = done.kv_events
    tail_hash = stored.data.blocks[1].block_hash
    rank.apply(_req("other", range(100, 104), 1), 100.0)
    _, done = _step(rank, 100.0)
    removed = [e.data for e in done.kv_events if isinstance(e.data, Removed)]
    assert removed == [Removed((tail_hash,))]
    rank.apply(_req("probe", [0, 1, 2, 3, 4], 1), 200.0)
    start, _ = _step(rank, 200.0)
    assert start.admissions[0].reused_input_tokens == 4


def test_a_prefix_evicted_in_the_same_pass_is_no_longer_a_hit():
    """22: capacity 3; a cached 4-token seed; an evictor of 12 tokens and a former
    hit of the seed's tokens in one pass: only the evictor is admitted, and the former
    hit is admitted later reusing nothing."""
    rank = _rank(num_gpu_blocks=3, max_num_batched_tokens=64)
    rank.apply(_req("seed", range(100, 104), 0), 0.0)
    _step(rank, 0.0)
    rank.apply(_req("evictor", range(12), 1), 10.0)
    rank.apply(_req("former_hit", range(100, 104), 1), 10.0)
    start, _ = _step(rank, 10.0)
    assert [a.request_id for a in start.admissions] == ["evictor"]
    start, _ = _step(rank)
    assert [(a.request_id, a.reused_input_tokens) for a in start.admissions] == [("former_hit", 0)]


def test_cached_tokens_ride_on_the_first_output_only():
    """26: a 9-token prompt cold reports 0 on its first output and None later; a
    repeat reports its two full blocks (8)."""
    rank = _rank(num_gpu_blocks=32)
    rank.apply(_req("cold", range(9), 3), 0.0)
    outputs = []
    for _ in range(3):
        outputs.extend(_step(rank)[1].outputs)
    assert [o.cached_tokens for o in outputs] == [0, None, None]
    rank.apply(_req("warm", range(9), 1), 100.0)
    _, done = _step(rank, 100.0)
    assert done.outputs[0].cached_tokens == 8


def test_planned_outputs_are_emitted_exactly():
    """27: prompt [1,2] with planned [101,202,303]."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("p", [1, 2], planned=[101, 202, 303]), 0.0)
    outputs = []
    for _ in range(3):
        outputs.extend(_step(rank)[1].outputs)
    assert [o.token_id for o in outputs] == [101, 202, 303]
    assert [o.completed for o in outputs] == [False, False, True]
    assert outputs[0].cached_tokens == 0


def test_a_chunked_prompt_prefills_over_two_passes():
    """28: a 16-token prompt with a budget of 8: two passes of 8 prefill tokens."""
    rank = _rank(num_gpu_blocks=16, max_num_batched_tokens=8)
    rank.apply(_req("c", range(16), 2), 0.0)
    first = _step(rank, 0.0)[1].forward_pass_metrics
    second = _step(rank)[1].forward_pass_metrics
    assert (first.sum_prefill_tokens, second.sum_prefill_tokens) == (8, 8)
    assert first.duration_ms > 0



# ---------------------------------------------------------------------------------
# cancellation: every request state, and a pass in flight
# ---------------------------------------------------------------------------------
def test_cancel_waiting_then_again():
    """39: a waiting request: Applied and retired, then Noop."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("w", range(8), 2), 0.0)
    first = rank.apply(CancelRequest("w"), 0.0)
    assert first.result == APPLIED and first.retired_requests == ("w",)
    assert first.metrics.waiting_requests == 0
    second = rank.apply(CancelRequest("w"), 0.0)
    assert second.result == NOOP and second.retired_requests == ()
    assert rank.start_pass(1.0) is None  # nothing left to run


def test_cancel_running_releases_its_kv():
    """39: a running request's KV goes back (vLLM active 0)."""
    rank = _rank(num_gpu_blocks=16)
    rank.apply(_req("r", range(8), 5), 0.0)
    _step(rank, 0.0)
    assert rank.metrics.active_blocks > 0
    effects = rank.apply(CancelRequest("r"), 50.0)
    assert effects.result == APPLIED and effects.metrics.active_blocks == 0
    assert effects.metrics.running_requests == 0


def test_cancel_a_preempted_request():
    rank = _rank(num_gpu_blocks=6, max_num_batched_tokens=16, max_num_seqs=2)
    rank.apply(_req(1, range(8), 8), 0.0)
    rank.apply(_req(2, range(100, 108), 8), 0.0)
    for _ in range(6):
        start, _ = _step(rank)
        if start.pressure_events:
            break
    victim = start.pressure_events[0].request_id
    effects = rank.apply(CancelRequest(victim), 1000.0)
    assert effects.result == APPLIED and effects.metrics.waiting_requests == 0


def test_cancel_during_a_pass_suppresses_its_pending_output():
    """38: an in-flight pass holds an output for R: CancelRequest removes it."""
    rank = _rank(num_gpu_blocks=8, max_num_seqs=2)
    rank.apply(_req("R", range(4), 3), 0.0)
    rank.start_pass(0.0)
    effects = rank.apply(CancelRequest("R"), 0.0)
    assert effects.result == APPLIED and effects.suppressed_pending_output
    assert effects.retired_requests == ("R",)
    assert rank.complete_pass().outputs == ()


def test_cancel_after_completion_in_the_pass_is_a_noop_unless_discarding():
    """38: R completed in the in-flight pass (one planned token): Noop keeps its
    output; discard_pending_output suppresses it (still Noop, R retired)."""
    for discard in (False, True):
        rank = _rank(num_gpu_blocks=8, max_num_seqs=2)
        rank.apply(_req("R", range(4), planned=[7]), 0.0)
        rank.start_pass(0.0)
        effects = rank.apply(CancelRequest("R", discard_pending_output=discard), 0.0)
        assert effects.result == NOOP
        assert effects.suppressed_pending_output is discard
        assert effects.retired_requests == (("R",) if discard else ())
        outputs = rank.complete_pass().outputs
        assert outputs == (() if discard else (Output("R", 7, completed=True, cached_tokens=0),))


def test_cancel_of_an_unknown_request_is_a_noop():
    rank = _rank(num_gpu_blocks=8)
    assert rank.apply(CancelRequest("nobody"), 0.0).result == NOOP


# ---------------------------------------------------------------------------------
# bad commands: an error, the rank unchanged
# ---------------------------------------------------------------------------------
def test_refused_commands_leave_the_rank_unchanged():
    rank = _rank(num_gpu_blocks=8)
    rank.apply(_req("a", range(4), 2), 0.0)
    before = rank.metrics
    with pytest.raises(RankError, match="already active"):
        rank.apply(_req("a", range(4), 2), 0.0)
    with pytest.raises(RankError, match="prompt is empty"):
        rank.apply(_req("b", [], 2), 0.0)
    with pytest.raises(RankError, match="max_output_tokens"):
        rank.apply(_req("c", range(4), -1), 0.0)
    with pytest.raises(RankError, match="token ids"):
        rank.apply(_req("d", [-5, 1], 1), 0.0)
    with pytest.raises(RankError, match="now_ms"):
        rank.apply(_req("e", range(4), 1), float("nan"))
    assert rank.metrics == before
    rank.start_pass(0.0)
    with pytest.raises(RankError, match="in flight"):
        rank.start_pass(1.0)
    rank.complete_pass()
    with pytest.raises(RankError, match="no pass in flight"):
        rank.complete_pass()


def test_a_finished_request_id_can_be_submitted_again():
    rank = _rank(num_gpu_blocks=8)
    rank.apply(_req("a", range(4), 1), 0.0)
    _step(rank, 0.0)
    assert rank.apply(_req("a", range(4), 1), 10.0).result == Submitted("a")


def test_a_rank_config_error_names_its_field():
    with pytest.raises(ValueError, match="backend"):
        Rank({"backend": "nope"})
    with pytest.raises(ValueError, match="worker_type"):
        Rank({"backend": "vllm", "worker_type": "router"})


# ---------------------------------------------------------------------------------
# SGLang ranks
# ---------------------------------------------------------------------------------
def _sglang(**fields):
    cfg = {"backend": "sglang", "num_gpu_blocks": 64}
    cfg.update(fields)
    return Rank(cfg)


def test_sglang_prefills_first():
    """40: R1 (4 prompt, 3 outputs) prefilled in pass 1; R2 arrives; pass 2 is R2's
    prefill only (R1 stalls, no decode); pass 3 decodes both."""
    rank = _sglang()
    rank.apply(_req("R1", range(4), 3), 0.0)
    _, done = _step(rank, 0.0)
    assert [o.request_id for o in done.outputs] == ["R1"]
    rank.apply(_req("R2", range(100, 104), 3), _step.clock[id(rank)])
    _, done = _step(rank)
    assert [o.request_id for o in done.outputs] == ["R2"]
    assert done.forward_pass_metrics.num_decode_requests == 0
    start, done = _step(rank)
    assert [o.request_id for o in done.outputs] == ["R1", "R2"]
    assert start.end_ms > start.start_ms
    assert all(o.cached_tokens is None for o in done.outputs)


def test_sglang_retracts_the_least_progressed_request():
    """41: two running requests outgrow the pool: the one with fewer generated
    tokens is retracted (an sglang_retraction pressure event)."""
    # a low admission reserve admits the second request beside the first one, and
    # both outgrow the 40-token pool
    rank = _sglang(num_gpu_blocks=40, sglang={"schedule_conservativeness": 0.1})
    rank.apply(_req("old", range(8), 16), 0.0)
    _step(rank, 0.0)
    rank.apply(_req("new", range(100, 108), 16), _step.clock[id(rank)])
    events = []
    for _ in range(20):
        if not rank.has_work:
            break
        start, _ = _step(rank)
        events.extend(start.pressure_events)
    assert events and events[0].kind == "sglang_retraction" and events[0].request_id == "new"
    assert events[0].logical_available_blocks_before is not None
    assert events[0].required_blocks_before is not None


def test_sglang_cancel_of_a_running_request_frees_its_pages():
    rank = _sglang(num_gpu_blocks=64)
    rank.apply(_req("r", range(8), 6), 0.0)
    _step(rank, 0.0)
    used = rank.metrics.active_blocks
    assert used > 0
    effects = rank.apply(CancelRequest("r"), 100.0)
    assert effects.result == APPLIED and effects.metrics.running_requests == 0
    # the cached prompt stays in the tree (evictable), the rest goes back
    assert effects.metrics.active_blocks <= used


# ---------------------------------------------------------------------------------
# the batch form
# ---------------------------------------------------------------------------------
def test_a_group_steps_its_ranks_as_single_ranks_would():
    configs = [{"backend": "vllm", "block_size": 4, "num_gpu_blocks": 16},
               {"backend": "trtllm", "block_size": 4, "num_gpu_blocks": 16},
               {"backend": "sglang", "num_gpu_blocks": 64}]
    group = RankGroup(configs)
    singles = [Rank(c) for c in configs]
    requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 7)), 3) for i in range(3)]
    group.submit([0, 1, 2], requests, 0.0)
    for rank, req in zip(singles, requests):
        rank.apply(Submit(req), 0.0)
    now = np.zeros(3)
    passes = 0
    while any(group.has_work(r) for r in range(3)):
        starts = group.start_passes([0, 1, 2], now)
        started = [r for r in range(3) if starts[r] is not None]
        done = dict(zip(started, group.complete_passes(started)))
        for i, rank in enumerate(singles):
            assert rank.start_pass(float(now[i])) == starts[i]
            if starts[i] is not None:
                assert rank.complete_pass() == done[i]
                now[i] = starts[i].end_ms
                passes += 1
    assert passes >= 9 and all(not rank.has_work for rank in singles)


# ---------------------------------------------------------------------------------
# prefill ranks: held sources
# ---------------------------------------------------------------------------------
def _prefill(**fields):
    return _rank(worker_type="prefill", **fields)


def test_a_prefill_rank_holds_the_source_until_released():
    """33: prefill rank, capacity 8, bs 4, max_seqs 1, prompt 0..7, 2 outputs: pass 1
    emits, pass 2 completes with one SourceHeld; the held KV (ceil(9/4) = 3 blocks)
    stays active until ReleaseSource (Applied, then Noop)."""
    rank = _prefill(num_gpu_blocks=8, max_num_seqs=1)
    assert rank.apply(SubmitHandoffPrefill("h1", Request("R", list(range(8)), 2)), 0.0).result == Submitted("R")
    _, done = _step(rank, 0.0)
    assert [o.completed for o in done.outputs] == [False] and done.lifecycle_events == ()
    _, done = _step(rank)
    assert [o.completed for o in done.outputs] == [True]
    (held,) = done.lifecycle_events
    assert isinstance(held, SourceHeld) and (held.handoff_id, held.request_id) == ("h1", "R")
    assert held.transfer_timing.full_prompt_tokens == 8
    assert done.metrics.running_requests == 0 and done.metrics.waiting_requests == 0
    assert done.metrics.active_blocks == 3 and not rank.has_work
    released = rank.apply(ReleaseSource("h1"), 100.0)
    assert released.result == APPLIED and released.retired_requests == ("R",)
    assert released.metrics.active_blocks == 0
    assert rank.apply(ReleaseSource("h1"), 100.0).result == NOOP


def test_cancel_source_of_a_held_and_of_a_pending_source():
    """33: CancelSource releases a held source like ReleaseSource; on a pending
    source it drops the request (Applied, then Noop)."""
    rank = _prefill(num_gpu_blocks=8, max_num_seqs=1)
    rank.apply(SubmitHandoffPrefill("h1", Request("R", list(range(8)), 1)), 0.0)
    _, done = _step(rank, 0.0)
    assert len(done.lifecycle_events) == 1 and done.metrics.active_blocks == 2
    assert rank.apply(CancelSource("h1"), 50.0).result == APPLIED
    assert rank.metrics.active_blocks == 0
    rank.apply(SubmitHandoffPrefill("h2", Request("P", list(range(100, 108)), 1)), 60.0)
    effects = rank.apply(CancelSource("h2"), 60.0)
    assert effects.result == APPLIED and effects.retired_requests == ("P",)
    assert effects.metrics.waiting_requests == 0
    assert rank.apply(CancelSource("h2"), 60.0).result == NOOP


def test_release_of_a_pending_source_makes_it_an_ordinary_request():
    rank = _prefill(num_gpu_blocks=8, max_num_seqs=1)
    rank.apply(SubmitHandoffPrefill("h1", Request("R", list(range(8)), 1)), 0.0)
    assert rank.apply(ReleaseSource("h1"), 0.0).result == APPLIED
    _, done = _step(rank, 0.0)
    assert done.lifecycle_events == () and done.outputs[0].completed
    assert done.metrics.active_blocks == 0  # finished: its blocks are cached, not held


def test_a_prefill_source_reports_its_transfer_delay():
    """4: prefill rank, bs 4, prompt 8, one output, 1 GB/s and 1e6 bytes per token: the
    single pass completes the token and SourceHeld's full-prompt delay is 8.0 ms."""
    rank = _prefill(num_gpu_blocks=16, kv_transfer_bandwidth=1.0, kv_transfer_bytes_per_token=1_000_000)
    rank.apply(SubmitHandoffPrefill("h", Request("R", list(range(8)), 1)), 0.0)
    _, done = _step(rank, 0.0)
    assert done.outputs[0].completed
    assert done.lifecycle_events[0].transfer_timing.full_prompt_delay_ms() == pytest.approx(8.0)


def test_a_prefill_rank_refuses_plain_submits_and_duplicate_handoffs():
    rank = _prefill(num_gpu_blocks=8)
    with pytest.raises(RankError, match="prefill rank"):
        rank.apply(_req("a", range(4), 1), 0.0)
    rank.apply(SubmitHandoffPrefill("h", Request("a", list(range(4)), 1)), 0.0)
    with pytest.raises(RankError, match="handoff h is already active"):
        rank.apply(SubmitHandoffPrefill("h", Request("b", list(range(4)), 1)), 0.0)
    with pytest.raises(RankError, match="not a prefill rank"):
        _rank(num_gpu_blocks=8).apply(SubmitHandoffPrefill("h", Request("a", list(range(4)), 1)), 0.0)


# ---------------------------------------------------------------------------------
# decode ranks: destinations
# ---------------------------------------------------------------------------------
def _decode(**fields):
    return _rank(worker_type="decode", **fields)


def _reserve(rank, h, tokens, n_out, now=0.0):
    return rank.apply(ReserveDestination(h, Request(h, list(tokens), n_out)), now)


def test_transferable_prompt_tokens_count_the_fresh_blocks():
    """34: bs 4, a 10-token prompt on a cold rank -> 12 (block-rounded, headroom
    excluded) for 1 and for 128 outputs; after activating a 4-token prompt, a second
    destination with that prompt reports 0 and shares its block (active 1)."""
    for n_out in (1, 128):
        effects = _reserve(_decode(num_gpu_blocks=64), "x", range(10), n_out)
        assert effects.result == DestinationAccepted("x")
        assert effects.lifecycle_events == (DestinationReserved("x", "x", 12),)
    rank = _decode(num_gpu_blocks=64)
    assert _reserve(rank, "a", range(4), 5).lifecycle_events == (DestinationReserved("a", "a", 4),)
    activated = rank.apply(ActivateDestination("a"), 0.0)
    assert activated.result == APPLIED and len(activated.kv_events) == 1  # its block is visible now
    assert isinstance(activated.kv_events[0].data, Stored)
    assert _reserve(rank, "b", range(4), 5).lifecycle_events == (DestinationReserved("b", "b", 0),)
    assert rank.metrics.active_blocks == 1


def test_the_pending_head_is_retried_when_capacity_returns():
    """35: a 2-block rank: the first 8-token destination is reserved at once, the second
    waits (no lifecycle event); CancelDestination of the first reserves the second in
    its own effects; without a capacity change a retry attempts nothing."""
    rank = _decode(num_gpu_blocks=2)
    assert _reserve(rank, "a", range(8), 3).lifecycle_events == (DestinationReserved("a", "a", 8),)
    second = _reserve(rank, "b", range(100, 108), 3)
    assert second.result == DestinationAccepted("b") and second.lifecycle_events == ()
    assert rank.apply(ActivateDestination("b"), 1.0).result == NOOP  # only a reserved one activates
    canceled = rank.apply(CancelDestination("a"), 1.0)
    assert canceled.result == APPLIED and canceled.retired_requests == ("a",)
    assert canceled.lifecycle_events == (DestinationReserved("b", "b", 8),)
    assert rank.apply(CancelDestination("a"), 1.0).result == NOOP


def test_a_pending_destination_blocks_fresh_work():
    """36 on a decode rank: with a destination pending, the activated owner is admitted
    (reused 0, cached_tokens 0, a decode item of its first pass) and the pending
    blocker can still be cancelled afterwards."""
    rank = _decode(num_gpu_blocks=4)
    _reserve(rank, "owner", range(8), 2)
    assert _reserve(rank, "blocker", range(200, 216), 2).lifecycle_events == ()  # no room: pending
    rank.apply(ActivateDestination("owner"), 0.0)
    start, done = _step(rank, 0.0)
    assert [a.request_id for a in start.admissions] == ["owner"]
    assert start.admissions[0].reused_input_tokens == 0 and done.outputs[0].cached_tokens == 0
    assert done.forward_pass_metrics.num_prefill_requests == 0  # it decodes at once
    _step(rank)  # the owner completes; its blocks stay cached
    assert rank.apply(CancelDestination("blocker"), 100.0).result == APPLIED


def test_a_destination_reserved_while_a_pass_runs_is_reported_at_its_completion():
    """A ReserveDestination during a pass only queues (engine.md 10.2 step 1); the
    completion retries the head and carries its DestinationReserved after the pass's
    own lifecycle events; an activation during a pass shows its KV events at the end."""
    rank = _decode(num_gpu_blocks=64)
    _reserve(rank, "a", range(8), 3)
    rank.apply(ActivateDestination("a"), 0.0)
    start = rank.start_pass(0.0)
    during = _reserve(rank, "b", range(50, 58), 3, now=1.0)
    assert during.result == DestinationAccepted("b") and during.lifecycle_events == ()
    done = rank.complete_pass()
    assert done.lifecycle_events == (DestinationReserved("b", "b", 8),)
    start = rank.start_pass(start.end_ms)
    activated = rank.apply(ActivateDestination("b"), start.start_ms + 0.5)
    assert activated.result == APPLIED and activated.kv_events == ()  # buffered until the pass ends
    done = rank.complete_pass()
    assert any(isinstance(e.data, Stored) for e in done.kv_events)


def test_cancel_destination_in_every_state():
    """Pending -> removed, reserved -> given back, activated (waiting) and running ->
    dropped with its KV; each Applied once, retired, then Noop. CancelRequest drops an
    active destination too but not a pending or reserved one."""
    rank = _decode(num_gpu_blocks=4)
    _reserve(rank, "reserved", range(8), 2)                 # 2 blocks
    _reserve(rank, "pending", range(300, 316), 2)           # 4 blocks: waits
    assert rank.apply(CancelRequest("pending"), 0.0).result == NOOP
    assert rank.apply(CancelRequest("reserved"), 0.0).result == NOOP
    assert rank.apply(CancelDestination("pending"), 0.0).retired_requests == ("pending",)
    assert rank.metrics.active_blocks == 2
    assert rank.apply(CancelDestination("reserved"), 0.0).result == APPLIED
    assert rank.metrics.active_blocks == 0
    _reserve(rank, "waiting", range(8), 2)
    rank.apply(ActivateDestination("waiting"), 0.0)
    effects = rank.apply(CancelRequest("waiting"), 0.0)
    assert effects.result == APPLIED and rank.metrics.active_blocks == 0 and not rank.has_work
    _reserve(rank, "running", range(8), 4)
    rank.apply(ActivateDestination("running"), 0.0)
    _step(rank, 0.0)
    assert rank.metrics.running_requests == 1
    assert rank.apply(CancelDestination("running"), 50.0).result == APPLIED
    assert rank.metrics.active_blocks == 0 and rank.metrics.running_requests == 0
    for h in ("pending", "reserved", "waiting", "running"):
        assert rank.apply(CancelDestination(h), 60.0).result == NOOP


def test_a_decode_rank_refuses_what_it_cannot_take_and_stays_unchanged():
    rank = _decode(num_gpu_blocks=4)
    _reserve(rank, "a", range(8), 2)
    before = rank.metrics
    with pytest.raises(RankError, match="needs more KV blocks than rank 0 has"):
        _reserve(rank, "huge", range(20), 1)  # 5 blocks on a 4-block rank
    with pytest.raises(RankError, match="handoff a is already active"):
        rank.apply(ReserveDestination("a", Request("other", [1, 2], 1)), 0.0)
    with pytest.raises(RankError, match="decode rank: it takes ReserveDestination"):
        rank.apply(_req("plain", range(4), 1), 0.0)
    with pytest.raises(RankError, match="not a decode rank"):
        _rank(num_gpu_blocks=8).apply(ReserveDestination("h", Request("x", [1], 1)), 0.0)
    assert rank.metrics == before
    assert rank.apply(ActivateDestination("huge"), 0.0).result == NOOP
    assert rank.apply(ActivateDestination("a"), 0.0).result == APPLIED


def test_an_sglang_rank_reports_its_kv_facts_at_report_passes_only():
    """One-token pages: the prefill's insert is reported with its pass (a prefill
    batch reports), the first decode pass reports nothing, and the last one, after
    which nothing runs, reports the finished request's insert."""
    rank = _sglang()
    assert rank.group.kv_events
    assert not rank.apply(_req("R1", range(6), 3), 0.0).kv_events
    done = [d for _ in range(3) for _, d in [_step(rank)]]
    assert done[-1].outputs[-1].completed
    stored = [[len(e.data.blocks) for e in d.kv_events if isinstance(e.data, Stored)] for d in done]
    assert stored[0] and not stored[1] and stored[2]
    assert [e.event_id for d in done for e in d.kv_events] == list(range(sum(map(len, stored))))


def test_an_sglang_prefill_rank_holds_its_pages_until_released():
    """SGLang prefill rank: the prefill's pass completes with SourceHeld; the held
    pages stay in use until ReleaseSource, which puts the prompt's pages in the tree
    (a later prompt with that prefix reuses them)."""
    rank = _sglang(worker_type="prefill", block_size=4)
    rank.apply(SubmitHandoffPrefill("h", Request("R", list(range(8)), 1)), 0.0)
    _, done = _step(rank, 0.0)
    (held,) = done.lifecycle_events
    assert isinstance(held, SourceHeld) and held.handoff_id == "h" and done.outputs[0].completed
    in_use = rank.metrics.active_blocks
    assert in_use >= 2 and not rank.has_work
    released = rank.apply(ReleaseSource("h"), 10.0)
    assert released.result == APPLIED and released.retired_requests == ("R",)
    rank.apply(SubmitHandoffPrefill("h2", Request("S", list(range(8)) + [99], 1)), 20.0)
    start, _ = _step(rank, 20.0)
    assert start.admissions[0].reused_input_tokens == 8
    assert rank.apply(CancelSource("h2"), 30.0).result == APPLIED  # held: released like ReleaseSource


def test_an_sglang_decode_rank_reserves_activates_and_cancels():
    """34 (SGLang): a destination whose first page is already in the decode rank's
    tree reserves only the rest (transferable 4 of a page-rounded 8); a reserved and
    an activated (not yet promoted) destination give their pages back on
    CancelDestination; an activated one is promoted by the next pass, reusing nothing."""
    rank = _sglang(worker_type="decode", block_size=4)
    assert _reserve(rank, "a", range(4), 2).lifecycle_events == (DestinationReserved("a", "a", 4),)
    assert rank.apply(ActivateDestination("a"), 0.0).result == APPLIED
    assert rank.has_work  # the ready list
    start, _ = _step(rank, 0.0)
    assert [(a.request_id, a.reused_input_tokens) for a in start.admissions] == [("a", 0)]
    while rank.has_work:
        _step(rank)
    idle = rank.metrics.active_blocks
    assert _reserve(rank, "b", range(8), 2, now=100.0).lifecycle_events == (DestinationReserved("b", "b", 4),)
    assert rank.metrics.active_blocks > idle
    assert rank.apply(CancelDestination("b"), 100.0).result == APPLIED
    assert rank.metrics.active_blocks == idle
    _reserve(rank, "c", range(50, 58), 2, now=100.0)
    rank.apply(ActivateDestination("c"), 100.0)
    assert rank.apply(CancelDestination("c"), 100.0).retired_requests == ("c",)
    assert rank.metrics.active_blocks == idle and not rank.has_work
    assert rank.apply(CancelDestination("c"), 100.0).result == NOOP


@pytest.mark.parametrize("name", lane(SGLANG_KV_CASES))
def test_an_sglang_rank_driven_by_hand_reproduces_the_references_tokens_and_kv_events(name):
    """The reference's SGLang runs with per-token artifacts (pages of 1, 4 and 16,
    retractions, idle gaps): every output token id and time, and every KV event as the
    reference reports it (at the completion of a pass that prefills, of every 40th
    pass without a prefill batch and of a pass after which nothing runs)."""
    tokens, events, gold_tokens, gold_events = _driven(name)
    assert tokens == gold_tokens
    assert len(gold_events) > 0
    assert events == gold_events


# ---------------------------------------------------------------------------------
# random command sequences on prefill and decode ranks
# ---------------------------------------------------------------------------------
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.random_cases import SETTINGS, examples  # noqa: E402

_COMMANDS = st.lists(st.tuples(st.sampled_from(["reserve", "flow", "flow", "activate", "cancel",
                                                "cancel_request", "pass", "pass", "pass"]),
                               st.integers(0, 3), st.integers(1, 40), st.integers(1, 6)),
                     min_size=1, max_size=40)


@settings(max_examples=examples(60), **SETTINGS)
@given(backend=st.sampled_from(["vllm", "trtllm", "sglang"]), blocks=st.integers(4, 40), commands=_COMMANDS)
def test_a_decode_rank_survives_any_command_sequence_and_drains_clean(backend, blocks, commands):
    """Any sequence of destination commands and passes on a small decode rank: only
    RankError for refused commands, never negative occupancy; afterwards, with the
    active destinations run to completion and the rest cancelled, nothing is queued
    and the whole pool can be reserved at once."""
    cfg = {"backend": backend, "block_size": 4, "worker_type": "decode", "max_num_seqs": 3,
           "num_gpu_blocks": blocks * 4 if backend == "sglang" else blocks}
    rank = Rank(cfg)
    now = 0.0
    live: dict = {}  # handoff -> its request (ids differ per reservation)

    def finished(outputs):
        done = {o.request_id for o in outputs if o.completed}
        if done:
            event(f"{backend}: a destination ran to completion")
        for handoff in [h for h, rid in live.items() if rid in done]:
            del live[handoff]

    for k, (kind, h, prompt, n_out) in enumerate(commands):
        handoff = f"h{h}"
        if kind in ("reserve", "flow"):  # flow: reserve, then activate at once
            rid = f"{handoff}#{k}"
            try:
                rank.apply(ReserveDestination(handoff, Request(rid, list(range(h * 100, h * 100 + prompt)),
                                                               n_out)), now)
                live[handoff] = rid
            except RankError:
                pass
            if kind == "flow":
                rank.apply(ActivateDestination(handoff), now)
        elif kind == "activate":
            rank.apply(ActivateDestination(handoff), now)
        elif kind == "cancel":
            rank.apply(CancelDestination(handoff), now)
            live.pop(handoff, None)
        elif kind == "cancel_request":
            if handoff in live and rank.apply(CancelRequest(live[handoff]), now).result == APPLIED:
                del live[handoff]
        elif rank.pass_in_flight:
            finished(rank.complete_pass().outputs)
        elif rank.has_work:
            now = rank.start_pass(now).end_ms
        assert rank.metrics.active_blocks >= 0
    if rank.pass_in_flight:
        finished(rank.complete_pass().outputs)

    def run_dry(now):  # activated and running destinations run to completion
        for _ in range(1000):
            if not rank.has_work:
                break
            now = rank.start_pass(now).end_ms
            finished(rank.complete_pass().outputs)
        return now

    now = run_dry(now)
    for handoff in sorted(live):  # pending or reserved
        rank.apply(CancelDestination(handoff), now)
    now = run_dry(now)
    metrics = rank.metrics
    assert not rank.has_work
    assert metrics.running_requests == 0 and metrics.waiting_requests == 0, metrics
    if backend != "sglang":  # SGLang counts its (evictable) radix pages as active
        assert metrics.active_blocks == 0, metrics
    # nothing is held: a destination of the whole pool (TRT-LLM: less the block its
    # output needs) is reserved at once
    whole = Request("whole", list(range(10_000, 10_000 + 4 * (blocks - 1))), 1)
    assert rank.apply(ReserveDestination("whole", whole), now).lifecycle_events[0].transferable_prompt_tokens > 0


_SOURCE_COMMANDS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "release", "cancel_source",
                                                       "cancel_request", "pass", "pass", "pass"]),
                                      st.integers(0, 3), st.integers(1, 40)),
                            min_size=1, max_size=40)


@settings(max_examples=examples(60), **SETTINGS)
@given(backend=st.sampled_from(["vllm", "trtllm", "sglang"]), blocks=st.integers(4, 40),
       commands=_SOURCE_COMMANDS)
def test_a_prefill_rank_survives_any_command_sequence_and_drains_clean(backend, blocks, commands):
    """Any sequence of SubmitHandoffPrefill, Release / CancelSource, CancelRequest and
    passes on a small prefill rank: only RankError for refused commands; afterwards,
    with every source released and the rank run dry, nothing is queued and (vLLM /
    TRT-LLM) no block is active."""
    cfg = {"backend": backend, "block_size": 4, "worker_type": "prefill", "max_num_seqs": 3,
           "num_gpu_blocks": blocks * 4 if backend == "sglang" else blocks}
    rank = Rank(cfg)
    now = 0.0
    sources: dict = {}  # handoff -> its request, submitted and not yet released or dropped
    submitted = set()   # every (handoff, request) ever accepted

    def completed(done):
        for held in done.lifecycle_events:
            # (a source released while the pass that holds it was in flight still
            # reports SourceHeld: only a cancel suppresses it, engine.md 11)
            event(f"{backend}: a source was held")
            assert isinstance(held, SourceHeld) and (held.handoff_id, held.request_id) in submitted
        for o in done.outputs:  # a rejected prompt ends its handoff
            for h in [h for h, rid in sources.items() if o.rejected and rid == o.request_id]:
                del sources[h]

    for k, (kind, h, prompt) in enumerate(commands):
        handoff = f"h{h}"
        if kind == "submit":
            rid = f"{handoff}#{k}"
            try:
                rank.apply(SubmitHandoffPrefill(handoff, Request(rid, list(range(h * 100, h * 100 + prompt)), 1)),
                           now)
                sources[handoff] = rid
                submitted.add((handoff, rid))
            except RankError:
                pass
        elif kind in ("release", "cancel_source"):
            command = ReleaseSource(handoff) if kind == "release" else CancelSource(handoff)
            result = rank.apply(command, now).result
            # Noop for an unknown handoff; also for a source rejected by the pass in
            # flight (not owned by the queues any more, its output not yet released)
            assert result == NOOP or handoff in sources
            sources.pop(handoff, None)
        elif kind == "cancel_request":
            if handoff in sources and rank.apply(CancelRequest(sources[handoff]), now).result == APPLIED:
                del sources[handoff]
        elif rank.pass_in_flight:
            completed(rank.complete_pass())
        elif rank.has_work:
            now = rank.start_pass(now).end_ms
    if rank.pass_in_flight:
        completed(rank.complete_pass())
    for handoff in sorted(sources):
        assert rank.apply(ReleaseSource(handoff), now).result == APPLIED
    for _ in range(1000):  # released while pending: they finish as ordinary requests
        if not rank.has_work:
            break
        now = rank.start_pass(now).end_ms
        rank.complete_pass()
    metrics = rank.metrics
    assert not rank.has_work
    assert metrics.running_requests == 0 and metrics.waiting_requests == 0, metrics
    if backend != "sglang":  # SGLang counts its (evictable) radix pages as active
        assert metrics.active_blocks == 0, metrics
