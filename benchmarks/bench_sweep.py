"""Sweep speed: a whole ``aisim-fast sweep`` process against the reference running the
same points in one process (wheel imported once, ``run_replay_json`` per point).

    python benchmarks/bench_sweep.py --ref-python /tmp/refvenv/bin/python
        [--golden-dir DIR] [--trace-dir DIR] [--jobs N] [--points-limit N] [--json-out FILE]
    python benchmarks/bench_sweep.py --against-tree DIR [--rounds R] ...

The default sweep is 400 points over the 1k public golden trace: 10 ``max_num_seqs``
x 5 ``max_num_batched_tokens`` x 8 worker counts from 1 to 64, on the
``1k_vllm_agg2`` payload. The aisim_fast side is one ``aisim-fast sweep`` process
(kernel cache warm: a warm-up ``aisim-fast warmup`` runs first), per-request dataset
included; its wall time, CPU time and peak RSS are the child's. The reference side
is one process of ``--ref-python`` that imports the wheel, then calls
``run_replay_json`` for each point's payload (the payloads aisim_fast's sweep
expansion gives, so both simulate the same points) and parses each report; the
sides run one after the other, aisim_fast first, and the box's load average is
printed. ``--points-limit`` runs the first N points on both sides (a quick check).

``--against-tree DIR`` compares two trees of aisim_fast instead: the same sweep run by
this tree and by the checkout DIR (``PYTHONPATH=DIR``; link ``DIR/aisim_fast/kernels``
to ``DIR/kernels`` so it loads its own kernels), alternating for ``--rounds`` rounds;
the best wall and CPU time of each side, and whether every point agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MAX_NUM_SEQS = [8, 16, 32, 48, 64, 96, 128, 192, 256, 512]
MAX_BATCHED = [1024, 2048, 4096, 8192, 16384]
WORKERS = [1, 2, 4, 8, 16, 24, 32, 64]

REF_SCRIPT = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import aisimulate._runtime as runtime
payloads = json.load(open(sys.argv[1]))
t1 = time.perf_counter()
completed = []
for p in payloads:
    report = json.loads(runtime.run_replay_json(json.dumps(p, separators=(",", ":"))))
    completed.append(report.get("completed_requests"))
t2 = time.perf_counter()
print(json.dumps({"import_and_load_s": t1 - t0, "points_s": t2 - t1, "completed": completed,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _child(cmd, **kw) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Run a child; its wall s, CPU s (user + sys) and peak RSS MiB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, after.ru_maxrss / 1024, proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", default=None)
    ap.add_argument("--against-tree", default=None, help="compare with this aisim_fast checkout instead")
    ap.add_argument("--rounds", type=int, default=3, help="with --against-tree: alternations")
    ap.add_argument("--golden-dir", default=str(REPO / "tests" / "data" / "golden"))
    ap.add_argument("--trace-dir", default=str(REPO / "tests" / "data" / "traces"))
    ap.add_argument("--jobs", type=int, default=1, help="aisim-fast sweep --jobs")
    ap.add_argument("--points-limit", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if (args.ref_python is None) == (args.against_tree is None):
        ap.error("give one of --ref-python and --against-tree")

    from aisim_fast.studies.sweeps import load_sweep

    spec = {"base": {"spec": str(Path(args.golden_dir) / "1k_vllm_agg2.spec.json"),
                     "trace": str(Path(args.trace_dir) / "mooncake_1k.jsonl")},
            "grid": {"spec.engine.rank.max_num_seqs": MAX_NUM_SEQS,
                     "spec.engine.rank.max_num_batched_tokens": MAX_BATCHED},
            "workers": WORKERS}
    sweep = load_sweep(spec)
    n = len(sweep.points) if args.points_limit is None else min(args.points_limit, len(sweep.points))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.points_limit is not None:  # the first n points, as their own zip axis
            cols = sweep.columns
            spec = {"base": spec["base"],
                    "zip": {c: [sweep.points[i][c] for i in range(n)] for c in cols}}
        spec_file = tmp / "sweep.json"
        spec_file.write_text(json.dumps(spec))
        aisim = [sys.executable, "-m", "aisim_fast"]
        if args.against_tree:
            return _against_tree(args, aisim, spec_file, tmp, n)
        _child(aisim + ["warmup", "--topology", "aggregated"])
        load = os.getloadavg()[0]
        a_wall, a_cpu, a_rss, _ = _child(aisim + ["sweep", str(spec_file), "--out", str(tmp / "out"),
                                                  "--quiet", "--jobs", str(args.jobs)])
        import pandas as pd

        points = pd.read_parquet(tmp / "out" / "points.parquet")
        payloads = []
        for i in range(n):
            payload, trace = sweep.payload(i)
            payload["traffic"]["trace_path"] = trace
            payloads.append(payload)
        (tmp / "payloads.json").write_text(json.dumps(payloads))
        r_wall, r_cpu, r_rss, proc = _child([args.ref_python, "-c", REF_SCRIPT, str(tmp / "payloads.json")])
        ref = json.loads(proc.stdout.strip().splitlines()[-1])
    same = list(points["completed_requests"].astype("Int64").fillna(-1)) == \
        [c if c is not None else -1 for c in ref["completed"]]
    out = {
        "points": n, "jobs": args.jobs, "load_average": load,
        "aisim_fast": {"wall_s": a_wall, "cpu_s": a_cpu, "peak_rss_mib": a_rss,
                       "batch_size": sweep.batch_size},
        "reference": {"wall_s": r_wall, "cpu_s": r_cpu, "peak_rss_mib": ref["peak_rss_mib"],
                      "points_s": ref["points_s"]},
        "speedup_wall": r_wall / a_wall, "speedup_cpu": r_cpu / a_cpu,
        "completed_requests_agree": same,
    }
    print(f"{n} points, load average {load:.2f}")
    print(f"  aisim-fast sweep  {a_wall:8.2f} s wall  {a_cpu:8.2f} s CPU  {a_rss:7.0f} MiB peak  "
          f"(batch size {sweep.batch_size}, --jobs {args.jobs})")
    print(f"  reference         {r_wall:8.2f} s wall  {r_cpu:8.2f} s CPU  {ref['peak_rss_mib']:7.0f} MiB peak")
    print(f"  speedup           {out['speedup_wall']:8.1f} x wall  {out['speedup_cpu']:6.1f} x CPU;  "
          f"completed requests agree per point: {same}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


def _against_tree(args, aisim, spec_file: Path, tmp: Path, n: int) -> int:
    """The sweep by this tree and by ``args.against_tree``, alternating."""
    import pandas as pd

    other = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(args.against_tree).resolve())] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    sides = {"this tree": dict(os.environ), args.against_tree: other}
    best: dict = {}
    points = {}
    for env in sides.values():
        _child(aisim + ["warmup", "--topology", "aggregated"], env=env)
    for round_no in range(args.rounds):
        for name, env in sides.items():
            out_dir = tmp / f"out-{round_no}-{len(best.get(name, []))}-{abs(hash(name))}"
            wall, cpu, rss, _ = _child(aisim + ["sweep", str(spec_file), "--out", str(out_dir),
                                                "--quiet", "--jobs", str(args.jobs)], env=env)
            best.setdefault(name, []).append((wall, cpu))
            points[name] = pd.read_parquet(out_dir / "points.parquet")["completed_requests"].tolist()
            print(f"  round {round_no + 1} {name:20s} {wall:8.2f} s wall {cpu:8.2f} s CPU", flush=True)
    (a, b) = sides
    wall = {k: min(w for w, _ in v) for k, v in best.items()}
    cpu = {k: min(c for _, c in v) for k, v in best.items()}
    print(f"{n} points, {args.rounds} alternated rounds, load average {os.getloadavg()[0]:.2f}")
    for k in sides:
        print(f"  {k:20s} best {wall[k]:8.2f} s wall {cpu[k]:8.2f} s CPU")
    print(f"  this tree / other   {wall[a] / wall[b]:8.3f} x wall {cpu[a] / cpu[b]:6.3f} x CPU;  "
          f"points agree: {points[a] == points[b]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rounds": best, "points_agree": points[a] == points[b]},
                                                  indent=2))
    return 0 if points[a] == points[b] else 1


if __name__ == "__main__":
    sys.exit(main())
