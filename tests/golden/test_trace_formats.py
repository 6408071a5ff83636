"""Trace formats beyond plain Mooncake (``trace.formats``) against reference runs
(tests/data/golden_trace_formats), and the history a delta trace builds against a
plain-Python oracle.

``applied_compute_agentic``: the CLI's payload (6 agents under concurrency 3), the
same without a cap (the reference then replays every session from 0), sped up 2x,
with max_model_len 1100 (turns rejected: their prompts still grow); 30 agents of 0-6
tool calls (a blank line shifting the session names) on two vLLM workers over 700
KV blocks under concurrency 8, and on two SGLang workers with 16-token trace blocks.
``dynamo`` (request records without agent_context): the CLI's payload, and a trace in
two files (plain and gzip, shuffled, wrapped and bare events, skipped kinds, rows
without a received time) on vLLM and, files swapped and 3x faster, TRT-LLM.

``mooncake-delta``: the sessions trace (200 rows, 49 sessions of 2-6 turns) read as
rows of new input on two vLLM workers, in closed loop (6 sessions), with
``max_model_len`` 6000 (turns cut short and rejected, so later histories are shorter),
over 400 KV blocks (preemption), on SGLang, TRT-LLM and disaggregated vLLM 1P2D; and a
hand-made trace of nine rows (interleaved sessions, a row of its own, a blank line,
delays given and inferred, authored output ids in a history); and the payload the
reference's CLI writes for a delta config (8 sessions x 3 turns), which the config
lowers to here too; turns the KV pool rejects outright (TRT-LLM, 300 blocks of 32: 53
of 200 turns, their output missing from the next turn's history; vLLM, 200 blocks of
16, a case of the differential, seed 102). Every request's
timeline must be bit-exact and the report's counts and means equal.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from aisim_fast.config.payload import ConfigError, parse_payload, parse_rank
from aisim_fast.config.predict_config import read_predict_config
from aisim_fast.trace.formats import TRACE_FORMATS, load_trace
from aisim_fast.engine.output_budget import emitted_outright
from aisim_fast.trace.session_history import HistoryWarning, emitted_lengths, warn_unfit_turns
from aisim_fast.trace.workload import TraceError, load_mooncake, prompt_tokens, sequence_tokens
from support import goldens
from support.cli_runs import run_cli
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_trace_formats"
CASES = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json"))
REPORT_KEYS = ("num_requests", "completed_requests", "duration_ms", "mean_ttft_ms", "mean_e2e_latency_ms",
               "committed_prefill_tokens", "first_admission_prefix_cache_reused_ratio", "total_output_tokens")


def trace_flags(case: str) -> list:
    """``--trace`` for a trace of tests/data/traces; none for traces beside the spec
    (its relative paths find them, every file of a multi-file trace)."""
    name = json.loads((GOLDEN / f"{case}.spec.json").read_text())["traffic"]["trace_path"]
    return [] if (GOLDEN / name).exists() else ["--trace", DATA_DIR / "traces" / name]


def test_cases_present():
    assert CASES == ["applied_30_sglang_agg2_conc6", "applied_30_vllm_agg2_conc8", "applied_cli_6",
                     "applied_no_cap_speedup2_mml1100", "delta_cli_8x3", "delta_edges_vllm_agg1", "delta_sglang_agg2", "delta_trtllm_agg2",
                     "delta_trtllm_agg2_pool300", "delta_vllm_agg2", "delta_vllm_agg2_conc6", "delta_vllm_agg2_kv400",
                     "delta_vllm_agg2_mml6000", "delta_vllm_disagg1p2d_bw", "delta_vllm_pool_rejects",
                     "dynamo_cli_std", "dynamo_two_files_trtllm_speedup3", "dynamo_two_files_vllm_agg2"]


@pytest.mark.parametrize("case", CASES)
def test_requests_and_report_match_the_reference(case, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", "--spec", GOLDEN / f"{case}.spec.json", *trace_flags(case),
                            "--out", out, "--quiet"], capsys)
    assert code == 0, err
    gold = goldens.read_golden(case, GOLDEN)
    cand = goldens.index_frame(pd.read_parquet(out / "requests.parquet"))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    assert not timeline_differences(gold, cand)
    assert len(cand) == len(gold)
    summary = json.loads((out / "summary.json").read_text())
    report = json.loads((GOLDEN / f"{case}.report.json").read_text())
    for key in REPORT_KEYS:
        assert math.isclose(summary[key], report[key], rel_tol=1e-9, abs_tol=1e-9), key


@pytest.mark.parametrize("case", ["delta_cli_8x3", "applied_cli_6", "dynamo_cli_std"])
def test_predict_config_lowers_to_the_captured_payload(case):
    mine = read_predict_config(GOLDEN / f"{case}.predict.yaml")
    captured = json.loads((GOLDEN / f"{case}.spec.json").read_text())
    assert mine["spec"] == captured["spec"]
    assert mine["traffic"] == captured["traffic"]


def test_predict_config_refuses_delta_for_disaggregated_engines(tmp_path):
    """The reference's CLI: 'mooncake-delta requires aggregated engine mode'."""
    text = (GOLDEN / "delta_cli_8x3.predict.yaml").read_text().replace("mode: aggregated", "mode: disaggregated")
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match="traffic.source.format: mooncake-delta requires aggregated"):
        read_predict_config(tmp_path / "c.yaml")


def rule(**rank):
    """A rank's emitted-outright rule (``engine.output_budget.emitted_outright``)."""
    parsed = parse_rank({"backend": "vllm", **rank}, "rank")
    return lambda prompt, out: emitted_outright(parsed, prompt, out)


def oracle_prompts(path, block: int, max_model_len: int | None = None) -> list[list[int]]:
    """Plain Python: each turn's prompt is its session's earlier turns (new input, then
    the output tokens they emit) and its own new input; a turn emits its output cut at
    max_model_len, none when its prompt reaches it (no KV pool rule here)."""
    w = load_mooncake(path, trace_block_size=block)
    history: dict[int, list[int]] = {}
    prompts = []
    for q in range(w.num_requests):
        s = int(w.session[q])
        prompt = history.get(s, []) + prompt_tokens(w, q).tolist()
        out = int(w.output_len[q])
        if max_model_len is not None:
            out = 0 if len(prompt) >= max_model_len else min(out, max_model_len - len(prompt))
        history[s] = prompt + sequence_tokens(w, q, int(w.input_len[q]), out).tolist()
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("max_model_len", [None, 120, 4000])
@pytest.mark.parametrize("trace,block", [(GOLDEN / "delta_edges.jsonl", 16),
                                         (DATA_DIR / "traces" / "sessions_200.jsonl", 512)])
def test_delta_prompts_are_the_oracles(trace, block, max_model_len):
    w = load_trace(trace, "mooncake-delta", trace_block_size=block,
                   emits=None if max_model_len is None else rule(max_model_len=max_model_len))
    want = oracle_prompts(trace, block, max_model_len)
    assert w.trace_block_size == 1 and w.num_requests == len(want)
    for q, prompt in enumerate(want):
        assert w.input_len[q] == len(prompt)
        assert prompt_tokens(w, q).tolist() == prompt, q
    # the rows keep their outputs, sessions, arrivals and plan
    plain = load_mooncake(trace, trace_block_size=block)
    for name in ("session", "turn_index", "output_len", "delay_ms", "line_no"):
        assert np.array_equal(getattr(w, name), getattr(plain, name)), name
    assert np.array_equal(w.output_plan()[0], plain.output_plan()[0])


def test_a_turn_carries_only_the_output_it_emits():
    """max_model_len 120: session a's second turn (68-token prompt, 5 authored outputs)
    emits all five; its third (106 tokens) only 4 of 4; session b's third turn (95 + 30)
    stops at 25 tokens, and nothing follows it."""
    w = load_mooncake(GOLDEN / "delta_edges.jsonl", trace_block_size=16)
    emitted = emitted_lengths(w, rule(max_model_len=120))
    assert emitted.tolist() == [12, 6, 5, 3, 8, 4, 17, 2, 25]
    assert emitted_lengths(w, None).tolist() == w.output_len.tolist()
    # a prompt at the limit is rejected: nothing
    assert emitted_lengths(w, rule(max_model_len=40))[0] == 0


def test_a_turn_the_pool_rejects_adds_no_output():
    """Pools of 5 blocks of 16 (80 tokens). vLLM rejects a fresh prompt of more blocks
    than the pool: session a's second turn (68 tokens) runs, b's (86) does not, so b's
    third turn's history lacks its output. TRT-LLM clamps a fitting prompt's output to
    the pool (c's first turn: 64 + 16 of its 17 tokens) and rejects one whose prompt and
    budget cannot fit."""
    w = load_mooncake(GOLDEN / "delta_edges.jsonl", trace_block_size=16)
    assert emitted_lengths(w, rule(block_size=16, num_gpu_blocks=5)).tolist() == [12, 6, 5, 3, 0, 0, 17, 0, 0]
    trt = rule(backend="trtllm", block_size=16, num_gpu_blocks=5)
    assert emitted_lengths(w, trt).tolist() == [12, 6, 5, 3, 0, 0, 16, 0, 0]
    roomy = emitted_lengths(w, rule(block_size=16, num_gpu_blocks=10_000)).tolist()
    assert roomy == w.output_len.tolist()


def test_a_turn_beyond_the_pool_is_warned_of():
    w = load_trace(GOLDEN / "delta_edges.jsonl", "mooncake-delta", trace_block_size=16)
    with pytest.warns(HistoryWarning, match=r"delta_edges.jsonl:1: turn 0 of session 'a'"):
        warn_unfit_turns(w, 48)
    warn_unfit_turns(w, 10_000)  # nothing to say


def test_unknown_format_names_the_allowed_ones():
    payload = json.loads((GOLDEN / "delta_vllm_agg2.spec.json").read_text())
    payload["traffic"]["trace_format"] = "mooncake-deltas"
    with pytest.raises(ConfigError, match="traffic.trace_format.*mooncake-delta"):
        parse_payload(payload, GOLDEN)
    assert TRACE_FORMATS[:2] == ("mooncake", "mooncake-delta")


def test_applied_rows_become_growing_sessions():
    """Row 1 of the CLI's trace (800 / [30, 40] / [200, 150] / [0.2, 0.1] s / 50): turns
    of 800, 1030 and 1220 prompt tokens generating 30, 40 and 50, 200 and 100 ms apart;
    each turn's prompt extends the last one's token for token (ids of the session's
    own run, each 64 tokens); the next agent's ids follow."""
    w = load_trace(GOLDEN / "applied_compute_6.jsonl", "applied_compute_agentic", trace_block_size=64)
    assert w.num_requests == 18 and w.num_sessions == 6
    assert w.input_len[:3].tolist() == [800, 1030, 1220] and w.output_len[:3].tolist() == [30, 40, 50]
    assert w.delay_ms[:3].tolist() == [0.0, 200.0, 100.0]
    assert w.request_name[0] == "applied_compute_agentic_session_1" and w.turn_index[:3].tolist() == [0, 1, 2]
    p0, p1, p2 = (prompt_tokens(w, q) for q in range(3))
    assert (p1[:800] == p0).all() and (p2[:1030] == p1).all()
    assert p2[-1] == 19 and prompt_tokens(w, 3)[0] == 20  # ceil(1220 / 64) = 20 ids, then the next agent


def test_dynamo_records_lower_to_the_mooncake_rows_the_reference_makes():
    """dynamo_std.jsonl is the reference's mooncake trace dynamo_std_as_mooncake.jsonl:
    the same rows (arrivals, lengths, prompts), named request_1.. in start order."""
    w = load_trace(GOLDEN / "dynamo_std.jsonl", "dynamo")
    m = load_mooncake(GOLDEN / "dynamo_std_as_mooncake.jsonl", trace_block_size=64)
    assert w.trace_block_size == 64 and list(w.request_name[:2]) == ["request_1", "request_2"]
    assert w.start_ms.tolist() == [120.0 * k for k in range(10)]
    for name in ("input_len", "output_len", "start_ms", "hash_ids", "hash_indptr"):
        assert np.array_equal(getattr(w, name), getattr(m, name)), name
    two = load_trace(GOLDEN / "dynamo_part_a.jsonl", "dynamo", more_paths=[GOLDEN / "dynamo_part_b.jsonl.gz"])
    swapped = load_trace(GOLDEN / "dynamo_part_b.jsonl.gz", "dynamo", more_paths=[GOLDEN / "dynamo_part_a.jsonl"])
    assert two.num_requests == 40 and np.array_equal(two.start_ms, swapped.start_ms)
    assert np.array_equal(two.hash_ids, swapped.hash_ids)


@pytest.mark.parametrize("fmt,text,words", [
    ("applied_compute_agentic", '{"num_turns": 1, "input_prompt_length": 5, "assistant_response_length": [1, 2], '
     '"tool_call_output_length": [1], "tool_call_latency": [0.1], "final_assistant_response_length": 1}',
     "t.jsonl:1: field assistant_response_length length 2 does not match num_turns 1"),
    ("applied_compute_agentic", '{"num_turns": 0, "input_prompt_length": 0, "assistant_response_length": [], '
     '"tool_call_output_length": [], "tool_call_latency": [], "final_assistant_response_length": 1}',
     "t.jsonl:1: input_prompt_length must be positive"),
    ("applied_compute_agentic", '{"num_turns": 1, "input_prompt_length": 5, "assistant_response_length": [1], '
     '"tool_call_output_length": [1], "tool_call_latency": [-1], "final_assistant_response_length": 1}',
     "t.jsonl:1: tool_call_latency\\[0\\] must be a finite non-negative number"),
    ("dynamo", '{"schema": "dynamo.request.trace.v1", "event_type": "request_start", "event_time_unix_ms": 1}',
     "t.jsonl:1: request trace supports request_end"),
    ("dynamo", '{"schema": "x", "event_type": "request_end", "event_time_unix_ms": 1}',
     "t.jsonl:1: unsupported Dynamo request trace schema 'x'"),
    ("dynamo", '{"schema": "dynamo.request.trace.v1", "event_type": "request_end", "event_time_unix_ms": 1, '
     '"request": {"request_id": "a", "output_tokens": 1, "replay": {"trace_block_size": 4, '
     '"input_length": 5, "input_sequence_hashes": [1]}}, "agent_context": {"session_id": "s"}}',
     "t.jsonl:1: trace line 2 has input_length 5 at block_size 4 and requires exactly 2 hash_ids, got 1"),
    ("dynamo", '{"schema": "dynamo.request.trace.v1", "event_type": "request_end", "event_time_unix_ms": 1, '
     '"request": {"request_id": "a", "output_tokens": 1, "replay": {"trace_block_size": 4, '
     '"input_length": 5, "input_sequence_hashes": [1]}}}', "trace line 1 input_length 5 exceeds hash_ids capacity 4"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, fmt, text, words):
    path = tmp_path / "t.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(TraceError, match=words):
        load_trace(path, fmt)


def test_a_payload_block_size_must_match_a_dynamo_traces_own():
    with pytest.raises(TraceError, match="trace_block_size 512 does not match embedded Dynamo request trace block size 64"):
        load_trace(GOLDEN / "dynamo_std.jsonl", "dynamo", trace_block_size=512)
