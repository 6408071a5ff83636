"""Sizing over time (studies/over_time.py): windows cut by session start, each sized on
its own; replicas(t), its totals, the command's files and exit codes."""

from __future__ import annotations

import json

import pandas as pd

from aisim_fast.cli.app import main
from aisim_fast.studies.over_time import size_over_time, window_traces
from aisim_fast.studies.sizing import size
from support.paths import DATA_DIR

SPEC = DATA_DIR / "golden" / "1k_vllm_agg2.spec.json"
SESSIONS = DATA_DIR / "sessions_200.jsonl"
ONE_K = DATA_DIR / "traces" / "mooncake_1k.jsonl"


def _rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def test_windows_keep_sessions_whole_and_shift_their_start(tmp_path):
    rows = _rows(SESSIONS)
    windows = window_traces(SESSIONS, 20_000.0, tmp_path)
    assert sum(n for *_, n in windows) == len(rows)
    starts = {}
    for row in rows:
        if "timestamp" in row:
            starts.setdefault(row["session_id"], row["timestamp"])
    for index, start_ms, path, n in windows:
        if path is None:
            assert n == 0
            continue
        got = _rows(path)
        assert len(got) == n
        for row in got:
            if "timestamp" in row:  # a session's first turn, shifted to its window
                assert start_ms + row["timestamp"] == starts[row["session_id"]]
                assert 0 <= row["timestamp"] < 20_000.0
        # every turn of a session is in the window its first turn starts in
        sessions = {row["session_id"] for row in got}
        assert sum(1 for row in rows if row["session_id"] in sessions) == n


def test_each_window_is_its_own_sizing_and_the_totals_add_up(tmp_path):
    sla = "ttft_p90_ms=400,itl_p90_ms=40"
    result = size_over_time(SPEC, sla, window_s=4.0, trace=str(ONE_K), rate=2.0, max_workers=6)
    w = result.windows
    assert len(w) >= 3 and list(w["window"]) == list(range(len(w)))
    assert (w["end_s"] - w["start_s"] == 4.0).all()
    windows = window_traces(ONE_K, 4.0 * 1000 * 2.0, tmp_path)
    for (index, _, path, n), (_, row) in zip(windows, w.iterrows()):
        assert row["requests"] == n
        [alone] = size(SPEC, sla, trace=str(path), rates=(2.0,), max_workers=6)
        assert (bool(row["feasible"]), row["gpus"]) == (alone.feasible, alone.gpus)
    totals = result.totals()
    assert totals["peak_gpus"] == w["gpus"].max() and totals["mean_gpus"] == w["gpus"].mean()
    assert totals["autoscaled_gpu_hours"] == (w["gpus"] * 4.0 / 3600).sum()
    assert totals["static_gpu_hours"] == totals["peak_gpus"] * len(w) * 4.0 / 3600


def test_cli_size_over_time_writes_replicas_and_exits_by_the_answer(tmp_path, capsys):
    args = ["size", "--spec", str(SPEC), "--trace", str(SESSIONS), "--max-workers", "4",
            "--window-s", "30", "--quiet"]
    assert main([*args, "--sla", "ttft_p90_ms=3000", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "GPUs over time (windows of 30 s) meeting ttft_p90_ms=3000" in out and "peak " in out
    replicas = pd.read_parquet(tmp_path / "o" / "replicas.parquet")
    answer = json.loads((tmp_path / "o" / "answer.json").read_text())
    assert answer["over_time"]["peak_gpus"] == replicas["gpus"].max()
    assert (tmp_path / "o" / "replicas.png").stat().st_size > 10_000
    page = (tmp_path / "o" / "report.html").read_text()
    assert "Answer: GPUs over time" in page and f"peak {answer['over_time']['peak_gpus']} GPUs" in page
    assert page.count("data:image/png;base64,") == 2  # replicas(t) and the candidates
    evidence = pd.read_parquet(tmp_path / "o" / "sizing.parquet")
    assert set(evidence["window"]) == set(replicas.loc[replicas["requests"] > 0, "window"])
    assert main([*args, "--sla", "ttft_p90_ms=1"]) == 3
    assert "no candidate within the budget meets the SLA in window(s) 0" in capsys.readouterr().out
    assert main([*args, "--sla", "ttft_p90_ms=1", "--rates", "1,2"]) == 2
    assert "--window-s: sizes one load over time" in capsys.readouterr().err
