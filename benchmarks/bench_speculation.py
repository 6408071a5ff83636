"""Speed of a speculating replay against a plain one on the same trace, in one process,
warm (kernels loaded before timing), the two sides alternated round by round.

    python benchmarks/bench_speculation.py [--trace tests/data/traces/mooncake_10k.jsonl]
        [--workers 8] [--backend vllm] [--speculation mtp:2] [--rounds 5]

Each round times one ``run_batch`` of the plain simulation and one of the speculating
one (the same trace, workers and rank, plus the speculation's rank fields); the table
shows every round's wall seconds and the best of each side, and the ratio of the bests
(the machine is shared and swings 2x: the alternation keeps the two sides under the
same load). It also prints the output tokens per pass of each side.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from aisim_fast.config import speculation
from aisim_fast.config.payload import parse_rank
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import Simulation
from aisim_fast.trace.workload import load_mooncake

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(ROOT / "tests" / "data" / "traces" / "mooncake_10k.jsonl"))
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--backend", default="vllm")
    p.add_argument("--speculation", default="mtp:2", help="a config.speculation choice (KIND:N[@..])")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    workload = load_mooncake(args.trace)
    plain_rank = parse_rank({"backend": args.backend})
    spec_rank = parse_rank({"backend": args.backend, **speculation.rank_fields(args.speculation)})
    sims = {"plain": Simulation(workload, plain_rank, args.workers),
            args.speculation: Simulation(workload, spec_rank, args.workers)}
    for sim in sims.values():  # load (or compile) every kernel before timing
        run_batch([sim]).check()
    walls: dict[str, list[float]] = {name: [] for name in sims}
    tokens_per_pass = {}
    for _ in range(args.rounds):
        for name, sim in sims.items():
            t0 = time.perf_counter()
            res = run_batch([sim]).check()
            walls[name].append(time.perf_counter() - t0)
            passes = res.passes[0]
            tokens_per_pass[name] = float(passes["num_output_tokens"].sum()) / max(1, len(passes))
    print(f"trace {Path(args.trace).name}, {args.workers} {args.backend} workers, {args.rounds} rounds "
          "(wall s per run_batch, alternated)")
    for name, values in walls.items():
        print(f"  {name:12s} best {min(values):.3f}  rounds {', '.join(f'{v:.3f}' for v in values)}"
              f"  output tokens per pass {tokens_per_pass[name]:.2f}")
    ratio = min(walls[args.speculation]) / min(walls["plain"])
    print(f"  {args.speculation} / plain: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
