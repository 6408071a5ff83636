"""The ``aisim-fast replay`` command line and the run folder it writes.

Runs go through ``cli.main([...])`` in-process (the kernels are compiled once per
session); one subprocess test covers the installed ``aisim-fast`` console script.

* spec path: tiny20 golden (1 vLLM worker) -> files, parquet metadata, per-request values
  against the golden CSV, summary keys against the golden report;
* sess200 golden (2 workers, multi-turn sessions, relative trace path in the spec) ->
  request-id (uuid) order of the rows, which the summary sums depend on;
* no-spec path: flags reproduce the tiny20 golden; TRT-LLM closed loop on the default trace;
* output folder: refused when non-empty, replaced with --overwrite (only if it holds run
  files alone), all-or-nothing when a write fails;
* bad input (config fields, flag values, trace lines, specs, a simulation dead end): every
  error is one ``aisim-fast: error:`` line, exit code 2, and nothing is written.
"""

import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import aisim_fast
import support.paths
from aisim_fast.cli import app as cli, commands, flags
from aisim_fast.io import run_folder
from support.cli_runs import (NOT_COMPARED, PER_REQUEST_ABS_TOL_MS, SUMMARY_REL_TOL, TOKEN_LEVEL_MARKERS,
                              assert_summary_matches, assert_user_error, golden_report, run_cli)

DATA_DIR = support.paths.DATA_DIR / "cli"
TINY_SPEC = DATA_DIR / "tiny20_vllm_agg1.spec.json"
TINY_TRACE = DATA_DIR / "mooncake_tiny20.jsonl"
TINY_CSV = DATA_DIR / "tiny20_vllm_agg1.csv"
TINY_REPORT = DATA_DIR / "tiny20_vllm_agg1.report.json"
SESS_SPEC = DATA_DIR / "sess200_vllm_agg2.spec.json"
SESS_CSV = DATA_DIR / "sess200_vllm_agg2.csv"
SESS_REPORT = DATA_DIR / "sess200_vllm_agg2.report.json"

def assert_nothing_written(folder, before):
    """``folder`` holds exactly the entries it held before (no run, no hidden staging)."""
    assert sorted(os.listdir(folder)) == before


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One spec replay of the tiny20 golden; shared by the read-only checks below."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    code = cli.main(["replay", "--spec", str(TINY_SPEC), "--trace", str(TINY_TRACE),
                     "--out", str(out)])
    assert code == 0
    return out


# --------------------------------------------------------------------------------------
# spec path against the goldens


def test_spec_run_writes_the_three_files(tiny_run):
    assert sorted(os.listdir(tiny_run)) == ["passes.parquet", "requests.parquet", "summary.json"]
    passes = run_folder.read_passes(tiny_run)
    assert len(passes) > 0
    assert {"worker", "start_ms", "end_ms", "num_prefill_requests", "sum_prefill_tokens",
            "num_decode_requests"} <= set(passes.columns)
    assert (passes["end_ms"] >= passes["start_ms"]).all()
    assert (passes["worker"] == 0).all() and (passes["rank"] == 0).all()
    assert passes.columns[:2].tolist() == ["worker", "rank"]


def test_parquet_metadata_holds_version_and_resolved_config(tiny_run):
    for name in ("requests.parquet", "passes.parquet"):
        meta = run_folder.read_metadata(tiny_run / name)
        assert meta["aisim_fast.version"] == aisim_fast.__version__
        config = meta["aisim_fast.config"]
        assert config["mode"] == "spec"
        assert config["spec_file"] == str(TINY_SPEC.resolve())
        assert config["trace_path"] == str(TINY_TRACE.resolve())
        assert config["workers"] == 1
        assert config["rank"]["backend"] == "vllm"
        assert config["rank"]["num_gpu_blocks"] == 16384
    summary = run_folder.read_summary(tiny_run)
    assert summary["aisim_fast.version"] == aisim_fast.__version__
    assert summary["aisim_fast.config"] == run_folder.read_metadata(tiny_run / "requests.parquet")[
        "aisim_fast.config"]


def test_requests_match_golden_csv(tiny_run):
    got = run_folder.read_requests(tiny_run)
    golden = pd.read_csv(TINY_CSV)
    assert len(got) == len(golden) == 20
    # rows are in uuid order and carry the golden's uuid spelling
    assert got["uuid"].tolist() == sorted(golden["uuid"])
    merged = golden.merge(got, on="uuid", suffixes=("_golden", ""))
    assert len(merged) == 20
    assert (merged["request_id"] == merged["request_id_golden"]).all()
    for col in ("ttft_ms", "tpot_ms", "e2e_ms"):
        np.testing.assert_allclose(merged[col], merged[f"{col}_golden"],
                                   rtol=0, atol=PER_REQUEST_ABS_TOL_MS, err_msg=col)
    for col in ("input_tokens", "output_tokens", "cached_tokens", "worker", "terminal_status"):
        assert (merged[col] == merged[f"{col}_golden"]).all(), col
    for col in ("request_id", "worker", "arrival_ms", "first_token_ms", "completion_ms",
                "ttft_ms", "tpot_ms", "e2e_ms", "input_tokens", "output_tokens",
                "cached_tokens", "terminal_status"):
        assert col in got.columns


def test_summary_matches_golden_report(tiny_run):
    summary = run_folder.read_summary(tiny_run)
    golden = golden_report(TINY_REPORT)
    per_request = [k for k in golden if k not in NOT_COMPARED
                   and not any(m in k for m in TOKEN_LEVEL_MARKERS)]
    assert "mean_ttft_ms" in per_request and "gpu_hours" in per_request
    assert_summary_matches(summary, golden, per_request)
    # the token-level keys come from the kernels' accumulator (ITL, per-user rate)
    token_level = [k for k in golden if any(m in k for m in TOKEN_LEVEL_MARKERS)]
    assert_summary_matches(summary, golden, token_level)
    # host-side keys are ours, consistent with each other
    assert summary["wall_time_ms"] > 0
    assert math.isclose(summary["processed_tokens_per_s"],
                        summary["processed_tokens"] / summary["wall_time_ms"] * 1000.0)


def test_sessions_in_uuid_order_relative_trace(tmp_path, capsys):
    """sess200: multi-turn sessions, so uuid order is neither file nor arrival order; the
    spec's relative trace_path resolves next to the spec file (no --trace)."""
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", "--spec", SESS_SPEC, "--out", out, "--no-passes"], capsys)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["requests.parquet", "summary.json"]
    got = run_folder.read_requests(out)
    golden = pd.read_csv(SESS_CSV)
    key = ["request_id", "turn_index"]
    merged = golden.merge(got, on=key, suffixes=("_golden", ""))
    assert len(merged) == len(golden) == len(got) == 200
    assert (merged["uuid"] == merged["uuid_golden"]).all()
    np.testing.assert_allclose(merged["e2e_ms"], merged["e2e_ms_golden"],
                               rtol=0, atol=PER_REQUEST_ABS_TOL_MS)
    summary = run_folder.read_summary(out)
    golden_rep = golden_report(SESS_REPORT)
    assert summary["aisim_fast.config"]["trace_path"] == str((DATA_DIR / "sessions_200.jsonl").resolve())
    assert summary["decode_worker_seconds"] == pytest.approx(golden_rep["decode_worker_seconds"],
                                                             rel=SUMMARY_REL_TOL)
    assert_summary_matches(summary, golden_rep, ["num_requests", "completed_requests",
                                                 "mean_e2e_latency_ms", "mean_tpot_ms",
                                                 "p99_ttft_ms", "committed_prefill_tokens"])


# --------------------------------------------------------------------------------------
# no-spec path


def test_flags_reproduce_the_spec_run(tmp_path, tiny_run, capsys):
    """The tiny20 spec uses the reference defaults, so the same flags give the same run."""
    out = tmp_path / "run"
    code, stdout, err = run_cli(["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1",
                                 "--out", out], capsys)
    assert code == 0, err
    assert err == ""
    for label in ("TTFT", "TPOT", "E2E", "ITL", "prefix reuse", "wall time", "20 completed",
                  "requests per wall second", str(out / "requests.parquet"),
                  str(out / "passes.parquet"), str(out / "summary.json")):
        assert label in stdout, label
    flags_req = run_folder.read_requests(out)
    spec_req = run_folder.read_requests(tiny_run)
    pd.testing.assert_frame_equal(flags_req, spec_req)
    config = run_folder.read_summary(out)["aisim_fast.config"]
    assert config["mode"] == "flags" and config["default_trace"] is False
    assert config["trace_block_size"] == 512 and config["arrival_speedup_ratio"] == 1.0


def test_flags_trtllm_closed_loop_on_default_trace(tmp_path, capsys, monkeypatch):
    """No TRACE = the bundled default (pointed at tiny20 here to keep the test short)."""
    monkeypatch.setattr(flags, "default_trace_path", lambda: TINY_TRACE)
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", "--backend", "trtllm", "--workers", "2", "--concurrency",
                            "4", "--engine-args", '{"num_gpu_blocks": 2048, "max_num_seqs": 8}',
                            "--out", out], capsys)
    assert code == 0, err
    config = run_folder.read_metadata(out / "requests.parquet")["aisim_fast.config"]
    assert config["default_trace"] is True
    assert config["trace_path"] == str(TINY_TRACE.resolve())
    assert config["rank"]["backend"] == "trtllm"
    assert config["rank"]["block_size"] == 32  # TRT-LLM's native block size
    assert config["rank"]["num_gpu_blocks"] == 2048 and config["rank"]["max_num_seqs"] == 8
    assert config["concurrency"] == 4 and config["workers"] == 2
    req = run_folder.read_requests(out)
    assert (req["terminal_status"] == "completed").all()
    assert set(req["worker"]) == {0, 1}
    # closed loop: never more than 4 requests between arrival and completion
    arrival = req["arrival_ms"].to_numpy()
    done = req["completion_ms"].to_numpy()
    in_flight = [(arrival <= t).sum() - (done <= t).sum() for t in arrival]
    assert max(in_flight) <= 4
    assert set(run_folder.read_passes(out)["worker"]) == {0, 1}


def test_python_dash_m_entry_point(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["aisim_fast", "--version"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("aisim_fast", run_name="__main__")
    assert exit_info.value.code == 0
    assert aisim_fast.__version__ in capsys.readouterr().out


def test_console_script_smoke(tmp_path):
    script = Path(sys.executable).with_name("aisim-fast")
    if not script.exists():
        script = shutil.which("aisim-fast")
    assert script, "the aisim-fast console script is not installed"
    out = tmp_path / "run"
    proc = subprocess.run([str(script), "replay", str(TINY_TRACE), "--backend", "vllm",
                           "--workers", "1", "--no-passes", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "wrote:" in proc.stdout
    assert sorted(os.listdir(out)) == ["requests.parquet", "summary.json"]
    bad = subprocess.run([str(script), "replay", "--backend", "vllm", "--workers", "1",
                          "--engine-args", '{"bogus": 1}', "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=600)
    assert_user_error(bad.returncode, bad.stderr, "--engine-args.bogus")


# --------------------------------------------------------------------------------------
# output folder handling


def test_existing_out_dir_is_refused_then_overwritten(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    (out / "summary.json").write_text("{}")
    args = ["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1", "--out", out]
    code, _, err = run_cli(args, capsys)
    assert_user_error(code, err, str(out), "--overwrite")
    assert (out / "summary.json").read_text() == "{}"
    code, _, err = run_cli(args + ["--overwrite", "--no-passes"], capsys)
    assert code == 0, err
    # the whole folder is replaced: the old passes.parquet is gone with the old run
    assert sorted(os.listdir(out)) == ["requests.parquet", "summary.json"]
    assert run_folder.read_summary(out)["completed_requests"] == 20
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_empty_out_dir_and_missing_parents_are_fine(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "a" / "b" / "run"):
        code, _, err = run_cli(["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1",
                                "--no-passes", "--out", out], capsys)
        assert code == 0, err
        assert (out / "summary.json").is_file()


def test_overwrite_refuses_a_folder_with_other_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run_cli(["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1",
                            "--out", out, "--overwrite"], capsys)
    assert_user_error(code, err, "notes.txt")
    assert os.listdir(out) == ["notes.txt"]


def test_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    code, _, err = run_cli(["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1",
                            "--out", out, "--overwrite"], capsys)
    assert_user_error(code, err, "not a folder")
    assert out.read_text() == "x"


@pytest.mark.parametrize("existing", [False, True])
def test_failure_while_writing_leaves_nothing_behind(tmp_path, capsys, monkeypatch, existing):
    """The second parquet write fails: no new folder, no staging folder, and an
    overwritten run stays as it was."""
    out = tmp_path / "deep" / "run"
    if existing:
        out.mkdir(parents=True)
        (out / "summary.json").write_text("old")
    before = sorted(os.listdir(tmp_path))
    real_write = run_folder._write_parquet
    calls = []

    def failing_write(frame, path, config_json, options=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        real_write(frame, path, config_json, options)

    monkeypatch.setattr(run_folder, "_write_parquet", failing_write)
    args = ["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1", "--out", out]
    code, stdout, err = run_cli(args + (["--overwrite"] if existing else []), capsys)
    assert_user_error(code, err, f"cannot write output folder {out}", "No space left on device")
    assert stdout == ""
    assert len(calls) == 2
    assert_nothing_written(tmp_path, before)
    if existing:
        assert os.listdir(out.parent) == ["run"]
        assert os.listdir(out) == ["summary.json"]
        assert (out / "summary.json").read_text() == "old"


# --------------------------------------------------------------------------------------
# bad input: one line, exit code 2, nothing written


def _flags(tmp_path, *extra, trace=TINY_TRACE):
    return ["replay", trace, "--backend", "vllm", "--workers", "1", *extra,
            "--out", tmp_path / "run"]


@pytest.mark.parametrize("engine_args, fragments", [
    ('{"max_num_seq": 8}', ["--engine-args.max_num_seq", "unknown field", "max_num_seqs"]),
    ('{"max_num_seqs": 0}', ["--engine-args.max_num_seqs", ">= 1", "got 0"]),
    ('{"preemption_mode": "random"}', ["--engine-args.preemption_mode", "lifo, fifo"]),
    ('{"block_size": "64"}', ["--engine-args.block_size", "integer"]),
    ('{"timing_model": {"type": "fixed", "prefill_ms": 1}}',
     ["--engine-args.timing_model.decode_ms", "required"]),
    ('{"backend": "trtllm"}', ["--engine-args.backend", "contradicts --backend vllm"]),
    ('[1, 2]', ["--engine-args", "JSON object"]),
    ('{"max_num_seqs": 8', ["--engine-args", "not valid JSON"]),
    ('{"prefill_decode_interval": 2}', ["--engine-args.prefill_decode_interval", "SGLang only"]),
    ('{"prefill_decode_interval": -1}', ["--engine-args.prefill_decode_interval", ">= 0"]),
])
def test_bad_engine_args(tmp_path, capsys, engine_args, fragments):
    code, _, err = run_cli(_flags(tmp_path, "--engine-args", engine_args), capsys)
    assert_user_error(code, err, *fragments)
    assert_nothing_written(tmp_path, [])


@pytest.mark.parametrize("extra, fragments", [
    (["--workers", "0"], ["--workers", ">= 1"]),
    (["--concurrency", "0"], ["--concurrency", ">= 1"]),
    (["--trace-block-size", "0"], ["--trace-block-size", ">= 1"]),
    (["--arrival-speedup-ratio", "0"], ["--arrival-speedup-ratio", "> 0"]),
    (["--arrival-speedup-ratio", "nan"], ["--arrival-speedup-ratio", "> 0"]),
    (["--workers", "two"], ["--workers", "invalid int value"]),
    (["--backend", "tensorrt"], ["--backend", "invalid choice"]),
])
def test_bad_flag_values(tmp_path, capsys, extra, fragments):
    code, _, err = run_cli(_flags(tmp_path, *extra), capsys)
    assert_user_error(code, err, *fragments)
    assert_nothing_written(tmp_path, [])


@pytest.mark.parametrize("argv, fragments", [
    (["replay", "--out", "x"], ["--backend and --workers are required"]),
    (["replay", "--backend", "vllm", "--out", "x"], ["--workers is required"]),
    (["replay", "--backend", "vllm", "--workers", "1"], ["required", "--out"]),
    (["replay", "--spec", TINY_SPEC, "--workers", "2", "--out", "x"],
     ["--workers cannot be combined with --spec"]),
    (["replay", TINY_TRACE, "--spec", TINY_SPEC, "--out", "x"], ["--trace PATH"]),
    (["replay", TINY_TRACE, "--trace", TINY_TRACE, "--backend", "vllm", "--workers", "1",
      "--out", "x"], ["not both"]),
    ([], ["required", "COMMAND"]),
    (["simulate"], ["invalid choice"]),
])
def test_usage_errors(tmp_path, capsys, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert_user_error(code, err, *fragments)
    assert_nothing_written(tmp_path, [])


BAD_TRACE_LINES = [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]', "invalid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}', '"hash_ids"'),
    ('{"timestamp": 0, "input_length": -5, "output_length": 2, "hash_ids": [1]}',
     '"input_length"'),
]


@pytest.mark.parametrize("bad_line, fragment", BAD_TRACE_LINES)
def test_malformed_trace_line_names_file_and_line(tmp_path, capsys, bad_line, fragment):
    trace = tmp_path / "bad.jsonl"
    good = TINY_TRACE.read_text().splitlines()
    trace.write_text("\n".join(good[:2] + [bad_line] + good[3:]) + "\n")
    code, _, err = run_cli(_flags(tmp_path, trace=trace), capsys)
    assert_user_error(code, err, f"{trace}:3:", fragment)
    assert_nothing_written(tmp_path, ["bad.jsonl"])


def test_malformed_trace_through_spec(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": "2", "hash_ids": [1]}\n')
    code, _, err = run_cli(["replay", "--spec", TINY_SPEC, "--trace", trace,
                            "--out", tmp_path / "run"], capsys)
    assert_user_error(code, err, f"{trace}:1:", '"output_length"')
    assert_nothing_written(tmp_path, ["bad.jsonl"])


def test_missing_and_empty_files(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    cases = [
        (_flags(tmp_path, trace=tmp_path / "nope.jsonl"), ["nope.jsonl", "not found"]),
        (_flags(tmp_path, trace=tmp_path), ["folder"]),
        (_flags(tmp_path, trace=empty), ["empty.jsonl", "no requests"]),
        (["replay", "--spec", tmp_path / "nope.json", "--out", tmp_path / "run"],
         ["spec file not found", "nope.json"]),
    ]
    for argv, fragments in cases:
        code, _, err = run_cli(argv, capsys)
        assert_user_error(code, err, *fragments)
    assert_nothing_written(tmp_path, ["empty.jsonl"])


def _spec_copy(tmp_path, edit):
    payload = json.loads(TINY_SPEC.read_text())
    edit(payload)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(payload))
    return path


@pytest.mark.parametrize("edit, fragments", [
    (lambda p: p["spec"]["engine"]["rank"].update(max_num_seqs=-1),
     ["spec.engine.rank.max_num_seqs", ">= 1"]),
    (lambda p: p["spec"]["engine"]["rank"].update(speculative=True),
     ["spec.engine.rank.speculative", "unknown field"]),
    (lambda p: p["spec"]["topology"].update(kind="disaggregated"),
     ["spec.topology.workers", "unknown field for a disaggregated topology"]),
    (lambda p: p["spec"]["engine"].update(tensor_parallel_size=0),
     ["spec.engine.tensor_parallel_size"]),
    (lambda p: p["traffic"].update(trace_path="missing.jsonl"), ["missing.jsonl", "not found"]),
    (lambda p: p["spec"].update(engine=[1]), ["spec.engine: must be an object"]),
    (lambda p: p.update(spec=7), ["spec: must be an object"]),
    (lambda p: p.pop("spec"), ["must be an object with 'spec'"]),
    (lambda p: p["spec"].update(adapters={"placement": {"provider": "least_loaded"}}),
     ["spec.adapters.placement.provider", "round_robin, random"]),
    (lambda p: p["spec"].update(adapters={"placement": {"provider": "round_robin",
                                                        "config": {"seed": 1}}}),
     ["spec.adapters.placement.config.seed", "unknown field for placement 'round_robin'"]),
    (lambda p: p["spec"].update(adapters={"placement": {"provider": "random",
                                                        "config": {"seed": -1}}}),
     ["spec.adapters.placement.config.seed", ">= 0"]),
    (lambda p: p.update(extras={}), ["extras: unknown field of the payload", "determinism, spec, tokenization, traffic"]),
    (lambda p: p.update(determinism="seeded"), ["determinism: must be one of canonical_v1, random"]),
    (lambda p: p["spec"].pop("engine"), ["spec.engine: required"]),
])
def test_bad_spec(tmp_path, capsys, edit, fragments):
    spec = _spec_copy(tmp_path, edit)
    code, _, err = run_cli(["replay", "--spec", spec, "--out", tmp_path / "run"], capsys)
    assert_user_error(code, err, *fragments)
    assert_nothing_written(tmp_path, ["spec.json"])


def test_spec_that_is_not_json(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text("{not json")
    code, _, err = run_cli(["replay", "--spec", spec, "--out", tmp_path / "run"], capsys)
    assert_user_error(code, err, str(spec), "not valid JSON")
    assert_nothing_written(tmp_path, ["spec.json"])


def test_simulation_dead_end_is_reported(tmp_path, capsys):
    """17 blocks of 64 tokens: some tiny20 request can never fit (SimulationError)."""
    code, stdout, err = run_cli(_flags(tmp_path, "--engine-args", '{"num_gpu_blocks": 17}'),
                                capsys)
    assert_user_error(code, err, "dead end", "outgrows its KV pool")
    assert stdout == ""
    assert_nothing_written(tmp_path, [])


def test_rejections_are_counted(tmp_path, capsys):
    """18 blocks: four prompts cannot fit and are rejected; the run still completes."""
    out = tmp_path / "run"
    code, stdout, err = run_cli(_flags(tmp_path, "--engine-args", '{"num_gpu_blocks": 18}',
                                       "--no-passes"), capsys)
    assert code == 0, err
    assert "16 completed, 4 rejected" in stdout
    req = run_folder.read_requests(out)
    assert (req["terminal_status"] == "rejected").sum() == 4
    summary = run_folder.read_summary(out)
    assert summary["num_requests"] == 20 and summary["completed_requests"] == 16


def test_gpu_hours_follow_tensor_parallel_size(tmp_path, capsys):
    """gpu_hours = decode worker-seconds x TP x DP / 3600 (spec replay.md 12.7)."""
    spec = _spec_copy(tmp_path, lambda p: (p["spec"]["engine"].update(tensor_parallel_size=2),
                                           p["traffic"].update(trace_path=str(TINY_TRACE))))
    out = tmp_path / "run"
    code, _, err = run_cli(["replay", "--spec", spec, "--out", out, "--no-passes"], capsys)
    assert code == 0, err
    summary = run_folder.read_summary(out)
    golden = golden_report(TINY_REPORT)
    assert summary["decode_gpus_per_worker"] == 2 and summary["prefill_gpus_per_worker"] == 0
    assert summary["gpu_hours"] == pytest.approx(2 * golden["gpu_hours"], rel=SUMMARY_REL_TOL)


def test_random_placement_flags(tmp_path, capsys):
    """--placement random with a seed runs and records the policy; the seed alone is a
    usage error; the same seed gives the same run."""
    out = []
    for name in ("a", "b"):
        code, _, err = run_cli(_flags(tmp_path / name, "--workers", "3", "--placement", "random",
                                      "--placement-seed", "9"), capsys)
        assert code == 0, err
        out.append(pd.read_parquet(tmp_path / name / "run" / "requests.parquet"))
    pd.testing.assert_frame_equal(out[0], out[1])
    assert out[0]["worker"].nunique() > 1
    code, _, err = run_cli(_flags(tmp_path / "c", "--workers", "3", "--placement-seed", "9"), capsys)
    assert_user_error(code, err, "--placement-seed needs --placement random")


def test_warmup_compiles_and_reports(capsys):
    code, out, err = run_cli(["warmup", "--topology", "aggregated"], capsys)
    assert code == 0, err
    assert out.startswith("aggregated") and "ready" in out


def test_warmup_of_the_rank_protocol(capsys):
    code, out, err = run_cli(["warmup", "--topology", "rank"], capsys)
    assert code == 0, err
    assert out.startswith("rank") and "ready" in out


def test_cache_lock_is_exclusive_across_processes(tmp_path, monkeypatch):
    """Kernels compile under the cache folder's lock: a process that holds it keeps
    another from taking it until it lets go (two processes compiling versions of one
    kernel at once corrupt Numba's cache index)."""
    from aisim_fast.kernels import jit

    monkeypatch.setattr(jit.numba.config, "CACHE_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         f"fh = open({str(tmp_path / 'compile.lock')!r}, 'a')\n"
         "fcntl.flock(fh, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(1.0)\n"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start_s = time.perf_counter()
    with jit.cache_lock():
        waited_s = time.perf_counter() - start_s  # until the holder's exit released it
    holder.wait()
    assert waited_s > 0.5


def test_cache_lock_nests_within_a_thread(tmp_path, monkeypatch):
    """A compile under the lock that loads more kernels (which take the lock too) goes
    on: the nested call does not wait for its own caller."""
    import threading

    from aisim_fast.kernels import jit

    monkeypatch.setattr(jit.numba.config, "CACHE_DIR", str(tmp_path))
    done = threading.Event()

    def nested():
        with jit.cache_lock():
            with jit.cache_lock():
                pass
            with jit.cache_lock():
                done.set()

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(10.0)
    assert done.is_set(), "a nested cache_lock waited for its own caller"
    with jit.cache_lock():  # released: taken again at once
        pass


def test_compile_notice_once_per_missing_kernel_set(tmp_path, capsys, monkeypatch):
    """One stderr line naming the kernel sets a cache does not hold, before compiling;
    nothing once they are marked compiled (or already announced)."""
    import numba

    from aisim_fast.kernels import jit
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_ANNOUNCED", set())
    jit.compile_notice(["trace", "aggregated"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "compiling kernels for the trace loader, aggregated replay (first run only" in err
    jit.compile_notice(["aggregated"])
    assert capsys.readouterr().err == ""
    jit.mark_compiled("disaggregated")
    monkeypatch.setattr(jit, "_ANNOUNCED", set())
    jit.compile_notice(["disaggregated"])
    assert capsys.readouterr().err == ""
    # another checkout of the same sources compiles anew (Numba keys its cache by the
    # sources' location): the first one's marker does not silence its notice
    monkeypatch.setattr(jit, "_HERE", tmp_path / "another_checkout" / "kernels")
    monkeypatch.setattr(jit, "_ANNOUNCED", set())
    jit.compile_notice(["disaggregated"])
    assert "compiling kernels for disaggregated replay" in capsys.readouterr().err


def test_events_flag_writes_both_event_tables(tmp_path, capsys):
    """--events: kv_events.parquet and engine_events.parquet beside the run files, one
    finish per request and one admission per admission of the request records; a later
    --overwrite run without --events may replace the folder."""
    code, out, err = run_cli(_flags(tmp_path, "--workers", "2", "--events"), capsys)
    assert code == 0, err
    run = tmp_path / "run"
    kv = pd.read_parquet(run / "kv_events.parquet")
    engine = pd.read_parquet(run / "engine_events.parquet")
    requests = pd.read_parquet(run / "requests.parquet")
    assert "kv_events.parquet" in out and "engine_events.parquet" in out
    assert set(kv["kind"]) <= {"stored", "removed"} and (kv["kind"] == "stored").any()
    assert (engine["kind"] == "finished").sum() == len(requests)
    assert (engine["kind"] == "admitted").sum() == requests["admission_count"].sum()
    assert json.loads((run / "summary.json").read_text())["aisim_fast.config"]["record_events"] is True
    code, _, err = run_cli(_flags(tmp_path, "--overwrite"), capsys)
    assert code == 0, err


def test_kv_events_flag_and_spec_field_write_the_kv_event_stream(tmp_path, capsys):
    """--kv-events writes kv_events.parquet alone (no engine events), as the reference's
    stream: one row per block, events numbered per worker, Removed events of a tight
    pool. ``emit_kv_events: true`` in a spec's rank does the same, and
    ``emit_kv_token_ids`` adds each Stored block's tokens (list<uint32>)."""
    folder = support.paths.DATA_DIR / "kv_events" / "kvp16"
    argv = ["replay", "--spec", folder / "spec.json", "--out", tmp_path / "run", "--no-passes"]
    code, out, err = run_cli([*argv, "--kv-events"], capsys)
    assert code == 0, err
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["kv_events.parquet", "requests.parquet",
                                                     "summary.json"]
    kv = pd.read_parquet(run / "kv_events.parquet")
    assert list(kv.columns) == ["worker", "dp_rank", "event_id", "at_ms", "kind", "position",
                                "block_hash", "parent_hash", "tokens_hash"]
    assert kv.groupby("kind")["event_id"].nunique().to_dict() == {"removed": 171, "stored": 190}
    spec = json.loads((folder / "spec.json").read_text())
    spec["traffic"]["trace_path"] = str(folder / "trace.jsonl")
    spec["spec"]["engine"]["rank"].update(emit_kv_events=True, emit_kv_token_ids=True)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code, _, err = run_cli(["replay", "--spec", tmp_path / "spec.json", "--out", tmp_path / "run2",
                            "--no-passes"], capsys)
    assert code == 0, err
    with_ids = pd.read_parquet(tmp_path / "run2" / "kv_events.parquet")
    pd.testing.assert_frame_equal(with_ids.drop(columns="token_ids"), kv)
    assert str(pq.read_schema(tmp_path / "run2" / "kv_events.parquet").field("token_ids").type) \
        == "list<element: uint32>"
    stored = with_ids[with_ids["kind"] == "stored"]
    assert all(len(ids) == 16 for ids in stored["token_ids"])
    # an SGLang rank logs its radix cache's pages (num_gpu_blocks counts one-token pages)
    spec["spec"]["engine"]["rank"].update(backend="sglang", block_size=1, num_gpu_blocks=4000,
                                          emit_kv_token_ids=False)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code, _, err = run_cli(["replay", "--spec", tmp_path / "spec.json", "--out", tmp_path / "run3"],
                           capsys)
    assert code == 0, err
    radix = pd.read_parquet(tmp_path / "run3" / "kv_events.parquet")
    assert list(radix.columns) == list(kv.columns)
    assert set(radix["kind"]) == {"stored", "removed"}


def test_pressure_events_flag_writes_every_retraction(tmp_path, capsys):
    """--pressure-events on an SGLang reference run (sx-r1, 11 re-admissions in the
    reference): one row per retraction, counted in summary.json and the printout;
    --events adds the radix cache's KV events and the engine events."""
    folder = support.paths.DATA_DIR / "golden_sglang" / "sx-r1"
    argv = ["replay", "--spec", folder / "spec.json", "--trace", folder / "trace.jsonl",
            "--out", tmp_path / "run", "--no-passes"]
    code, out, err = run_cli([*argv, "--pressure-events"], capsys)
    assert code == 0, err
    run = tmp_path / "run"
    pressure = pd.read_parquet(run / "pressure_events.parquet")
    summary = json.loads((run / "summary.json").read_text())
    assert len(pressure) == 11 and set(pressure["kind"]) == {"sglang_retraction"}
    assert summary["sglang_retractions_total"] == 11 and summary["vllm_preemptions_total"] == 0
    assert "KV pressure         11 retractions" in out and "pressure_events.parquet" in out
    assert sorted(p.name for p in run.iterdir()) == ["pressure_events.parquet", "requests.parquet",
                                                     "summary.json"]
    code, _, err = run_cli([*argv, "--overwrite", "--events"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in run.iterdir()) == [
        "engine_events.parquet", "kv_events.parquet", "pressure_events.parquet", "requests.parquet",
        "summary.json"]
    pd.testing.assert_frame_equal(pd.read_parquet(run / "pressure_events.parquet"), pressure)


def test_events_flag_writes_pressure_events_of_a_tight_pool(tmp_path, capsys):
    """--events on a vLLM run that preempts: pressure_events.parquet has one row per
    preemption of the request records, with the states around it."""
    code, out, err = run_cli(_flags(tmp_path, "--events", "--engine-args",
                                    '{"num_gpu_blocks": 40, "max_num_seqs": 8}'), capsys)
    assert code == 0, err
    run = tmp_path / "run"
    pressure = pd.read_parquet(run / "pressure_events.parquet")
    requests = pd.read_parquet(run / "requests.parquet")
    summary = json.loads((run / "summary.json").read_text())
    assert len(pressure) == requests["preemptions"].sum() == summary["vllm_preemptions_total"] > 0
    assert set(pressure["kind"]) == {"vllm_preemption"}
    assert (pressure["waiting_after"] == pressure["waiting_before"] + 1).all()
    assert pressure["required_blocks_before"].isna().all()
    assert f"KV pressure         {len(pressure)} preemptions" in out


def test_output_events_flag_writes_every_token(tmp_path, capsys):
    """--output-events: output_events.parquet with one row per output token of the
    request records, and no other event table."""
    code, out, err = run_cli(_flags(tmp_path, "--workers", "2", "--output-events"), capsys)
    assert code == 0, err
    run = tmp_path / "run"
    tokens = pd.read_parquet(run / "output_events.parquet")
    requests = pd.read_parquet(run / "requests.parquet")
    assert "output_events.parquet" in out and not (run / "kv_events.parquet").exists()
    assert len(tokens) == requests["output_tokens"].sum()
    assert tokens["last"].sum() == (requests["output_tokens"] > 0).sum()


def test_progress_line_of_a_long_replay(tmp_path, capsys, monkeypatch):
    """A replay longer than the progress delay reports requests done and simulated time
    on stderr (plain lines when stderr is not a terminal); --quiet silences it."""
    from aisim_fast.engine import batch_run

    monkeypatch.setattr(commands, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(batch_run, "PROGRESS_SLICE_S", 1e-6)
    code, _, err = run_cli(_flags(tmp_path), capsys)
    assert code == 0, err
    assert "aisim-fast: 20/20 requests, t=" in err and "s simulated" in err
    code, _, err = run_cli(_flags(tmp_path, "--overwrite", "--quiet"), capsys)
    assert code == 0 and "requests, t=" not in err


def test_out_is_probed_before_the_simulation(tmp_path, capsys):
    """An --out under a file fails at once, naming the file; nothing is created."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_cli(["replay", TINY_TRACE, "--backend", "vllm", "--workers", "1",
                            "--out", blocker / "sub" / "run"], capsys)
    assert code == 2 and f"{blocker} is a file, not a folder" in err
    assert sorted(os.listdir(tmp_path)) == ["file"]


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_staging_of_dead_runs_is_removed(tmp_path, capsys):
    """A staging folder left by a killed run (its pid is gone) is removed by the next
    run that writes into the same parent folder, whatever --out that run had; one of a
    live process is left alone."""
    dead = tmp_path / f".run.partial-{_dead_pid()}-0123abcd"
    dead_elsewhere = tmp_path / f".other_run.partial-{_dead_pid()}-89abcdef"
    live = tmp_path / f".run.partial-{os.getppid()}-4567cdef"
    for folder in (dead, dead_elsewhere, live):
        folder.mkdir()
        (folder / "passes.parquet").write_bytes(b"truncated")
    code, _, err = run_cli(_flags(tmp_path), capsys)
    assert code == 0, err
    assert not dead.exists() and not dead_elsewhere.exists() and live.exists()
    assert run_folder.read_requests(tmp_path / "run").shape[0] == 20


def test_sigterm_during_a_replay_leaves_nothing_half_written(tmp_path):
    """SIGTERM at a few moments of a replay (compiling, simulating, writing): exit 143
    or a finished run; --out is absent or complete, and no staging folder is left."""
    trace = str(support.paths.DATA_DIR / "traces" / "mooncake_10k.jsonl")
    for delay_s in (0.5, 1.5, 2.5, 3.5):
        out = tmp_path / f"run{delay_s}"
        proc = subprocess.Popen([sys.executable, "-m", "aisim_fast", "replay", trace, "--backend", "vllm",
                                 "--workers", "2", "--events", "--output-events", "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        # -15: still importing, before the handler exists (nothing can have been written)
        assert proc.returncode in (0, 143, -signal.SIGTERM), err.decode()[-2000:]
        assert b"Traceback" not in err
        if proc.returncode == 143:
            assert b"interrupted; nothing written" in err
        if proc.returncode != 0:
            assert not out.exists()
        else:
            assert run_folder.read_requests(out).shape[0] == 10000
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _replay_signalled_inside(function: str, sig: str, out: Path, after: str = ""):
    """A tiny replay to ``out`` in a child process that sends itself ``sig`` from inside
    ``run_folder.<function>``, right after that function did its work (so the signal lands
    there every time); ``after`` runs once the CLI returned. Returns the finished child."""
    script = f"""
import os, signal, sys
from aisim_fast.cli import app as cli
from aisim_fast.io import run_folder
original = run_folder.{function}
def then_signal(*args):
    original(*args)
    os.kill(os.getpid(), signal.{sig})
    sum(range(100000))  # bytecode, where a Python handler runs
run_folder.{function} = then_signal
sys.argv = ["aisim-fast", "replay", {str(TINY_TRACE)!r}, "--backend", "vllm", "--workers", "1",
            "--out", {str(out)!r}]
code = cli.main()
{after}
sys.exit(code)
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)


def test_sigkill_during_a_replay_leaves_out_absent_or_complete(tmp_path):
    """SIGKILL (no handler can run) during the simulation at a few moments, and once in
    the middle of writing (sent from inside the writer, after its first file): --out is
    absent or a complete, readable run, and the staging folder the killed writer left
    is removed by the next run that writes there."""
    trace = str(support.paths.DATA_DIR / "traces" / "mooncake_10k.jsonl")
    for delay_s in (0.8, 1.2, 1.6):
        out = tmp_path / f"run{delay_s}"
        proc = subprocess.Popen([sys.executable, "-m", "aisim_fast", "replay", trace, "--backend", "vllm",
                                 "--workers", "2", "--events", "--out", str(out), "--quiet"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay_s)
        proc.kill()
        proc.wait(timeout=60)
        if out.exists():
            assert run_folder.read_requests(out).shape[0] == 10000
            assert (out / "summary.json").exists() and (out / "kv_events.parquet").exists()
    killed = tmp_path / "killed_while_writing"
    proc = _replay_signalled_inside("_write_parquet", "SIGKILL", killed)
    assert proc.returncode == -signal.SIGKILL
    assert not killed.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".killed_while_writing.partial-")]
    # the next run to each folder clears the staging folders of the dead processes
    for out in [killed, *(tmp_path / f"run{d}" for d in (0.8, 1.2, 1.6))]:
        code = cli.main(["replay", str(TINY_TRACE), "--backend", "vllm", "--workers", "1", "--out",
                         str(out), "--overwrite", "--quiet"])
        assert code == 0 and run_folder.read_requests(out).shape[0] == 20
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sigterm_at_the_commit_completes_the_run(tmp_path):
    """A SIGTERM that lands while the run folder is renamed into place (sent from inside
    the rename, so it lands there every time): the run completes and exits 0; it is
    neither half-removed nor reported as interrupted. After the run is written the
    process ignores SIGTERM: the interpreter's shutdown would otherwise reset the
    handler and a late signal would kill a process whose run is complete."""
    out = tmp_path / "run"
    proc = _replay_signalled_inside("_rename_into_place", "SIGTERM", out,
                                    after="assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert run_folder.read_requests(out).shape[0] == 20
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_run_that_completes_nothing_is_an_error(tmp_path, capsys):
    """Every request rejected: exit 2 with the rejections by cause, nothing written
    (not a summary of zero latencies)."""
    code, _, err = run_cli(_flags(tmp_path, "--engine-args", '{"num_gpu_blocks": 4, "max_model_len": 900}'),
                           capsys)
    assert code == 2
    assert "no request completed: of 20" in err and "max_model_len (900)" in err
    assert "do not fit the KV pool (4 blocks x 64 tokens)" in err
    assert not (tmp_path / "run").exists()


def test_partial_rejections_are_counted_by_cause(tmp_path, capsys):
    """Some requests rejected: the run goes on, and both the printout and the summary
    say how many and why."""
    code, out, _ = run_cli(_flags(tmp_path, "--engine-args", '{"max_model_len": 1000}'), capsys)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    causes = summary["rejected_by_cause"]
    assert causes["max_model_len"] > 0 and causes["kv_pool"] == 0
    assert summary["completed_requests"] == summary["num_requests"] - causes["max_model_len"]
    assert f"rejected            {causes['max_model_len']} with a prompt of max_model_len (1000)" in out


def test_lenient_trace_rows_are_one_warning_line_each(tmp_path, capsys):
    """A trace the reference accepts but that looks wrong (rows without input_length, a
    misspelt field) runs as the reference runs it, with one warning line per kind on
    stderr naming the first such line; nothing else is printed there."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "output_length": 3, "hash_ids": [1], "ouput_length": 3}\n'
                     '{"timestamp": 5, "output_length": 2, "hash_ids": [2]}\n')
    code, _, err = run_cli(_flags(tmp_path, trace=trace), capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "compiling" not in line]
    assert len(lines) == 2, err
    assert lines[0].startswith(f'aisim-fast: warning: {trace}:1: no "input_length"')
    assert "2 rows like this one" in lines[0]
    assert lines[1].startswith(f"aisim-fast: warning: {trace}:1: unknown field 'ouput_length' ignored")


def test_passes_file_is_the_pass_log_written_in_parts(tmp_path, capsys, monkeypatch):
    """passes.parquet is written from the drained pass log part by part (row groups,
    never one frame): a run split per worker has its rows grouped by worker, each in
    time order, and the same rows as the in-memory pass table; tiny row groups give
    the same file content."""
    from aisim_fast.engine import batch
    from aisim_fast.engine.batch import run_batch
    from aisim_fast.engine.simulation import simulation_from_setup
    monkeypatch.setattr(run_folder, "ROW_GROUP_ROWS", 50)
    monkeypatch.setattr(batch, "PASS_PART_ROWS", 20)
    code, _, err = run_cli(_flags(tmp_path, "--workers", "3"), capsys)
    assert code == 0, err
    written = run_folder.read_passes(tmp_path / "run")
    assert pq.ParquetFile(tmp_path / "run" / "passes.parquet").metadata.num_row_groups > 1
    assert run_folder.read_metadata(tmp_path / "run" / "passes.parquet")["aisim_fast.version"] == aisim_fast.__version__
    worker = written["worker"].to_numpy()
    assert (np.diff(worker) >= 0).all() and set(worker) == {0, 1, 2}
    for w in range(3):
        assert (np.diff(written.loc[worker == w, "start_ms"].to_numpy()) >= 0).all()
    # the same rows as the batch result's table (sorted by time there)
    argv = [str(a) for a in _flags(tmp_path, "--workers", "3")]
    from aisim_fast.cli.commands import load_setup_trace
    from aisim_fast.cli.flags import setup_from_flags
    from aisim_fast.cli.parser import build_parser
    setup = setup_from_flags(build_parser().parse_args(argv))[0]
    sim = simulation_from_setup(setup, load_setup_trace(setup))
    table = run_batch([sim]).check().passes[0]
    by_time = written.sort_values(["start_ms", "worker"], kind="stable", ignore_index=True)
    # the file has the table's columns, the attention-DP rank moved after the worker
    pd.testing.assert_frame_equal(by_time, table[list(written.columns)], check_exact=True)


def test_disaggregated_attention_dp_flags_reproduce_the_spec_run(tmp_path, capsys):
    """--prefill-dp-size / --decode-dp-size give the pools' ranks as the spec's
    engine.prefill.dp_size / engine.decode.dp_size do (reference run d_v_p2d2)."""
    case = support.paths.DATA_DIR / "attention_dp" / "d_v_p2d2"
    trace = str(support.paths.DATA_DIR / "traces" / "mooncake_1k.jsonl")
    code, _, err = run_cli(["replay", "--spec", case / "spec.json", "--trace", trace, "--no-passes",
                            "--out", tmp_path / "spec"], capsys)
    assert code == 0, err
    code, stdout, err = run_cli(["replay", trace, "--backend", "vllm", "--prefill-workers", "1",
                                 "--decode-workers", "2", "--prefill-dp-size", "2", "--decode-dp-size", "2",
                                 "--no-passes", "--out", tmp_path / "flags"], capsys)
    assert code == 0, err
    assert ("1 prefill + 2 decode vllm worker(s), attention DP 2 / 2 ranks per prefill / decode "
            "worker") in stdout
    flags_req = run_folder.read_requests(tmp_path / "flags")
    assert {"dp_rank", "prefill_dp_rank"} <= set(flags_req.columns)
    pd.testing.assert_frame_equal(flags_req, run_folder.read_requests(tmp_path / "spec"))
    code, _, err = run_cli(["replay", trace, "--backend", "vllm", "--prefill-workers", "1",
                            "--decode-workers", "2", "--dp-size", "2", "--out", tmp_path / "bad"], capsys)
    assert_user_error(code, err, "--dp-size", "--prefill-dp-size and --decode-dp-size")


def test_request_tables_are_written_without_dictionary_pages(tmp_path, capsys):
    """Per-request rows (unique ids, distinct times) are plain-encoded: a dictionary
    would only cost time and bytes (run_folder.REQUEST_TABLE_OPTIONS)."""
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    code, _, err = run_cli(["replay", str(TINY_TRACE), "--backend", "vllm", "--workers", "2",
                            "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    meta = pq.ParquetFile(out / "requests.parquet").metadata
    encodings = {e for g in range(meta.num_row_groups) for c in range(meta.num_columns)
                 for e in meta.row_group(g).column(c).encodings}
    assert meta.num_rows == 20 and not any("DICTIONARY" in e for e in encodings), encodings


def test_replay_sla_reports_goodput_and_a_verdict(tmp_path, capsys):
    """--sla: the per-request bounds act as the spec's sla (the reference's goodput keys,
    equal to a payload carrying them), the other terms judge the summary; both land in
    summary.json's sla_verdict and on the console."""
    from aisim_fast.report.sla import parse_sla

    code, out, err = run_cli(_flags(tmp_path, "--sla", "ttft_ms=5000,itl_p90_ms=1"), capsys)
    assert code == 0, err
    summary = run_folder.read_summary(tmp_path / "run")
    spec = _spec_copy(tmp_path, lambda p: p["spec"].update(sla={"ttft_ms": 5000}))
    code, _, err = run_cli(["replay", "--spec", spec, "--trace", TINY_TRACE, "--out", tmp_path / "s"], capsys)
    assert code == 0, err
    reference_form = run_folder.read_summary(tmp_path / "s")
    for key in ("goodput_completed_requests", "goodput_request_throughput_rps", "goodput_output_throughput_tok_s"):
        assert summary[key] == reference_form[key]
    verdict = summary["sla_verdict"]
    assert verdict["failed"] == ["itl_p90_ms"] and not verdict["ok"]
    assert verdict["values"]["itl_p90_ms"] == summary["p90_itl_ms"]
    assert parse_sla(verdict["terms"]).judge(summary).failed == ("itl_p90_ms",)
    assert "SLA                 missed: ttft_ms=5000,itl_p90_ms=1,goodput=0.99 (itl_p90_ms" in out
    assert "goodput             20 good requests" in out


@pytest.mark.parametrize("edit, warning", [
    (lambda p: p.update(determinism="random"), "determinism: 'random' runs as canonical_v1"),
    (lambda p: p["spec"]["topology"].update(colour=3),
     "spec.topology.colour: unknown field, ignored (the reference ignores it too)"),
])
def test_what_the_reference_accepts_and_ignores_runs_with_one_warning(tmp_path, capsys, edit, warning):
    """Reference runs of these payloads give the rows of the plain one (checked by hand
    with benchmarks/ref_payload_run.py); here too, with the reason said once."""
    code, _, err = run_cli(["replay", "--spec", _spec_copy(tmp_path, edit), "--trace", TINY_TRACE,
                            "--out", tmp_path / "w"], capsys)
    assert code == 0 and err.count(warning) == 1
    code, _, _ = run_cli(["replay", "--spec", _spec_copy(tmp_path, lambda p: None), "--trace", TINY_TRACE,
                          "--out", tmp_path / "plain"], capsys)
    pd.testing.assert_frame_equal(run_folder.read_requests(tmp_path / "w"),
                                  run_folder.read_requests(tmp_path / "plain"))


def test_an_sglang_dead_end_says_its_pool_counts_tokens(tmp_path, capsys):
    code, _, err = run_cli(["replay", "--backend", "sglang", "--workers", "2", "--out", tmp_path / "o"], capsys)
    assert_user_error(code, err, "dead end at", "SGLang's num_gpu_blocks counts pages of block_size (1) tokens",
                      "holds 16,384 tokens")


def test_ctrl_c_during_a_first_compile_exits_at_once_with_one_line(tmp_path):
    """A cold kernel cache: Ctrl-C while LLVM compiles is honoured within seconds (the
    compile alone takes tens), with the one interrupted line and no traceback."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cold_cache"))
    proc = subprocess.Popen([sys.executable, "-m", "aisim_fast", "replay", "--backend", "vllm", "--workers", "1",
                             "--out", str(tmp_path / "o")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while "compiling kernels for aggregated replay" not in seen:
            line = proc.stderr.readline()
            assert line, f"ended before compiling: {seen}"
            seen += line
        time.sleep(1.0)  # inside the compile
        proc.send_signal(signal.SIGINT)
        sent_s = time.monotonic()
        _, err = proc.communicate(timeout=60)
        waited_s = time.monotonic() - sent_s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted; nothing written" in err and "Traceback" not in err
    assert waited_s < 10.0, f"{waited_s:.1f} s after Ctrl-C"
    assert not (tmp_path / "o").exists()


def test_stdout_is_line_buffered_into_a_log():
    probe = ("import sys; from aisim_fast.cli.app import main; sys.argv = ['aisim-fast', 'models', '--grep', 'zz-none'];"
             " code = main(); print(sys.stdout.line_buffering, code, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().endswith("True 0"), done.stderr


def test_performance_diagnostics_flag_without_passes_file(tmp_path, capsys):
    """``--performance-diagnostics`` puts the reference's performance_diagnostics in
    summary.json (summed over the pass log, kept in memory under --no-passes); a
    polynomial pool reports both phases unobserved, as the reference does (the
    op-level values against the reference: tests/golden/test_cli_payloads.py)."""
    assert cli.main([str(a) for a in _flags(tmp_path, "--performance-diagnostics", "--no-passes", "--quiet")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not (tmp_path / "run" / "passes.parquet").exists()
    diagnostics = summary["performance_diagnostics"]
    assert diagnostics["status"] == "not_observed"
    assert diagnostics["scope"] == "accumulated_active_forward_pass_per_gpu"
    assert [p["name"] for p in diagnostics["phases"]] == ["prefill", "decode"]
    assert all(p["sol"] is None and p["operations"] == [] for p in diagnostics["phases"])
    assert cli.main([str(a) for a in _flags(tmp_path, "--overwrite", "--quiet")]) == 0
    assert "performance_diagnostics" not in json.loads((tmp_path / "run" / "summary.json").read_text())
