"""Memory and time of one large batch: N simulations x W workers of one trace.

Each simulation gets its own KV pool size (num_gpu_blocks = base + i), as a
capacity sweep would. Prints wall seconds, peak RSS and a sanity value.

    python benchmarks/bench_scale.py [--sims 1000] [--workers 8] [--blocks 2048]
        [--trace ../shared/reference/traces/mooncake_1k.jsonl]
"""

import argparse
import resource
import time
from pathlib import Path

from aisim_fast.config.payload import parse_rank
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import Simulation
from aisim_fast.trace.workload import load_mooncake

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sims", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2048, help="num_gpu_blocks of the first simulation")
    ap.add_argument("--trace", default=str(REPO.parent / "shared/reference/traces/mooncake_1k.jsonl"))
    args = ap.parse_args()
    trace = load_mooncake(args.trace)
    sims = [Simulation(trace, parse_rank({"backend": "vllm", "num_gpu_blocks": args.blocks + i}),
                       workers=args.workers) for i in range(args.sims)]
    run_batch(sims[:1], record_passes=False)  # compile / load the kernels outside the timing
    started = time.perf_counter()
    result = run_batch(sims, record_passes=False)
    wall_s = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.sims} simulations x {args.workers} workers, {len(trace.input_len)} requests each: "
          f"{wall_s:.1f} s, peak RSS {peak_mib:.0f} MiB; "
          f"mean TTFT of the last point {result.requests[-1]['ttft_ms'].mean():.3f} ms")


if __name__ == "__main__":
    main()
