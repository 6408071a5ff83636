"""Cold compile cost of each kernel set, in CPU-seconds.

Every measurement runs in its own Python process whose Numba cache points at an
empty folder, so it compiles from scratch:

* ``trace``: loading the bundled trace (the compiled trace scanner);
* ``aggregated`` / ``disaggregated`` / ``sglang`` / ``sglang_disaggregated``: one tiny replay of that kernel set with every
  simulated backend in one batch (the topology's entry kernel and all it calls, the
  prompt hashing and the sketch merge), after the trace kernels are warm;
* ``default run``: the README's first command (``aisim-fast replay --backend vllm
  --workers 8``), the whole process, compiling everything it needs.

CPU-seconds (user + system of the child) are the measure, not wall time: the
machine is shared and compiling is single-threaded, so CPU time is what a cold
start costs and it varies far less than wall time. A second, warm run of each
shows the cache-load cost. ``--rounds R`` repeats everything and keeps each
figure's best.

    python benchmarks/bench_compile.py [--rounds 2] [--parts sglang,sglang_disaggregated]
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

ROOT = Path(__file__).resolve().parent.parent

_PART = r"""
import json, sys, time
from aisim_fast.trace.workload import default_trace_path, load_mooncake
part = sys.argv[1]
t0 = time.process_time()
workload = load_mooncake(default_trace_path(), max_rows=8)
t_trace = time.process_time() - t0
if part != "trace":
    from aisim_fast.cli.app import main
    t0 = time.process_time()
    main(["warmup", "--topology", part])
    t_part = time.process_time() - t0
else:
    t_part = t_trace
print(json.dumps({"cpu_s": t_part}))
"""


def _child(args: list[str], cache_dir: str) -> tuple[float, float, str]:
    """(CPU seconds of the child, wall seconds, its stdout)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, out.stdout


def measure_part(part: str) -> dict:
    """Cold and warm CPU seconds of one kernel set (the in-process figure for the part
    itself, and the whole child process)."""
    with tempfile.TemporaryDirectory(prefix="aisim-compile-") as cache:
        if part != "trace":  # the trace kernels are not part of this set
            _child([sys.executable, "-c", _PART, "trace"], cache)
        cold_proc, cold_wall, out = _child([sys.executable, "-c", _PART, part], cache)
        cold = json.loads(out.strip().splitlines()[-1])["cpu_s"]
        warm_proc, _, out = _child([sys.executable, "-c", _PART, part], cache)
        warm = json.loads(out.strip().splitlines()[-1])["cpu_s"]
    return {"cold_cpu_s": cold, "cold_process_cpu_s": cold_proc, "cold_wall_s": cold_wall,
            "warm_cpu_s": warm, "warm_process_cpu_s": warm_proc}


def measure_default_run() -> dict:
    """The README's first command in a cold and then a warm cache."""
    with tempfile.TemporaryDirectory(prefix="aisim-compile-") as cache, \
            tempfile.TemporaryDirectory(prefix="aisim-out-") as out:
        cmd = [sys.executable, "-m", "aisim_fast", "replay", "--backend", "vllm", "--workers", "8",
               "--out", os.path.join(out, "run"), "--overwrite"]
        cold, cold_wall, _ = _child(cmd, cache)
        warm, warm_wall, _ = _child(cmd, cache)
    return {"cold_process_cpu_s": cold, "cold_wall_s": cold_wall, "warm_process_cpu_s": warm,
            "warm_wall_s": warm_wall}


PARTS = ("trace", "aggregated", "disaggregated", "sglang", "sglang_disaggregated", "default run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="repeat and keep the best figures")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="kernel sets to measure (comma-separated; 'default run' = the README's "
                             "first command), all by default")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        results = {part: measure_part(part) for part in parts if part != "default run"}
        if "default run" in parts:
            results["default run"] = measure_default_run()
        for name, figures in results.items():
            kept = best.setdefault(name, figures)
            for key, value in figures.items():
                kept[key] = min(kept[key], value)
    print(f"{'kernel set':16s} {'cold CPU s':>11s} {'cold process CPU s':>19s} {'cold wall s':>12s} "
          f"{'warm CPU s':>11s} {'warm process CPU s':>19s}")
    for name, f in best.items():
        print(f"{name:16s} {f.get('cold_cpu_s', float('nan')):11.1f} {f['cold_process_cpu_s']:19.1f} "
              f"{f['cold_wall_s']:12.1f} {f.get('warm_cpu_s', float('nan')):11.2f} "
              f"{f['warm_process_cpu_s']:19.2f}")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} round(s), best of each figure")


if __name__ == "__main__":
    main()
