"""Sweeps: spec expansion and its errors, batch-vs-alone equality, local processes and
Dask equal to one process, a failing point recorded, resume after a killed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import aisim_fast
from aisim_fast.config.payload import parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.report.summary import summarize_replay
from aisim_fast.studies.sweeps import SweepError, load_sweep, run_sweep
from aisim_fast.trace.workload import load_mooncake
from support.paths import DATA_DIR, REPO_DIR

DATA = DATA_DIR
BASE = {"spec": str(DATA / "golden" / "1k_vllm_agg2.spec.json"),
        "trace": str(DATA / "traces" / "mooncake_tiny20.jsonl")}
SESSIONS = str(DATA / "sessions_200.jsonl")


def _spec(**axes):
    return {"base": dict(BASE), **axes}


# ------------------------------------------------------------------------------------
# expansion
# ------------------------------------------------------------------------------------
def test_grid_zip_shortcuts_and_random_expand_in_order():
    sweep = load_sweep(_spec(
        grid={"spec.engine.rank.max_num_seqs": [8, 16]},
        workers=[1, 3],
        zip={"spec.engine.rank.max_num_batched_tokens": [512, 1024],
             "spec.engine.rank.enable_chunked_prefill": [True, False]},
        random={"samples": 3, "seed": 5, "space": {
            "spec.engine.rank.num_gpu_blocks": {"randint": [100, 4000]},
            "traffic.arrival_speedup_ratio": {"loguniform": [0.5, 8.0]},
            "spec.engine.rank.preemption_mode": {"choice": ["lifo", "fifo"]}}}))
    assert len(sweep.points) == 2 * 2 * 2 * 3
    assert sweep.columns == ("spec.engine.rank.max_num_seqs", "spec.topology.workers.initial_workers",
                             "spec.engine.rank.max_num_batched_tokens",
                             "spec.engine.rank.enable_chunked_prefill",
                             "spec.engine.rank.num_gpu_blocks", "traffic.arrival_speedup_ratio",
                             "spec.engine.rank.preemption_mode")
    # the last axis varies fastest; zip columns move together
    first = sweep.points[0]
    assert (first["spec.engine.rank.max_num_seqs"], first["spec.topology.workers.initial_workers"],
            first["spec.engine.rank.max_num_batched_tokens"]) == (8, 1, 512)
    assert [p["spec.engine.rank.enable_chunked_prefill"] for p in sweep.points[:6]] == [True] * 3 + [False] * 3
    blocks = [p["spec.engine.rank.num_gpu_blocks"] for p in sweep.points[:3]]
    assert all(100 <= b <= 4000 and isinstance(b, int) for b in blocks)
    assert all(0.5 <= p["traffic.arrival_speedup_ratio"] <= 8.0 for p in sweep.points)
    # seeded: the same draws again, another seed other draws
    assert load_sweep(_spec(random={"samples": 3, "seed": 5, "space": {
        "spec.engine.rank.num_gpu_blocks": {"randint": [100, 4000]}}})).points[0][
        "spec.engine.rank.num_gpu_blocks"] == blocks[0]
    payload, trace = sweep.payload(0)
    assert payload["spec"]["engine"]["rank"]["max_num_seqs"] == 8 and trace == BASE["trace"]
    setup = parse_payload(payload, sweep.base_dir, trace)
    assert setup.workers == 1 and setup.rank.max_num_batched_tokens == 512


def test_yaml_file_paths_resolve_next_to_it(tmp_path):
    traces = tmp_path / "t"
    traces.mkdir()
    (traces / "a.jsonl").write_text(Path(BASE["trace"]).read_text())
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"base": {"spec": BASE["spec"], "trace": "t/a.jsonl"},
                                         "trace": ["t/a.jsonl", BASE["trace"]]}))
    sweep = load_sweep(spec_file)
    assert [p["trace"] for p in sweep.points] == [str(traces / "a.jsonl"), BASE["trace"]]
    assert sweep.base_trace == str(traces / "a.jsonl")


@pytest.mark.parametrize("axes, message", [
    (dict(grid={"spec.engine.rank.max_num_seqs": []}), "grid.spec.engine.rank.max_num_seqs: is empty"),
    (dict(grid={"engine.rank.max_num_seqs": [1]}), "must be a dotted path starting with 'spec.'"),
    (dict(grid={"spec.engine.rank.max_num_seq": [8]}), "point 0 (spec.engine.rank.max_num_seq=8)"),
    (dict(grid={"spec.engine.rank.max_num_seqs": [8, "many"]}), "point 1 (spec.engine.rank.max_num_seqs='many')"),
    (dict(zip={"spec.engine.rank.max_num_seqs": [1, 2], "spec.engine.rank.num_gpu_blocks": [9]}),
     "zip: lists must have equal lengths"),
    (dict(random={"samples": 2, "space": {"spec.engine.rank.num_gpu_blocks": {"normal": [1, 2]}}}),
     "random.space.spec.engine.rank.num_gpu_blocks: must be one of"),
    (dict(sla={"e2e_ms": 100, "ttft_ms": 10}), "e2e_ms is mutually exclusive"),
    (dict(sla={"ttft_ms": 10, "percentile": 80}), "sla.percentile: must be one of"),
    (dict(workers=[1], grid={"spec.topology.workers.initial_workers": [2]}), "the same field twice"),
    (dict(axes={}), "axes: unknown sweep key"),
])
def test_bad_specs_fail_before_any_work(axes, message):
    with pytest.raises(SweepError) as err:
        load_sweep(_spec(**axes))
    assert message in str(err.value)


# ------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------
SMALL = dict(grid={"spec.engine.rank.max_num_seqs": [2, 16],
                   "spec.engine.rank.num_gpu_blocks": [20, 64, 4096]},
             workers=[1, 2], sla={"ttft_ms": 2000, "itl_ms": 100})


def _frame(path):
    return pd.read_parquet(path).sort_values("point", ignore_index=True)


def test_points_equal_their_runs_alone_and_any_batching(tmp_path):
    """Each point's row is the summary of its own replay (a failing point is recorded
    with its status and the sweep goes on); batch sizes 1 and 64 write the same files."""
    batched = run_sweep(_spec(**SMALL), tmp_path / "a", quiet=True)
    single = run_sweep(_spec(**SMALL), tmp_path / "b", batch_size=1, quiet=True)
    pd.testing.assert_frame_equal(batched, single, check_exact=True)
    pd.testing.assert_frame_equal(_frame(tmp_path / "a" / "points.parquet"), batched)
    assert list(batched["point"]) == list(range(12))
    assert set(batched["status"]) == {"ok", "dead_end"}  # 20 blocks hold a prompt, not its output
    dead = batched[batched["status"] == "dead_end"]
    assert dead["error"].str.contains("dead end at t=").all() and dead["mean_ttft_ms"].isna().all()
    sweep = load_sweep(_spec(**SMALL))
    for i in (2, 5, 11):
        payload, trace = sweep.payload(i)
        setup = parse_payload(payload, sweep.base_dir, trace)
        wl = load_mooncake(setup.trace_path, trace_block_size=setup.trace_block_size)
        sim = simulation_from_setup(setup, wl)
        res = run_batch([sim], record_passes=False).check()
        req = requests_in_uuid_order(res.requests[0], wl.session, wl.turn_index)
        want = summarize_replay(setup, req, res.token_stat[0], res.token_hist[0], end_ms=float(res.end_ms[0]))
        row = batched.iloc[i]
        assert row["status"] == "ok" and row["gpus"] == setup.workers
        for key, value in want.items():
            assert row[key] == value, key
        got = pd.read_parquet(tmp_path / "a" / "requests" / f"point={i}" / "part-0.parquet")
        pd.testing.assert_frame_equal(got, req.reset_index(drop=True), check_exact=True)
        sla_ok = want["completed_requests"] == want["num_requests"] and want["p90_ttft_ms"] <= 2000 \
            and want["p90_itl_ms"] <= 100
        assert bool(row["sla_ok"]) == sla_ok
    # the dataset reads as one table, the point as a column
    everything = pd.read_parquet(tmp_path / "a" / "requests")
    assert set(everything["point"].astype(int)) == set(batched.loc[batched["status"] == "ok", "point"])


def test_local_processes_and_dask_equal_one_process(tmp_path):
    from distributed import Client, LocalCluster

    here = run_sweep(_spec(**SMALL), None, batch_size=5, quiet=True)
    jobs = run_sweep(_spec(**SMALL), tmp_path / "jobs", jobs=2, batch_size=5, quiet=True)
    pd.testing.assert_frame_equal(jobs, here, check_exact=True)
    # worker processes on loopback, reached by address as --scheduler does
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      host="127.0.0.1") as cluster:
        on_dask = aisim_fast.sweep(_spec(**SMALL), tmp_path / "dask", scheduler=cluster.scheduler_address,
                                   batch_size=5, quiet=True)
    pd.testing.assert_frame_equal(on_dask, here, check_exact=True)
    # and in-process workers through a Client the caller holds
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        pd.testing.assert_frame_equal(run_sweep(_spec(**SMALL), None, scheduler=client, quiet=True), here,
                                      check_exact=True)
    for point in (2, 9):
        a = pd.read_parquet(tmp_path / "jobs" / "requests" / f"point={point}" / "part-0.parquet")
        b = pd.read_parquet(tmp_path / "dask" / "requests" / f"point={point}" / "part-0.parquet")
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_folder_rules(tmp_path):
    run_sweep(_spec(workers=[1]), tmp_path / "s", quiet=True)
    with pytest.raises(SweepError, match="exists and is not empty"):
        run_sweep(_spec(workers=[1]), tmp_path / "s", quiet=True)
    with pytest.raises(SweepError, match="holds a different sweep .*points: 1 before, 2 now"):
        run_sweep(_spec(workers=[1, 2]), tmp_path / "s", resume=True, quiet=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match="holds no sweep"):
        run_sweep(_spec(workers=[1]), tmp_path / "other", overwrite=True, quiet=True)
    again = run_sweep(_spec(workers=[1]), tmp_path / "s", resume=True, quiet=True)
    assert list(again["point"]) == [0]
    # --resume on a folder that does not exist yet starts the sweep
    fresh = run_sweep(_spec(workers=[1]), tmp_path / "new", resume=True, quiet=True)
    pd.testing.assert_frame_equal(fresh, again, check_exact=True)


def test_resume_after_a_killed_sweep_loses_and_repeats_nothing(tmp_path):
    """A sweep process killed (SIGKILL) mid-run keeps its finished points; --resume runs
    the rest, and the result equals an uninterrupted sweep."""
    spec = {"base": {"spec": BASE["spec"], "trace": SESSIONS},
            "grid": {"spec.engine.rank.max_num_seqs": [2, 4, 8, 16, 32, 64],
                     "spec.engine.rank.num_gpu_blocks": [512, 1024, 2048, 4096, 8192]},
            "workers": [1, 2]}
    spec_file = tmp_path / "sweep.json"
    spec_file.write_text(json.dumps(spec))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "aisim_fast", "sweep", str(spec_file), "--out", str(out),
                             "--batch-size", "1", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list((out / "parts").glob("points-*.parquet"))) >= 3 if (out / "parts").is_dir() else False:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the sweep ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "points.parquet").exists()
    parts = sorted((out / "parts").glob("points-*.parquet"))
    kept = {int(p) for part in parts for p in pd.read_parquet(part)["point"]}
    assert 3 <= len(kept) < 60
    for point in kept:  # every recorded point has its requests complete
        pd.read_parquet(out / "requests" / f"point={point}" / "part-0.parquet")
    # no temporary file is ever read as a result
    assert all(not name.startswith(".") for name in os.listdir(out / "parts"))
    resumed = run_sweep(spec_file, out, resume=True, quiet=True)
    whole = run_sweep(spec_file, tmp_path / "whole", quiet=True)
    assert list(resumed["point"]) == list(range(60))
    pd.testing.assert_frame_equal(resumed, whole, check_exact=True)
    # every point in exactly one part: none was run twice
    recorded = [int(p) for part in (out / "parts").glob("points-*.parquet")
                for p in pd.read_parquet(part)["point"]]
    assert sorted(recorded) == list(range(60))


def test_cli_sweep(tmp_path, capsys):
    from aisim_fast.cli.app import main

    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(workers=[1, 2], grid={"spec.engine.rank.num_gpu_blocks": [20, 64]})))
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "o"), "--no-requests"]) == 0
    out, err = capsys.readouterr()
    assert "4 points (2 dead_end, 2 ok)" in out
    assert "aisim-fast sweep: 4/4 points" in err  # not a terminal: plain progress lines
    assert not (tmp_path / "o" / "requests").exists()
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "o")]) == 2
    assert "--resume continues the sweep" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_spec(grid={"spec.engine.rank.max_num_seqs": [0]})))
    assert main(["sweep", str(bad), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "point 0 (spec.engine.rank.max_num_seqs=0)" in err and not (tmp_path / "b").exists()
    assert np.isfinite(pd.read_parquet(tmp_path / "o" / "points.parquet")["gpus"]).all()


def test_failed_points_say_why_exit_nonzero_and_rerun_with_retry_failed(tmp_path, capsys):
    """A sweep whose every point failed exits 3 and prints each reason once; --resume
    alone keeps the failures, --resume --retry-failed reruns them once the trace is
    fixed, and the result equals a sweep that never failed."""
    from aisim_fast.cli.app import main

    good = Path(BASE["trace"]).read_text()
    trace = tmp_path / "t.jsonl"
    trace.write_text(good + "{not json\n")
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"base": {"spec": BASE["spec"], "trace": str(trace)},
                                         "workers": [1, 2, 3]}))
    args = ["sweep", str(spec_file), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(args) == 3
    out = capsys.readouterr().out
    assert "3 points (3 trace_error)" in out
    assert f"3 trace_error (first: point 0): {trace}:21:" in out and "--resume --retry-failed" in out
    trace.write_text(good)
    assert main([*args, "--resume"]) == 3  # finished points, failures included, are not rerun
    capsys.readouterr()
    assert main([*args, "--resume", "--retry-failed"]) == 0
    assert "3 points (3 ok)" in capsys.readouterr().out
    fixed = pd.read_parquet(tmp_path / "o" / "points.parquet")
    whole = run_sweep(str(spec_file), tmp_path / "whole", quiet=True)
    pd.testing.assert_frame_equal(fixed, whole, check_exact=True)
    assert main([*args, "--retry-failed"]) == 2
    assert "--retry-failed: reruns the failed points of a sweep; give it with --resume" in capsys.readouterr().err


def test_a_missing_trace_or_an_unreachable_scheduler_writes_nothing(tmp_path, capsys, monkeypatch):
    from aisim_fast.cli.app import main
    from aisim_fast.studies import sweeps

    monkeypatch.setattr(sweeps, "SCHEDULER_TIMEOUT_S", 1)

    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump({"base": {"spec": BASE["spec"], "trace": str(tmp_path / "gone.jsonl")},
                                         "workers": [1, 2]}))
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'gone.jsonl'}: trace file not found" in capsys.readouterr().err
    spec_file.write_text(yaml.safe_dump(_spec(workers=[1, 2])))
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "o"), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    assert "--scheduler tcp://127.0.0.1:9: cannot reach the Dask scheduler" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # a folder holding the same sweep with no finished point reruns without a flag
    (tmp_path / "o2").mkdir()
    run_sweep(_spec(workers=[1, 2]), tmp_path / "o2", quiet=True)
    for part in (tmp_path / "o2" / "parts").iterdir():
        part.unlink()
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "o2"), "--quiet"]) == 0


# ------------------------------------------------------------------------------------
# sizing
# ------------------------------------------------------------------------------------
ONE_K = str(DATA / "traces" / "mooncake_1k.jsonl")


@pytest.mark.parametrize("spec_name, max_workers, columns", [
    ("1k_vllm_agg2", 12, ("spec.topology.workers.initial_workers",)),
    ("1k_vllm_disagg1p2d", 6, ("spec.topology.prefill.initial_workers",
                               "spec.topology.decode.initial_workers")),
])
def test_pruned_sizing_agrees_with_an_exhaustive_grid_sweep(spec_name, max_workers, columns):
    """The pruned search's answer is the cheapest feasible point of the whole grid, run
    as a plain sweep with the same SLA (the sweep's sla_ok is the size's verdict)."""
    from aisim_fast.studies.sizing import size

    sla = {"ttft_ms": 300, "itl_ms": 20, "goodput": 0.95}
    spec_file = DATA / "golden" / f"{spec_name}.spec.json"
    answers = size(spec_file, sla, trace=ONE_K, max_workers=max_workers, rates=(12.0, 16.0),
                   exhaustive=False)
    for answer, rate in zip(answers, (12.0, 16.0)):
        if len(columns) == 1:
            rows = [(w,) for w in range(1, max_workers + 1)]
        else:
            rows = [(p, d) for p in range(1, max_workers) for d in range(1, max_workers - p + 1)]
        grid = run_sweep({"base": {"spec": str(spec_file), "trace": ONE_K},
                          "zip": {**{c: [r[i] for r in rows] for i, c in enumerate(columns)},
                                  "traffic.arrival_speedup_ratio": [rate] * len(rows)},
                          "sla": sla}, None, quiet=True)
        assert answer.rate == rate and answer.search == "pruned"
        # every candidate the search ran has the sweep's verdict
        for _, got in answer.evidence.iterrows():
            same = grid
            for c in columns:
                same = same[same[c] == got[c]]
            assert bool(same["sla_ok"].iloc[0]) == bool(got["feasible"])
        ok = grid[grid["sla_ok"].fillna(False)]
        if not len(ok):
            assert not answer.feasible
            continue
        cheapest = ok.sort_values(["gpus", *columns]).iloc[0]
        assert answer.feasible and answer.gpus == cheapest["gpus"]
        assert answer.deployment == {c: int(cheapest[c]) for c in columns}
        if len(columns) == 1:  # (the 15-point P/D grid is nearly all inside the refined range)
            assert len(answer.evidence) < len(rows)  # it did not need the whole grid


def test_size_and_a_sweep_agree_on_every_sla_term():
    """One base, one SLA with every kind of term: size's per-candidate verdict, failed
    terms and values are the sweep's sla_ok / sla_failed and its summary columns."""
    from aisim_fast.report.sla import parse_sla, stat_key
    from aisim_fast.studies.sizing import size

    terms = {"ttft_ms": 400, "itl_ms": 25, "goodput": 0.9, "ttft_p90_ms": 250, "tpot_mean_ms": 20,
             "itl_p99_ms": 60, "e2e_p50_ms": 3000, "min_goodput_rps": 40}
    spec_file = DATA / "golden" / "1k_vllm_agg2.spec.json"
    [answer] = size(spec_file, terms, trace=ONE_K, max_workers=6, rates=(4.0,), exhaustive=True)
    grid = run_sweep({"base": {"spec": str(spec_file), "trace": ONE_K}, "workers": list(range(1, 7)),
                      "arrival_speedup_ratio": [4.0], "sla": terms}, None, quiet=True)
    sla = parse_sla(terms)
    verdicts = set()
    for _, got in answer.evidence.iterrows():
        row = grid[grid["spec.topology.workers.initial_workers"] == got["spec.topology.workers.initial_workers"]]
        row = row.iloc[0]
        assert bool(row["sla_ok"]) == bool(got["feasible"])
        assert row["sla_failed"] == got["sla_failed"]
        for term in sla.stat_bounds:
            assert got[f"sla.{term}"] == row[stat_key(term)]
        assert got["sla.goodput"] == row["goodput_completed_requests"] / row["num_requests"]
        verdicts.add(got["sla_failed"])
    assert len(verdicts) >= 3  # the SLA separates the candidates, term by term


@pytest.mark.parametrize("seed", range(6))
def test_pruned_search_equals_the_exhaustive_one_on_random_spaces(seed):
    """Property: on random small spaces (a max_num_seqs choice, the worker budget, the
    load and the SLA drawn from a seed) the pruned search finds the exhaustive answer."""
    from aisim_fast.studies.sizing import SizingSpace, size

    rng = np.random.default_rng(seed)
    spec_file = DATA / "golden" / "1k_vllm_agg2.spec.json"
    space = SizingSpace(max_num_seqs=tuple(int(v) for v in rng.choice([8, 32, 256], 2, replace=False)))
    sla = {"ttft_p90_ms": float(rng.choice([150, 400, 2000])), "itl_p90_ms": float(rng.choice([25, 40, 80]))}
    kwargs = dict(trace=ONE_K, max_workers=int(rng.integers(5, 10)), rates=(float(rng.choice([2, 6, 12])),),
                  space=space)
    [pruned] = size(spec_file, sla, exhaustive=False, **kwargs)
    [every] = size(spec_file, sla, exhaustive=True, **kwargs)
    assert (pruned.feasible, pruned.gpus, pruned.deployment) == (every.feasible, every.gpus, every.deployment)
    assert len(pruned.evidence) <= len(every.evidence)


def _size(args, capsys):
    from aisim_fast.cli.app import main

    code = main(["size", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_size_answers_writes_its_folder_and_exits_by_the_answer(tmp_path, capsys):
    spec = DATA / "golden" / "1k_vllm_agg2.spec.json"
    code, out, _ = _size(["--spec", spec, "--trace", ONE_K, "--sla", "ttft_ms=300,itl_ms=20",
                          "--max-workers", "8", "--rates", "4", "--out", tmp_path / "s", "--quiet"], capsys)
    assert code == 0
    assert "rate x4: 4 GPUs (workers=4) meet ttft_ms=300,itl_ms=20,goodput=0.99" in out
    answer = json.loads((tmp_path / "s" / "answer.json").read_text())
    assert answer["answers"][0]["gpus"] == 4 and answer["answers"][0]["deployment"] == {"workers": 4}
    evidence = pd.read_parquet(tmp_path / "s" / "sizing.parquet")
    assert len(evidence) == 8 and evidence["feasible"].sum() == 5 and set(evidence["rate"]) == {4.0}
    # the same base judged on the token gaps' p90: a different, documented answer; each
    # phase of the search shown as it runs
    code, out, err = _size(["--spec", spec, "--trace", ONE_K, "--sla", "ttft_ms=300,itl_p90_ms=20",
                            "--max-workers", "8", "--rates", "4"], capsys)
    assert code == 0 and "rate x4: 7 GPUs (workers=7)" in out
    assert "aisim-fast size: rate x4: all 8 candidates" in err and "aisim-fast size: 8/8 candidates" in err
    # nothing fits: exit 3, the closest candidate and the terms it failed
    code, out, _ = _size(["--spec", spec, "--trace", ONE_K, "--sla", "ttft_p90_ms=30",
                          "--max-workers", "3", "--rates", "4", "--quiet"], capsys)
    assert code == 3
    assert "nothing within the budget meets ttft_p90_ms=30" in out
    assert "closest: 3 GPUs (workers=3): ttft_p90_ms 54.31 > 30" in out


def test_cli_size_takes_a_yaml_payload_and_the_replay_flags(tmp_path, capsys):
    payload = json.loads((DATA / "golden" / "1k_vllm_agg2.spec.json").read_text())
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(payload))
    args = ["--trace", ONE_K, "--sla", "ttft_ms=300,itl_ms=20", "--max-workers", "6", "--rates", "4", "--quiet"]
    code, from_yaml, err = _size(["--spec", tmp_path / "base.yaml", *args], capsys)
    assert code == 0, err
    code, from_json, _ = _size(["--spec", DATA / "golden" / "1k_vllm_agg2.spec.json", *args], capsys)
    assert from_yaml == from_json
    rank = payload["spec"]["engine"]["rank"]
    code, from_flags, err = _size(["--backend", "vllm", "--engine-args", json.dumps(rank), *args], capsys)
    assert code == 0, err
    assert from_flags.splitlines()[0] == from_json.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["--sla", "ttfb_ms=3"], "--sla.ttfb_ms: unknown SLA term"),
    (["--sla", "ttft_ms=300", "--rates", "0"], "--rates: every rate must be a finite number > 0, got 0"),
    (["--sla", "ttft_ms=300", "--rates", "x"], "--rates: numbers separated by commas"),
    (["--sla", "ttft_ms=300", "--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl: trace file not found"),
    (["--sla", "e2e_ms=3,ttft_ms=4"], "--sla: e2e_ms is mutually exclusive"),
    (["--sla", "ttft_ms=300", "--tp", "1,2", "--trace", ONE_K], "tp: a tensor-parallel choice needs op-level"),
    (["--sla", "ttft_ms=300", "--tp", "2", "--trace", ONE_K], "model: required: the pools are not timed by AIC"),
    (["--sla", "ttft_ms=300", "--engine-args", "{}"], "--engine-args cannot be combined with --spec"),
])
def test_cli_size_refuses_bad_input_in_one_line(args, message, capsys):
    code, _, err = _size(["--spec", DATA / "golden" / "1k_vllm_agg2.spec.json", *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_size_refuses_a_yaml_spec_named_json_with_a_hint(tmp_path, capsys):
    (tmp_path / "base.json").write_text("spec: {}\n")
    code, _, err = _size(["--spec", tmp_path / "base.json", "--sla", "ttft_ms=3"], capsys)
    assert code == 2 and "not valid JSON" in err and "needs a .yaml or .yml name" in err


# ------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------
def test_pareto_front_is_the_undominated_set():
    from aisim_fast.studies.plots import pareto_front

    rng = np.random.default_rng(3)
    for maximize in (True, False):
        x, y = rng.integers(0, 20, 60).astype(float), rng.integers(0, 20, 60).astype(float)
        front = set(pareto_front(x, y, maximize).tolist())
        sx = x if maximize else -x
        for i in range(len(x)):
            beaten = np.any((sx >= sx[i]) & (y >= y[i]) & ((sx > sx[i]) | (y > y[i])))
            if i in front:
                assert not beaten
            elif not beaten:  # an undominated point left out only as a duplicate of one kept
                assert any(sx[j] == sx[i] and y[j] == y[i] for j in front)


def test_plot_command_on_a_sweep_and_a_replay(tmp_path, capsys):
    from aisim_fast.cli.app import main

    run_sweep(_spec(**SMALL), tmp_path / "s", quiet=True)
    assert main(["plot", str(tmp_path / "s")]) == 0
    assert main(["replay", "--spec", str(DATA / "golden" / "1k_vllm_agg2.spec.json"),
                 "--trace", BASE["trace"], "--out", str(tmp_path / "r")]) == 0
    assert main(["plot", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    for path in (tmp_path / "s" / "plots" / "pareto_per_user.png", tmp_path / "s" / "plots" / "pareto_ttft.png",
                 tmp_path / "r" / "plots" / "latency_cdf.png", tmp_path / "r" / "plots" / "timeline.png"):
        assert str(path) in out and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path)]) == 2
    assert "no points.parquet (a sweep), answer.json (a sizing) or requests.parquet" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "s"), "--color-by", "nope"]) == 2
    assert "--color-by: 'nope' is not a column" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "s"), "--color-by", "spec.engine.rank.num_gpu_blocks"]) == 0
    assert (tmp_path / "s" / "report.html").is_file()


def test_prefill_decode_shortcut_on_a_disaggregated_base():
    points = run_sweep({"base": {"spec": str(DATA / "golden" / "1k_vllm_disagg1p2d.spec.json"),
                                 "trace": BASE["trace"]},
                        "prefill_decode": [[1, 1], [1, 3], [2, 2]], "arrival_speedup_ratio": [1.0, 4.0]},
                       None, quiet=True)
    # shortcut axes nest in a fixed order: the arrival ratio outside the split
    assert list(points["traffic.arrival_speedup_ratio"]) == [1.0] * 3 + [4.0] * 3
    assert list(points["spec.topology.prefill.initial_workers"]) == [1, 1, 2] * 2
    assert list(points["spec.topology.decode.initial_workers"]) == [1, 3, 2] * 2
    assert list(points["gpus"]) == [2, 4, 4] * 2 and set(points["status"]) == {"ok"}
    assert (points["num_requests"] == 20).all()
    with pytest.raises(SweepError, match=r"prefill_decode: each value must be \[prefill, decode\]"):
        load_sweep({"base": BASE, "prefill_decode": [[1, 2, 3]]})


def test_a_point_with_rejected_requests_misses_the_sla():
    points = run_sweep(_spec(grid={"spec.engine.rank.max_model_len": [1200, 4096]},
                             sla={"ttft_ms": 1e9, "itl_ms": 1e9}), None, quiet=True)
    assert list(points["status"]) == ["ok", "ok"]
    assert list(points["completed_requests"]) == [16, 20]  # 4 prompts of 1200+ tokens rejected
    assert list(points["sla_ok"]) == [False, True]


def test_a_batch_too_large_for_memory_is_split_and_an_oversized_point_recorded(monkeypatch):
    """Memory for about one small point at a time: the batch of four is split until
    its parts fit, every small point runs as it does alone, and the point too large
    even alone is a row with status too_large; the sweep goes on."""
    from aisim_fast.engine import build, memory

    spec = _spec(workers=[1, 1, 1, 64])
    want = run_sweep(spec, None, quiet=True)
    one = {}
    real = memory.check_state_fits

    def measure(sims, templates, n_q, rows, events=0):
        one.setdefault("bytes", memory.state_bytes(sims[:1], templates[:1], n_q // len(sims), rows, events))
        return real(sims, templates, n_q, rows, events)

    monkeypatch.setattr(build, "check_state_fits", measure)
    run_sweep(_spec(workers=[1]), None, quiet=True)
    monkeypatch.setattr(build, "check_state_fits", real)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(one["bytes"] * 1.8 / 0.75))
    got = run_sweep(spec, None, quiet=True, batch_size=4)
    assert list(got["status"]) == ["ok", "ok", "ok", "too_large"]
    assert "of simulator state" in got["error"].iloc[3]
    cols = ["mean_ttft_ms", "p90_itl_ms", "completed_requests"]
    pd.testing.assert_frame_equal(got[cols].iloc[:3], want[cols].iloc[:3], check_exact=True)


def test_a_sweep_over_sglang_knobs_and_a_mixed_backend_batch(tmp_path):
    """A sweep on an SGLang base varies its sglang block like any field, and a batch may
    mix backends: every point equals its replay alone."""
    spec = {"base": {"spec": str(DATA / "golden" / "1k_sglang_agg2.spec.json"),
                     "trace": str(DATA / "traces" / "mooncake_tiny20.jsonl")},
            "grid": {"spec.engine.rank.sglang.schedule_policy": ["fifo", "lpm"],
                     "spec.engine.rank.num_gpu_blocks": [6000, 1048576]}}
    frame = run_sweep(spec, tmp_path / "s", quiet=True)
    assert list(frame["status"]) == ["ok"] * 4
    sweep = load_sweep(spec)
    sims = []
    for i in range(4):
        payload, trace = sweep.payload(i)
        sims.append(simulation_from_setup(parse_payload(payload, sweep.base_dir, trace)))
        alone = run_batch([sims[-1]], record_passes=False).check().requests[0]
        assert frame.iloc[i]["completed_requests"] == (alone["terminal_status"] == "completed").sum()
        assert frame.iloc[i]["mean_ttft_ms"] == alone["ttft_ms"].mean()
    vllm_sweep = load_sweep(_spec(workers=[2]))
    payload, trace = vllm_sweep.payload(0)
    mixed = run_batch(sims + [simulation_from_setup(parse_payload(payload, vllm_sweep.base_dir, trace))],
                      record_passes=False).check()
    for i, sim in enumerate(sims):
        alone = run_batch([sim], record_passes=False).check()
        pd.testing.assert_frame_equal(mixed.requests[i], alone.requests[0], check_exact=True)


def test_confidence_judges_each_candidate_over_its_seeded_variants():
    """size with a confidence: each candidate's met fraction is that of its variants run
    one by one (the pass times scaled by each variant's factor), and it fits when that
    fraction reaches the confidence."""
    from aisim_fast.studies.sizing import Confidence, size

    spec_file = DATA / "golden" / "1k_vllm_agg2.spec.json"
    sla = "ttft_p90_ms=300,itl_p90_ms=30"
    confidence = Confidence(0.75, runs=4, timing_pct=10.0, seed=3)
    [answer] = size(spec_file, sla, trace=ONE_K, rates=(4.0,), max_workers=5, confidence=confidence)
    payload = json.loads(spec_file.read_text())
    met = {w: 0 for w in range(1, 6)}
    for factor in confidence.factors():
        varied = json.loads(json.dumps(payload))
        varied["spec"]["engine"]["rank"]["speedup_ratio"] = 1.0 / factor
        [alone] = size(varied, sla, base_dir=spec_file.parent, trace=ONE_K, rates=(4.0,), max_workers=5,
                       exhaustive=True)
        for _, row in alone.evidence.iterrows():
            met[int(row["spec.topology.workers.initial_workers"])] += bool(row["feasible"])
    fractions = {w: n / 4 for w, n in met.items()}
    for _, row in answer.evidence.iterrows():
        w = int(row["spec.topology.workers.initial_workers"])
        assert row["runs"] == 4 and row["runs_met_fraction"] == fractions[w]
        assert bool(row["feasible"]) == (fractions[w] >= 0.75)
        assert row["p90_ttft_ms_min"] <= row["p90_ttft_ms"] <= row["p90_ttft_ms_max"]
    assert 0 < sum(0 < f < 1 for f in fractions.values())  # the perturbation decides some
    with pytest.raises(SweepError, match="the runs would be identical"):
        size(spec_file, sla, trace=ONE_K, confidence=Confidence(0.9))


def test_the_request_dataset_reads_back_with_an_integer_point(tmp_path):
    run_sweep(_spec(workers=[1, 2, 3]), tmp_path / "o", quiet=True)
    every = aisim_fast.read_sweep_requests(tmp_path / "o")
    assert every["point"].dtype == np.int64 and set(every["point"]) == {0, 1, 2}
    points = pd.read_parquet(tmp_path / "o" / "points.parquet")
    assert len(every.merge(points[["point", "gpus"]], on="point")) == len(every)
    one = aisim_fast.read_sweep_requests(tmp_path / "o", points=[2])
    alone = pd.read_parquet(tmp_path / "o" / "requests" / "point=2" / "part-0.parquet")
    pd.testing.assert_frame_equal(one.drop(columns="point"), alone)


def test_an_integer_log_uniform_axis_spreads_over_decades():
    sweep = load_sweep(_spec(random={"samples": 400, "seed": 1, "space": {
        "spec.engine.rank.max_num_seqs": {"loguniform_int": [1, 1024]}}}))
    drawn = np.array([p["spec.engine.rank.max_num_seqs"] for p in sweep.points])
    assert drawn.dtype == np.int64 and drawn.min() >= 1 and drawn.max() <= 1024
    assert all(isinstance(p["spec.engine.rank.max_num_seqs"], int) for p in sweep.points)
    low, high = (drawn <= 32).mean(), (drawn > 32).mean()   # 1-32 and 32-1024: half the log range each
    assert 0.4 < low < 0.6 and 0.4 < high < 0.6
    with pytest.raises(SweepError, match="loguniform_int: bounds must be integers >= 1"):
        load_sweep(_spec(random={"samples": 2, "space": {"spec.engine.rank.max_num_seqs": {"loguniform_int": [0, 8]}}}))


def test_cli_size_sizes_prefill_and_decode_pools_from_the_flags(capsys):
    code, out, err = _size(["--backend", "vllm", "--disaggregated", "--max-workers", "4", "--sla", "ttft_p90_ms=3000",
                            "--trace", BASE["trace"], "--quiet"], capsys)
    assert code == 0, err
    assert out.splitlines()[0] == "rate x1: 2 GPUs (prefill=1, decode=1) meet ttft_p90_ms=3000"
    assert "prefill  decode" in out


def test_the_highest_rate_that_meets_the_sla_in_one_sweep(tmp_path, capsys):
    """datasets/sweep_rate.yaml: a synthetic poisson load at 8 rates on 2 workers; the
    closing lines name the highest rate up to which every point met the SLA, as the
    points' sla_ok column says."""
    from aisim_fast.cli.app import main

    assert main(["sweep", str(REPO_DIR / "datasets" / "sweep_rate.yaml"), "--out", str(tmp_path / "o"),
                 "--no-requests"]) == 0
    out = capsys.readouterr().out
    points = pd.read_parquet(tmp_path / "o" / "points.parquet").sort_values("traffic.request_rate")
    assert list(points["traffic.request_rate"]) == [2, 4, 6, 8, 10, 12, 14, 16]
    ok = points["sla_ok"].astype(bool).to_numpy()
    highest = points["traffic.request_rate"].to_numpy()[np.argmin(ok) - 1] if not ok.all() else 16
    assert ok[0] and not ok.all()  # the example sits across the SLA's edge
    assert f"traffic.request_rate = {highest}  (spec.topology.workers.initial_workers=2)" in out


def test_sla_frontier_stops_at_the_first_miss():
    from aisim_fast.studies.sweeps import sla_frontier

    points = pd.DataFrame({"rate": [1, 2, 3, 4, 1, 2, 3, 4], "workers": [1] * 4 + [2] * 4,
                           "status": ["ok"] * 8,
                           "sla_ok": pd.array([True, False, True, False, False, True, True, True], "boolean")})
    assert sla_frontier(points, ["workers", "rate"]) == [
        ("workers", {"rate": 1}, 1), ("workers", {"rate": 2}, None), ("workers", {"rate": 3}, 2),
        ("workers", {"rate": 4}, None), ("rate", {"workers": 1}, 1), ("rate", {"workers": 2}, None)]
    assert sla_frontier(points.drop(columns="sla_ok"), ["rate"]) == []


def test_size_rates_scale_a_synthetic_loads_arrivals(capsys):
    """--rates on a synthetic base: a poisson load's request_rate and a constant rate's
    interval scale with the rate (x4 of 20 requests/s needs more GPUs than x1); a closed
    loop has no arrival rate to scale and says what to sweep instead."""
    from aisim_fast.studies.sizing import rate_edits
    from aisim_fast.config.payload import parse_payload

    golden = DATA / "golden_synthetic"
    poisson = parse_payload(json.loads((golden / "syn_poisson.payload.json").read_text()), golden)
    assert rate_edits(poisson, 4.0) == {"traffic.request_rate": poisson.synthetic.request_rate * 4}
    const = parse_payload(json.loads((golden / "syn_const.payload.json").read_text()), golden)
    assert rate_edits(const, 2.0) == {"traffic.arrival_interval_ms": const.synthetic.arrival_interval_ms / 2}
    assert rate_edits(const, None) == {}
    closed = parse_payload(json.loads((golden / "syn_conc.payload.json").read_text()), golden)
    with pytest.raises(SweepError, match="rates: a synthetic concurrency load is a closed loop"):
        rate_edits(closed, 2.0)
    code, out, err = _size(["--spec", golden / "syn_poisson.payload.json", "--sla", "ttft_p90_ms=100,itl_p90_ms=30",
                            "--max-workers", "8", "--rates", "1,4", "--quiet"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    gpus = [int(line.split(": ")[1].split(" GPUs")[0]) for line in lines if line.startswith("rate x")]
    assert len(gpus) == 2 and gpus[1] > gpus[0]
