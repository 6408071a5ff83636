"""Synthetic loads and trace formats from replay flags (``cli.flags``): a load is asked
for without writing a payload, and runs exactly as the payload the flags stand for
(the reference's synthetic sessions golden, through flags); bad combinations are
refused naming the flag."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from support import goldens
from support.cli_runs import assert_user_error, run_cli
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

SYNTHETIC = DATA_DIR / "golden_synthetic"
FORMATS = DATA_DIR / "golden_trace_formats"


def test_a_session_load_from_flags_is_the_references(tmp_path, capsys):
    """ses_conc2_groups3 (8 sessions x 3 turns, closed loop 2, three prefix groups, 7 ms
    think time) as flags: every request bit for bit."""
    out = tmp_path / "run"
    code, stdout, err = run_cli(["replay", "--backend", "vllm", "--workers", "1", "--engine-args",
                                 json.dumps({"block_size": 64, "num_gpu_blocks": 16384, "max_num_seqs": 256,
                                             "max_num_batched_tokens": 8192, "max_model_len": 40960,
                                             "timing_model": {"type": "polynomial"}}),
                                 "--load", "concurrency", "--concurrency", "2", "--isl", "200", "--osl", "20",
                                 "--requests", "8", "--turns", "3", "--shared-prefix-ratio", "0.5",
                                 "--prefix-groups", "3", "--think-ms", "7", "--out", out], capsys)
    assert code == 0, err
    assert "synthetic concurrency load" in stdout
    gold = goldens.read_golden("ses_conc2_groups3", SYNTHETIC)
    cand = goldens.index_frame(pd.read_parquet(out / "requests.parquet"))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report("ses_conc2_groups3", missing, bad)
    assert not timeline_differences(gold, cand)
    summary = json.loads((out / "summary.json").read_text())
    config = summary["aisim_fast.config"]
    assert config["synthetic"]["turns_per_session"] == 3 and config["concurrency"] == 2
    assert summary["kv_eviction_policy"] == "lru"  # the reference's report key


def test_poisson_and_kv_fraction_loads(tmp_path, capsys):
    out = tmp_path / "poisson"
    code, _, err = run_cli(["replay", "--backend", "vllm", "--workers", "2", "--load", "poisson", "--rate", "20",
                            "--isl", "500", "--osl", "20", "--requests", "40", "--arrival-seed", "7",
                            "--out", out, "--quiet"], capsys)
    assert code == 0, err
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 40 and requests["arrival_ms"].min() == 0.0
    out = tmp_path / "kv"
    code, _, err = run_cli(["replay", "--backend", "vllm", "--workers", "2", "--load", "kv_capacity_fraction",
                            "--kv-fraction", "0.5", "--isl", "1000", "--osl", "100", "--requests", "60",
                            "--engine-args", '{"num_gpu_blocks": 500}', "--out", out, "--quiet"], capsys)
    assert code == 0, err
    # 500 blocks of 64 on each of 2 workers hold 64000 // 1050 = 60 requests: half of them
    assert json.loads((out / "summary.json").read_text())["aisim_fast.config"]["concurrency"] == 30


def test_a_delta_trace_from_flags(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", str(FORMATS / "delta_edges.jsonl"), "--trace-format", "mooncake-delta",
                            "--backend", "vllm", "--workers", "1", "--trace-block-size", "16",
                            "--engine-args", json.dumps({"block_size": 16, "max_num_seqs": 256,
                                                         "max_num_batched_tokens": 8192,
                                                         "timing_model": {"type": "polynomial"}}),
                            "--out", out, "--quiet"], capsys)
    assert code == 0, err
    gold = goldens.read_golden("delta_edges_vllm_agg1", FORMATS)
    requests = pd.read_parquet(out / "requests.parquet")
    missing, bad = goldens.parity_failures(gold, goldens.index_frame(requests))
    assert not missing and not bad
    # prompts are the sessions' histories: 40, then 40 + 12 + 16 = 68, ...
    assert sorted(requests["input_tokens"]) == sorted(int(r["input_tokens"]) for r in gold.values())


BASE = ["replay", "--backend", "vllm", "--workers", "1"]


@pytest.mark.parametrize("extra,fragments", [
    (["--load", "poisson", "--isl", "10", "--osl", "2", "--requests", "5"], ["--load poisson needs --rate"]),
    (["--isl", "10"], ["a synthetic load needs --load, --osl, --requests"]),
    (["--load", "concurrency", "--concurrency", "2", "--rate", "3", "--isl", "10", "--osl", "2", "--requests", "5"],
     ["--rate does not apply to --load concurrency"]),
    (["--load", "poisson", "--rate", "-3", "--isl", "10", "--osl", "2", "--requests", "5"],
     ["--rate: must be a finite number > 0"]),
    (["--load", "poisson", "--rate", "3", "--isl", "10", "--osl", "2", "--requests", "5", "--think-ms", "5"],
     ["--think-ms shapes sessions: give --turns N"]),
    (["--load", "concurrency", "--concurrency", "2", "--isl", "10", "--osl", "2", "--requests", "5",
      "--cached-prefix", "11"], ["--cached-prefix: must be <= isl (10)"]),
    (["--load", "concurrency", "--concurrency", "2", "--isl", "10", "--osl", "2", "--requests", "5",
      "--trace-block-size", "16"], ["--trace-block-size is for traces"]),
    (["trace.jsonl", "--load", "concurrency", "--concurrency", "2", "--isl", "10", "--osl", "2", "--requests", "5"],
     ["replaces the trace"]),
    (["--load", "concurrency", "--concurrency", "2", "--isl", "10", "--osl", "2", "--requests", "5",
      "--turns", "3", "--shared-prefix-ratio", "2"], ["--shared-prefix-ratio: must be within [0, 1]"]),
    (["--load", "constant_rate", "--rate", "4", "--isl", "10", "--osl", "2", "--requests", "5",
      "--arrival-seed", "3"], ["--arrival-seed seeds poisson arrivals"]),
])
def test_bad_load_flags_name_the_flag(tmp_path, capsys, extra, fragments):
    code, _, err = run_cli([*BASE, *extra, "--out", tmp_path / "out"], capsys)
    assert_user_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


def test_load_flags_are_refused_beside_a_spec(tmp_path, capsys):
    code, _, err = run_cli(["replay", "--spec", SYNTHETIC / "syn_conc.payload.json", "--isl", "100",
                            "--out", tmp_path / "out"], capsys)
    assert_user_error(code, err, "--isl cannot be combined with --spec")


AZURE = DATA_DIR / "traces" / "azure_2023_code_50.csv"


def test_a_public_csv_trace_runs_and_is_labelled_beyond_the_reference(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", str(AZURE), "--trace-format", "azure", "--backend", "vllm",
                            "--workers", "2", "--out", out, "--quiet"], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == summary["completed_requests"] == 50
    assert "azure" in summary["beyond_reference"][0]
    assert pd.read_parquet(out / "requests.parquet")["cached_tokens"].sum() == 0


def test_a_bad_csv_stops_the_cli_in_one_line(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,abc,2\n")
    code, _, err = run_cli(["replay", str(path), "--trace-format", "azure", "--backend", "vllm",
                            "--workers", "1", "--out", tmp_path / "o"], capsys)
    assert_user_error(code, err, "t.csv:2: ContextTokens 'abc' is not a whole number")
