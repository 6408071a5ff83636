"""Tests for the Mooncake JSONL loader (aisim_fast.trace.workload).

Fixtures in tests/data are verbatim copies of /work/shared/reference: the traces
mooncake_tiny20.jsonl and sessions_200.jsonl, and the reference simulator's per-request
CSVs for them (golden/tiny20_vllm_agg1.csv, golden/sess200_vllm_agg2.csv).
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aisim_fast.trace.workload import (DEFAULT_TRACE_NAME, TraceError, TraceWarning, Workload,
                                        default_trace_path, load_default_trace, load_mooncake, prompt_tokens)
from support.paths import DATA_DIR

DATA = DATA_DIR
TINY20 = DATA / "mooncake_tiny20.jsonl"
SESSIONS200 = DATA / "sessions_200.jsonl"
SHARED_CONVERSATION = Path("/work/shared/datasets/mooncake_conversation_trace.jsonl")


def write_trace(path: Path, rows) -> Path:
    """Write rows (dicts are JSON-encoded, strings written as-is) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def row_hashes(w: Workload, q: int) -> np.ndarray:
    return w.hash_ids[w.hash_indptr[q] : w.hash_indptr[q + 1]]


def expected_interning(rows: list[dict]) -> list[list[int]]:
    dense: dict[int, int] = {}
    return [[dense.setdefault(h, len(dense)) for h in r["hash_ids"]] for r in rows]


# --------------------------------------------------------------------------- fixtures


def test_tiny20_fields_and_dtypes():
    w = load_mooncake(TINY20)
    rows = read_rows(TINY20)
    q = len(rows)
    assert w.path == str(TINY20) and w.trace_block_size == 512
    assert w.num_requests == q == 20 and w.num_sessions == 20
    assert w.line_no.dtype == np.int64 and w.line_no.tolist() == list(range(1, q + 1))
    assert w.request_name.dtype == object
    assert w.request_name.tolist() == [f"request_{i}" for i in range(1, q + 1)]
    assert w.session.dtype == np.int32 and w.session.tolist() == list(range(q))
    assert w.turn_index.dtype == np.int32 and not w.turn_index.any()
    assert w.start_ms.dtype == np.float64 and w.delay_ms.dtype == np.float64
    assert w.start_ms.tolist() == [float(r["timestamp"]) for r in rows]  # first stamp is 0
    assert not w.delay_ms.any()
    assert w.input_len.dtype == np.int64 and w.output_len.dtype == np.int64
    assert w.input_len.tolist() == [r["input_length"] for r in rows]
    assert w.output_len.tolist() == [r["output_length"] for r in rows]
    assert w.hash_indptr.dtype == np.int64 and w.hash_indptr.shape == (q + 1,)
    assert w.hash_ids.dtype == np.uint32
    assert [row_hashes(w, i).tolist() for i in range(q)] == expected_interning(rows)
    assert w.order.dtype == np.int64 and w.order.tolist() == list(range(q))


def test_tiny20_matches_reference_csv():
    # The reference CSV is sorted by arrival then trace line and identifies rows by name.
    w = load_mooncake(TINY20)
    golden = read_csv(DATA / "tiny20_vllm_agg1.golden.csv")
    assert [g["request_id"] for g in golden] == w.request_name[w.order].tolist()
    assert [float(g["arrival_ms"]) for g in golden] == w.start_ms[w.order].tolist()
    assert [int(g["input_tokens"]) for g in golden] == w.input_len[w.order].tolist()
    assert [int(g["trace_line"]) for g in golden] == w.line_no[w.order].tolist()


def test_interning_is_first_appearance_over_whole_file(tmp_path):
    big = 2**64 - 1
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "output_length": 1, "hash_ids": [big, 7]},
            {"timestamp": 0, "output_length": 1, "hash_ids": [7, 5, 0]},
            {"timestamp": 0, "output_length": 1, "hash_ids": [0, big, 5]},
        ],
    )
    w = load_mooncake(p)
    assert [row_hashes(w, i).tolist() for i in range(3)] == [[0, 1], [1, 2, 3], [3, 0, 2]]
    assert w.hash_indptr.tolist() == [0, 2, 5, 8]


def test_prompt_synthesis_blocks_and_truncation(tmp_path):
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [11, 22]},
            {"timestamp": 0, "input_length": 905, "output_length": 1, "hash_ids": [22, 33]},
            # input shorter than one block: the remaining hash ids are not used
            {"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [33, 44, 55]},
        ],
    )
    w = load_mooncake(p)
    toks = prompt_tokens(w, 1)
    assert toks.dtype == np.uint32 and toks.shape == (905,)
    a, b = row_hashes(w, 1).tolist()
    assert (a, b) == (1, 2)
    assert np.array_equal(toks, np.array([a] * 512 + [b] * 393, dtype=np.uint32))
    assert prompt_tokens(w, 0).tolist() == [0] * 512 + [1] * 512
    assert prompt_tokens(w, 2).tolist() == [2, 2, 2]

    # The block size is the trace's, not the engine's: with 32-token blocks the same
    # row covers at most 64 tokens.
    p2 = write_trace(
        tmp_path / "t32.jsonl",
        [{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [9, 8]}],
    )
    w32 = load_mooncake(p2, trace_block_size=32)
    assert prompt_tokens(w32, 0).tolist() == [0] * 32 + [1] * 8


def test_rebase_and_speedup(tmp_path):
    rows = [{"timestamp": t, "output_length": 1, "hash_ids": [1]} for t in (0, 30, 31, 60)]
    w = load_mooncake(write_trace(tmp_path / "a.jsonl", rows), arrival_speedup_ratio=2.5)
    assert w.start_ms.tolist() == [0.0, 12.0, 12.4, 24.0]
    # Re-basing subtracts the earliest start (not the first row's) before dividing.
    rows = [{"timestamp": t, "output_length": 1, "hash_ids": [1]} for t in (130, 100, 160.5)]
    w = load_mooncake(write_trace(tmp_path / "b.jsonl", rows), arrival_speedup_ratio=2)
    assert w.start_ms.tolist() == [15.0, 0.0, 30.25]
    assert w.order.tolist() == [1, 0, 2]


def test_order_is_stable_for_equal_starts(tmp_path):
    rows = [{"timestamp": t, "output_length": 1, "hash_ids": [1]} for t in (5, 3, 5, 3, 4)]
    w = load_mooncake(write_trace(tmp_path / "t.jsonl", rows))
    assert w.order.tolist() == [1, 3, 4, 0, 2]


def test_missing_input_length_uses_full_capacity(tmp_path):
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": None, "output_length": 4, "hash_ids": [4]},
        ],
    )
    assert load_mooncake(p).input_len.tolist() == [1536, 512]
    assert load_mooncake(p, trace_block_size=64).input_len.tolist() == [192, 64]
    assert prompt_tokens(load_mooncake(p, trace_block_size=2), 0).tolist() == [0, 0, 1, 1, 2, 2]


def test_field_aliases_and_missing_timestamp(tmp_path):
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {"created_time": 50, "input_tokens": 10, "output_tokens": 3, "hash_ids": [1]},
            {"session_id": "s", "created_time": 70, "output_tokens": 2, "hash_ids": [1]},
            {"session_id": "s", "delay_ms": 5, "output_tokens": 2, "hash_ids": [1]},
            # no timestamp at all: starts at 0, which then becomes the earliest start
            {"output_length": 1, "hash_ids": [2]},
        ],
    )
    w = load_mooncake(p)
    assert w.input_len.tolist() == [10, 512, 512, 512]
    assert w.output_len.tolist() == [3, 2, 2, 1]
    assert w.request_name.tolist() == ["request_1", "s", "s", "request_4"]
    assert w.turn_index.tolist() == [0, 0, 1, 0]
    assert np.array_equal(w.start_ms, [50.0, 70.0, np.nan, 0.0], equal_nan=True)
    assert w.delay_ms.tolist() == [0.0, 0.0, 5.0, 0.0]
    assert w.order.tolist() == [3, 0, 1]


def test_extra_fields_are_accepted(tmp_path):
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {
                "request_id": "r0",
                "timestamp": 0,
                "output_length": 3,
                "output_token_ids": [5, 6, 2**32 - 1],
                "hash_ids": [1],
                "priority": -(2**31),
                "strict_priority": 2**32 - 1,
                "policy_class": "gold",
                "something_else": {"nested": [1, 2]},
            },
            {"timestamp": 1, "output_length": 0, "output_token_ids": [], "hash_ids": [1],
             "request_id": None, "priority": None},
        ],
    )
    w = load_mooncake(p)
    assert w.output_len.tolist() == [3, 0]


def test_blank_lines_count_and_crlf(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(
        b"\n"
        b'{"timestamp": 3, "output_length": 1, "hash_ids": [1]}\r\n'
        b"   \r\n"
        b"\n"
        b'{"timestamp": 9, "output_length": 1, "hash_ids": [2]}'  # no final newline
    )
    w = load_mooncake(p)
    assert w.line_no.tolist() == [2, 5]
    assert w.request_name.tolist() == ["request_2", "request_5"]
    assert w.start_ms.tolist() == [0.0, 6.0]


def test_max_rows(tmp_path):
    w = load_mooncake(TINY20, max_rows=5)
    assert w.num_requests == 5 and w.line_no.tolist() == [1, 2, 3, 4, 5]
    assert w.hash_indptr.shape == (6,)
    # rows after the cut are not parsed, so a broken tail does not matter
    p = write_trace(
        tmp_path / "t.jsonl", [{"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "{oops"]
    )
    assert load_mooncake(p, max_rows=1).num_requests == 1
    with pytest.raises(ValueError):
        load_mooncake(p, max_rows=0)


# --------------------------------------------------------------------------- sessions


def test_sessions_200_structure():
    w = load_mooncake(SESSIONS200)
    rows = read_rows(SESSIONS200)
    assert w.num_requests == 200 and w.num_sessions == 49
    sids = [r["session_id"] for r in rows]
    assert w.request_name.tolist() == sids
    # dense session index by first appearance, turn index = rank within the session
    first_seen: dict[str, int] = {}
    seen = Counter()
    exp_session, exp_turn = [], []
    for s in sids:
        exp_session.append(first_seen.setdefault(s, len(first_seen)))
        exp_turn.append(seen[s])
        seen[s] += 1
    assert w.session.tolist() == exp_session
    assert w.turn_index.tolist() == exp_turn
    assert int(w.turn_index.max()) + 1 == max(seen.values())
    first = w.turn_index == 0
    assert int(first.sum()) == 49
    assert np.isnan(w.start_ms[~first]).all() and not np.isnan(w.start_ms[first]).any()
    assert w.start_ms[first].tolist() == [float(r["timestamp"]) for r in rows if "timestamp" in r]
    # later turns carry explicit delays in this file; first turns get 0
    assert w.delay_ms.tolist() == [float(r.get("delay", 0)) for r in rows]
    assert (w.delay_ms[~first] > 0).all()
    assert w.order.tolist() == np.flatnonzero(first).tolist()  # starts are increasing
    assert [row_hashes(w, i).tolist() for i in range(200)] == expected_interning(rows)


def test_sessions_200_matches_reference_csv():
    # The reference releases turn k at completion(turn k-1) + delay: check our start and
    # delay values reproduce its recorded arrivals.
    w = load_mooncake(SESSIONS200)
    golden = {(g["request_id"], int(g["turn_index"])): g for g in read_csv(
        DATA / "sess200_vllm_agg2.golden.csv")}
    assert len(golden) == 200
    for q in range(w.num_requests):
        key = (w.request_name[q], int(w.turn_index[q]))
        g = golden[key]
        assert int(g["input_tokens"]) == w.input_len[q]
        assert int(g["requested_output_tokens"]) == w.output_len[q]
        if key[1] == 0:
            assert float(g["arrival_ms"]) == w.start_ms[q]
        else:
            prev = golden[(key[0], key[1] - 1)]
            expect = float(prev["completion_ms"]) + w.delay_ms[q]
            assert math.isclose(float(g["arrival_ms"]), expect, rel_tol=0, abs_tol=1e-9)


def test_sessions_200_speedup_scales_delays():
    w1 = load_mooncake(SESSIONS200)
    w4 = load_mooncake(SESSIONS200, arrival_speedup_ratio=4.0)
    assert np.array_equal(w4.delay_ms, w1.delay_ms / 4.0)
    assert np.array_equal(w4.start_ms, w1.start_ms / 4.0, equal_nan=True)


def test_delay_inferred_from_timestamps(tmp_path):
    p = write_trace(
        tmp_path / "t.jsonl",
        [
            {"session_id": "a", "timestamp": 100, "output_length": 1, "hash_ids": [1]},
            {"session_id": "b", "timestamp": 120, "output_length": 1, "hash_ids": [1]},
            {"session_id": "a", "timestamp": 250, "output_length": 1, "hash_ids": [1]},
            # no timestamp, no delay: 0, and "last seen" stays 250
            {"session_id": "a", "output_length": 1, "hash_ids": [1]},
            {"session_id": "a", "timestamp": 400, "output_length": 1, "hash_ids": [1]},
            # explicit delay wins over the timestamp difference
            {"session_id": "a", "timestamp": 900, "delay": 7, "output_length": 1, "hash_ids": [1]},
            # ... but its timestamp still becomes "last seen"
            {"session_id": "a", "timestamp": 901, "output_length": 1, "hash_ids": [1]},
            {"session_id": "b", "delay": 0, "timestamp": 0, "output_length": 1, "hash_ids": [1]},
        ],
    )
    w = load_mooncake(p, arrival_speedup_ratio=2.0)
    assert w.session.tolist() == [0, 1, 0, 0, 0, 0, 0, 1]
    assert w.turn_index.tolist() == [0, 0, 1, 2, 3, 4, 5, 1]
    assert w.delay_ms.tolist() == [0.0, 0.0, 75.0, 0.0, 75.0, 3.5, 0.5, 0.0]
    assert np.array_equal(w.start_ms[:2], [0.0, 10.0])
    assert w.order.tolist() == [0, 1]


# --------------------------------------------------------------------------- errors

OK = {"timestamp": 0, "output_length": 1, "hash_ids": [1]}

# (rows, 1-based line of the error, fragment of the message)
ERROR_CASES = {
    "invalid_json": ([OK, '{"timestamp": 0, "output_length": 1,'], 2, "invalid JSON"),
    "not_object": ([OK, "[1, 2]"], 2, "must be a JSON object, got [1, 2]"),
    "missing_hash_ids": ([{"timestamp": 0, "output_length": 1}], 1,
                         'missing required field "hash_ids"'),
    "null_hash_ids": ([{"output_length": 1, "hash_ids": None}], 1,
                      'missing required field "hash_ids"'),
    "empty_hash_ids": ([{"output_length": 1, "hash_ids": []}], 1,
                       '"hash_ids" must be a non-empty list of integers, got []'),
    "hash_ids_not_list": ([{"output_length": 1, "hash_ids": 5}], 1,
                          '"hash_ids" must be a non-empty list'),
    "hash_id_negative": ([{"output_length": 1, "hash_ids": [1, -1]}], 1,
                         '"hash_ids"[1] must be an integer in [0, 2**64), got -1'),
    "hash_id_too_big": ([{"output_length": 1, "hash_ids": [2**64]}], 1,
                        f'"hash_ids"[0] must be an integer in [0, 2**64), got {2**64}'),
    "hash_id_float": ([{"output_length": 1, "hash_ids": [1.0]}], 1, '"hash_ids"[0]'),
    "hash_id_bool": ([{"output_length": 1, "hash_ids": [True]}], 1, "got true"),
    "missing_output": ([OK, {"timestamp": 0, "input_length": 5, "hash_ids": [1]}], 2,
                       'missing required field "output_length"'),
    "negative_output": ([OK, OK, {"timestamp": 0, "output_length": -3, "hash_ids": [1]}], 3,
                        '"output_length" must be a non-negative integer, got -3'),
    "float_output": ([{"output_length": 3.5, "hash_ids": [1]}], 1,
                     '"output_length" must be a non-negative integer, got 3.5'),
    "string_output_alias": ([{"output_tokens": "3", "hash_ids": [1]}], 1,
                            '"output_tokens" must be a non-negative integer, got "3"'),
    "both_output_aliases": ([{"output_length": 3, "output_tokens": 3, "hash_ids": [1]}], 1,
                            'both "output_length" and "output_tokens" are set'),
    "input_over_capacity": ([{"input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}], 1,
                            '"input_length" 1025 exceeds the capacity of its hash_ids'),
    "input_zero": ([{"input_length": 0, "output_length": 1, "hash_ids": [1]}], 1,
                   '"input_length" must be positive'),
    "input_negative": ([{"input_tokens": -1, "output_length": 1, "hash_ids": [1]}], 1,
                       '"input_tokens" must be a non-negative integer, got -1'),
    "timestamp_string": ([{"timestamp": "0", "output_length": 1, "hash_ids": [1]}], 1,
                         '"timestamp" must be a finite number of milliseconds, got "0"'),
    "timestamp_nan": (['{"created_time": NaN, "output_length": 1, "hash_ids": [1]}'], 1,
                      '"created_time" must be a finite number of milliseconds, got NaN'),
    "negative_delay": ([OK, {"session_id": "s", "timestamp": 0, "output_length": 1,
                             "hash_ids": [1]},
                        {"session_id": "s", "delay": -5, "output_length": 1, "hash_ids": [1]}],
                       3, '"delay" must not be negative, got -5'),
    "infinite_delay": ([{"session_id": "s", "timestamp": 0, "output_length": 1, "hash_ids": [1]},
                        '{"session_id": "s", "delay_ms": Infinity, "output_length": 1,'
                        ' "hash_ids": [1]}'],
                       2, '"delay_ms" must be a finite number of milliseconds, got Infinity'),
    "first_turn_delay": ([OK, {"session_id": "s", "timestamp": 0, "delay": 3,
                               "output_length": 1, "hash_ids": [1]}],
                         2, 'first turn of session "s" must not carry a non-zero "delay", got 3'),
    "single_row_delay": ([{"timestamp": 0, "delay_ms": 0.5, "output_length": 1,
                           "hash_ids": [1]}],
                         1, 'first turn of session "request_1" must not carry a non-zero'),
    "inferred_negative_delay": ([{"session_id": "s", "timestamp": 50, "output_length": 1,
                                  "hash_ids": [1]},
                                 {"session_id": "s", "timestamp": 30, "output_length": 1,
                                  "hash_ids": [1]}],
                                2, "is before the previous timestamp 50.0"),
    "no_timestamp_to_infer_from": ([{"session_id": "s", "output_length": 1, "hash_ids": [1]},
                                    {"session_id": "s", "timestamp": 30, "output_length": 1,
                                     "hash_ids": [1]}],
                                   2, "cannot infer the delay"),
    "session_id_not_string": ([{"session_id": 7, "output_length": 1, "hash_ids": [1]}], 1,
                              '"session_id" must be a string, got 7'),
    "request_id_not_string": ([{"request_id": 7, "output_length": 1, "hash_ids": [1]}], 1,
                              '"request_id" must be a string, got 7'),
    "policy_class_not_string": ([{"policy_class": [], "output_length": 1, "hash_ids": [1]}], 1,
                                '"policy_class" must be a string'),
    "priority_range": ([{"priority": 2**31, "output_length": 1, "hash_ids": [1]}], 1,
                       '"priority" must be a 32-bit signed integer'),
    "strict_priority_negative": ([{"strict_priority": -1, "output_length": 1, "hash_ids": [1]}],
                                 1, '"strict_priority" must be a 32-bit unsigned integer'),
    "output_token_ids_length": ([{"output_length": 3, "output_token_ids": [1, 2],
                                  "hash_ids": [1]}],
                                1, '"output_token_ids" has 2 tokens but the output length is 3'),
    "output_token_ids_value": ([{"output_length": 1, "output_token_ids": [-1],
                                 "hash_ids": [1]}],
                               1, '"output_token_ids"[0] must be an integer in [0, 2**32)'),
    "after_blank_lines": ([OK, "", "   ", {"output_length": 1}], 4,
                          'missing required field "hash_ids"'),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_names_file_and_line(tmp_path, case):
    rows, line, fragment = ERROR_CASES[case]
    p = write_trace(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    assert fragment in msg, msg
    assert info.value.line_no == line and info.value.path == str(p)
    assert isinstance(info.value, ValueError)


def test_exact_message_example(tmp_path):
    p = write_trace(tmp_path / "trace.jsonl", [OK] * 16 + [
        {"timestamp": 0, "output_length": -3, "hash_ids": [1]}])
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    assert str(info.value) == f'{p}:17: "output_length" must be a non-negative integer, got -3'


def test_not_utf8(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"output_length": 1, "hash_ids": [1]}\n{"x": "\xff"}\n')
    with pytest.raises(TraceError, match=r":2: invalid JSON"):
        load_mooncake(p)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    assert str(info.value) == f"{p}: no requests (the file is empty or has only blank lines)"
    assert info.value.line_no is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"trace_block_size": 0},
        {"trace_block_size": -512},
        {"trace_block_size": 1.5},
        {"arrival_speedup_ratio": 0},
        {"arrival_speedup_ratio": -1.0},
        {"arrival_speedup_ratio": math.inf},
        {"arrival_speedup_ratio": math.nan},
        {"arrival_speedup_ratio": "fast"},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_mooncake(TINY20, **kwargs)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "nope.jsonl")


# --------------------------------------------------------------------------- bundled trace


def test_default_trace():
    p = default_trace_path()
    assert p.name == DEFAULT_TRACE_NAME and p.is_file()
    w = load_default_trace()
    assert w.num_requests == 3000 and w.num_sessions == 3000
    assert w.start_ms[0] == 0.0 and w.start_ms[-1] == 987000.0
    assert (np.diff(w.start_ms) >= 0).all()
    assert w.hash_ids[0] == 0 and w.input_len.tolist()[:4] == [6758, 7322, 7236, 2290]
    assert load_default_trace(arrival_speedup_ratio=10.0).start_ms[-1] == 98700.0


@pytest.mark.skipif(not SHARED_CONVERSATION.exists(), reason="shared dataset not present")
def test_default_trace_is_verbatim_head_of_source():
    src = SHARED_CONVERSATION.read_bytes().split(b"\n")[:3000]
    assert default_trace_path().read_bytes() == b"\n".join(src) + b"\n"


# --------------------------------------------------------------------------- round trip

SESSION_NAMES = st.sampled_from([None, None, "s0", "s1", "s2", "request_2"])
HASH_POOL = st.sampled_from([0, 1, 2, 3, 1000, 2**40, 2**63, 2**64 - 1])
NUMBER_MS = st.one_of(
    st.integers(0, 10**7), st.floats(0, 1e7, allow_nan=False, allow_infinity=False)
)


@st.composite
def traces(draw):
    """Valid traces plus what the loader must return, built from the format's rules."""
    block = draw(st.sampled_from([1, 16, 512]))
    ratio = draw(st.sampled_from([1.0, 2.5, 0.5, 3.0]))
    n = draw(st.integers(1, 25))
    lines: list[str] = []
    expect = {k: [] for k in ("line_no", "name", "turn", "first_ts", "delay", "in", "out", "hs")}
    last_ts: dict[str, float | None] = {}
    turns: Counter = Counter()
    for _ in range(n):
        for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
            lines.append(draw(st.sampled_from(["", "  ", "\t"])))
        line_no = len(lines) + 1
        sid = draw(SESSION_NAMES)
        name = sid if sid is not None else f"request_{line_no}"
        hs = draw(st.lists(HASH_POOL, min_size=1, max_size=5))
        row: dict = {}
        if sid is not None:
            row["session_id"] = sid
        row["hash_ids"] = hs
        out = draw(st.integers(0, 3000))
        row["output_tokens" if draw(st.booleans()) else "output_length"] = out
        if draw(st.booleans()):
            inp = draw(st.integers(1, len(hs) * block))
            row["input_tokens" if draw(st.booleans()) else "input_length"] = inp
        else:
            inp = len(hs) * block
        ts = draw(st.one_of(st.none(), NUMBER_MS))
        turn = turns[name]
        delay = None
        if turn > 0:
            prev = last_ts[name]
            if draw(st.booleans()):
                delay = draw(NUMBER_MS)
            elif ts is not None and (prev is None or ts < prev):
                delay = draw(NUMBER_MS)  # inference would fail: give an explicit delay
        if ts is not None:
            row["timestamp" if draw(st.booleans()) else "created_time"] = ts
        if delay is not None:
            row["delay" if draw(st.booleans()) else "delay_ms"] = delay
        if draw(st.booleans()):
            row["request_id"] = f"r{line_no}"
        lines.append(json.dumps(row))

        if turn == 0:
            exp_delay = 0.0
            expect["first_ts"].append(0.0 if ts is None else float(ts))
        elif delay is not None:
            exp_delay = float(delay)
        elif ts is not None:
            exp_delay = float(ts) - last_ts[name]
        else:
            exp_delay = 0.0
        if turn == 0 or ts is not None:
            last_ts[name] = None if ts is None else float(ts)
        turns[name] += 1
        for k, v in (("line_no", line_no), ("name", name), ("turn", turn), ("delay", exp_delay),
                     ("in", inp), ("out", out), ("hs", hs)):
            expect[k].append(v)
    return block, ratio, lines, expect


@settings(max_examples=60, deadline=None, database=None)
@given(traces())
def test_round_trip(case):
    block, ratio, lines, expect = case
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "rt.jsonl"
        p.write_text("".join(line + "\n" for line in lines))
        w = load_mooncake(p, trace_block_size=block, arrival_speedup_ratio=ratio)
    n = len(expect["name"])
    assert w.num_requests == n
    assert w.line_no.tolist() == expect["line_no"]
    assert w.request_name.tolist() == expect["name"]
    assert w.turn_index.tolist() == expect["turn"]
    dense: dict[str, int] = {}
    assert w.session.tolist() == [dense.setdefault(s, len(dense)) for s in expect["name"]]
    assert w.input_len.tolist() == expect["in"]
    assert w.output_len.tolist() == expect["out"]
    assert w.delay_ms.tolist() == [x / ratio for x in expect["delay"]]
    first = w.turn_index == 0
    base = min(expect["first_ts"])
    assert w.start_ms[first].tolist() == [(t - base) / ratio for t in expect["first_ts"]]
    assert np.isnan(w.start_ms[~first]).all()
    starts = w.start_ms[w.order]
    assert (np.diff(starts) >= 0).all()
    assert sorted(w.order.tolist()) == np.flatnonzero(first).tolist()
    # stable: equal starts keep file order
    for a, b in zip(w.order[:-1], w.order[1:]):
        if w.start_ms[a] == w.start_ms[b]:
            assert a < b
    rows = [{"hash_ids": h} for h in expect["hs"]]
    assert [row_hashes(w, q).tolist() for q in range(n)] == expected_interning(rows)
    for q in range(n):
        toks = prompt_tokens(w, q)
        assert toks.shape == (expect["in"][q],)
        ids = row_hashes(w, q)
        assert np.array_equal(toks, ids[np.arange(toks.shape[0]) // block])


# ---------------------------------------------------------------------------------------
# the compiled scanner of simple rows against the general loader
# ---------------------------------------------------------------------------------------
def _general(path, **kw):
    """load_mooncake with the compiled fast path switched off."""
    from aisim_fast.trace import workload as W

    saved = W._load_simple
    W._load_simple = lambda *a, **k: None
    try:
        return load_mooncake(path, **kw)
    finally:
        W._load_simple = saved


def _same_workload(a: Workload, b: Workload) -> bool:
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                return False
        elif x != y:
            return False
    return True


_SPACE = st.sampled_from(["", "", " ", "  ", "\t", "\r"])
_INT = st.one_of(st.integers(0, 2000), st.integers(0, 2**64 + 5), st.integers(-3, -1))
_NUMBER_TEXT = st.one_of(_INT.map(str), st.sampled_from(["1.5", "1e3", "007", "0", "-0", "2.0",
                                                          '"3"', "null", "true"]))


@st.composite
def _raw_row(draw):
    """A JSON-ish row: mostly the simple shape, sometimes something the scanner must
    hand over to the general loader (floats, strings, other keys, duplicates...)."""
    n_ids = draw(st.integers(0, 4))
    ids = ",".join(draw(_SPACE) + draw(st.one_of(_INT.map(str), st.just("1.0"))) + draw(_SPACE)
                   for _ in range(n_ids))
    fields = [("timestamp", draw(_NUMBER_TEXT)), ("input_length", draw(_NUMBER_TEXT)),
              ("output_length", draw(_NUMBER_TEXT)), ("hash_ids", "[" + ids + "]")]
    fields = [f for f in fields if draw(st.integers(0, 7)) > 0]  # sometimes a field is missing
    if draw(st.integers(0, 9)) == 0:
        fields.append(draw(st.sampled_from([("session_id", '"a"'), ("delay", "5"),
                                            ("timestamp", "3"), ("priority", "1"),
                                            ("input_tokens", "4"), ("x\\u0041", "1")])))
    fields = draw(st.permutations(fields))
    sp = draw(_SPACE)
    body = ",".join(f'{sp}"{k}"{draw(_SPACE)}:{draw(_SPACE)}{v}{sp}' for k, v in fields)
    return draw(_SPACE) + "{" + body + "}" + draw(_SPACE)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.one_of(_raw_row(), st.sampled_from(["", "  ", "\r"])), min_size=1, max_size=6),
       block=st.sampled_from([1, 16, 512]), max_rows=st.sampled_from([None, 1, 3]))
def test_fast_scanner_agrees_with_the_general_loader(rows, block, max_rows):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_text("\n".join(rows), encoding="utf-8")
        try:
            want = _general(path, trace_block_size=block, max_rows=max_rows)
        except TraceError as exc:
            with pytest.raises(TraceError) as got:
                load_mooncake(path, trace_block_size=block, max_rows=max_rows)
            assert str(got.value) == str(exc)
            return
        got = load_mooncake(path, trace_block_size=block, max_rows=max_rows)
        assert _same_workload(got, want)


def test_fast_scanner_takes_the_bundled_traces():
    """The compiled path really is the one used for the common traces."""
    from aisim_fast.trace.workload import _load_simple

    for path in (TINY20, default_trace_path(), DATA / "traces" / "mooncake_1k.jsonl"):
        fast = _load_simple(str(path), 512, 1.0, None)
        assert fast is not None, path
        assert _same_workload(fast, _general(path))


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl"])  # by content, whatever the name
def test_gzip_traces_read_transparently(tmp_path, name):
    import gzip

    # sessions (the general loader) and tiny20 (the compiled scanner of simple rows)
    for plain in (DATA_DIR / "traces" / "sessions_200.jsonl", TINY20):
        packed = tmp_path / name
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        a, b = load_mooncake(plain), load_mooncake(packed)
        for field in ("line_no", "session", "turn_index", "start_ms", "delay_ms", "input_len",
                      "output_len", "hash_indptr", "hash_ids", "order"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert list(a.request_name) == list(b.request_name)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:200])
    with pytest.raises(TraceError, match=r"broken.jsonl.gz: not a readable gzip file"):
        load_mooncake(broken)


def test_lenient_rows_load_as_the_reference_does_with_one_warning_per_kind(tmp_path):
    """A session without a timestamp, rows without input_length and a field nobody reads
    load as before (the reference accepts them), each kind with one TraceWarning that
    names the first such line and counts the rows; closed loop does not warn about
    timestamps, and a clean trace gives no warning."""
    rows = [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]},
            {"output_length": 2, "hash_ids": [2], "colour": "red"},
            {"timestamp": 5, "output_length": 2, "hash_ids": [3], "colour": "blue"}]
    p = write_trace(tmp_path / "t.jsonl", rows)
    with pytest.warns(TraceWarning) as caught:
        w = load_mooncake(p)
    messages = sorted(str(c.message) for c in caught)
    assert len(messages) == 3
    assert messages[0].startswith(f'{p}:2: no "input_length"') and "2 rows like this one" in messages[0]
    assert messages[1].startswith(f'{p}:2: no "timestamp"') and "(this row)" in messages[1]
    assert messages[2].startswith(f"{p}:2: unknown field 'colour' ignored") and "2 rows" in messages[2]
    assert w.input_len.tolist() == [10, 512, 512]
    with pytest.warns(TraceWarning) as caught:
        load_mooncake(p, closed_loop=True)
    assert not any('no "timestamp"' in str(c.message) for c in caught)
    # the compiled scanner's rows (no unknown key) warn the same way
    simple = write_trace(tmp_path / "s.jsonl", [rows[0], {"output_length": 2, "hash_ids": [2]}])
    with pytest.warns(TraceWarning) as caught:
        load_mooncake(simple)
    assert sorted(str(c.message).split(": ")[1] for c in caught) == ['no "input_length"', 'no "timestamp"']
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_mooncake(TINY20)


@pytest.mark.parametrize("raw, guess", [
    (b'\xff\xfe{\x00"\x00}\x00\n', "UTF-16 or UTF-32"),
    (b'{"timestamp": 0, "output_length": 1, "hash_ids": [1], "session_id": "caf\xe9"}\n',
     "Latin-1 / Windows-1252"),
])
def test_a_trace_not_in_utf8_says_what_it_looks_like(tmp_path, raw, guess):
    p = tmp_path / "t.jsonl"
    p.write_bytes(raw)
    with pytest.raises(TraceError, match=rf"{p}:1: invalid JSON: .*{guess}.*save it as UTF-8"):
        load_mooncake(p)


def test_session_rows_are_the_rows_naming_a_session_id(tmp_path):
    """``session_row`` marks the rows that name a session_id (the reference's SGLang KV
    events keep their inserts apart); a null session_id is no session; cutting and
    joining workloads keeps each row's flag."""
    from aisim_fast.trace.workload import concat_workloads, select_rows

    row = {"input_length": 512, "output_length": 2, "hash_ids": [1]}
    p = write_trace(tmp_path / "t.jsonl", [
        {**row, "timestamp": 0},
        {**row, "timestamp": 1, "session_id": "a"},
        {**row, "timestamp": 2, "session_id": None},
        {**row, "timestamp": 3, "session_id": "request_1"},
    ])
    w = load_mooncake(p)
    assert w.session_row.tolist() == [False, True, False, True]
    assert select_rows(w, [2, 1]).session_row.tolist() == [False, True]
    plain = load_mooncake(write_trace(tmp_path / "plain.jsonl", [{**row, "timestamp": 0}]))
    assert plain.session_row is None
    assert concat_workloads(plain, select_rows(w, [1])).session_row.tolist() == [False, True]
    assert concat_workloads(plain, plain).session_row is None


def test_select_rows_of_single_turn_rows_keeps_each_row(tmp_path):
    """Cutting a trace of one-turn rows (a round-robin worker shard) keeps each
    picked row's fields and hash ids, numbers the rows' sessions by position,
    orders them by start, and rejects a row picked twice."""
    from aisim_fast.trace.workload import select_rows

    rows = [{"timestamp": t, "input_length": 300 + 10 * i, "output_length": 2 + i,
             "hash_ids": [i % 3, 7, i]} for i, t in enumerate([5, 0, 9, 3, 3, 1])]
    w = load_mooncake(write_trace(tmp_path / "t.jsonl", rows))
    assert w.num_sessions == w.num_requests
    picked = [4, 0, 3, 5]
    cut = select_rows(w, picked)
    assert cut.session.tolist() == [0, 1, 2, 3] and cut.turn_index.tolist() == [0] * 4
    assert cut.input_len.tolist() == w.input_len[picked].tolist()
    assert cut.output_len.tolist() == w.output_len[picked].tolist()
    assert cut.request_name.tolist() == w.request_name[picked].tolist()
    assert [row_hashes(cut, i).tolist() for i in range(4)] == [row_hashes(w, q).tolist() for q in picked]
    # starts 3, 5, 3, 1 (ms): the tie keeps row order
    assert cut.order.tolist() == [3, 0, 2, 1]
    assert cut.output_plan()[0].tolist() == w.output_plan()[0][picked].tolist()
    with pytest.raises(ValueError, match="whole sessions"):
        select_rows(w, [1, 2, 1])
