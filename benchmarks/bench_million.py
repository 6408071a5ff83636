"""A million-request replay, whole process: peak memory and linearity in requests.

    python benchmarks/bench_million.py [--copies 10] [--workers 128] [--keep DIR]

Builds a trace of ``copies`` back-to-back copies of the public 100k Mooncake trace (each
copy shifted in time past the previous one, with fresh hash ids so copies share no
prefix), then runs ``aisim-fast replay TRACE --backend vllm --workers W --out DIR``
with the default outputs (requests, passes, summary) as a separate process, on one
copy and on all of them. Prints, per run: requests, wall seconds, peak RSS of the
process, and the time per request; then the time ratio against ``copies`` x the
one-copy run (1.0 = linear). Issue 14's targets: 1M requests on 128 workers within
3 GB, the ratio within 1.3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE_100K = REPO.parent / "shared" / "reference" / "traces" / "mooncake_100k.jsonl"


def write_copies(src: Path, copies: int, dst: Path) -> int:
    """``copies`` copies of src, each after the previous one's last arrival (plus 1 s),
    hash ids offset per copy. Returns the row count."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    span_ms = max(r["timestamp"] for r in rows) + 1000
    hash_span = max(h for r in rows for h in r["hash_ids"]) + 1
    with open(dst, "w") as out:
        for k in range(copies):
            for r in rows:
                out.write(json.dumps({"timestamp": r["timestamp"] + k * span_ms,
                                      "input_length": r["input_length"],
                                      "output_length": r["output_length"],
                                      "hash_ids": [h + k * hash_span for h in r["hash_ids"]]}))
                out.write("\n")
    return copies * len(rows)


# a parent of its own per run, so that its children's peak RSS is this run's alone
_MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
            "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def run_replay(trace: Path, workers: int, out: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS GiB) of one ``aisim-fast replay`` process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "aisim_fast", "replay",
                           str(trace), "--backend", "vllm", "--workers", str(workers), "--out", str(out),
                           "--quiet"], check=True, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    return wall_s, int(done.stdout.split()[-1]) / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=10)
    p.add_argument("--workers", type=int, default=128)
    p.add_argument("--keep", type=Path, help="folder for the traces and run folders (else a temp dir)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_million_")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        # warm the kernel cache so neither run pays the compile
        run_replay(REPO / "datasets" / "mooncake_conversation_3k.jsonl", 2, tmp / "warm")
        results = []
        for copies in (1, args.copies):
            trace = tmp / f"mooncake_{copies}x100k.jsonl"
            n = write_copies(TRACE_100K, copies, trace)
            out = tmp / f"run_{copies}"
            shutil.rmtree(out, ignore_errors=True)
            wall_s, rss_gib = run_replay(trace, args.workers, out)
            results.append((copies, n, wall_s, rss_gib))
            print(f"{n:>9,} requests, {args.workers} workers: {wall_s:7.1f} s wall, "
                  f"peak RSS {rss_gib:.2f} GiB, "
                  f"{1e6 * wall_s / n:.1f} us per request", flush=True)
        (_, _, t_one, _), (big, _, t_big, _) = results
        print(f"time ratio {t_big / (t_one * big):.2f} against {big} x the one-copy run (1.0 = linear)")
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
