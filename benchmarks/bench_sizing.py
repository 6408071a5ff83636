"""Sizing speed: the pruned search (coarse grid, then the cheaper candidates near each
shape's best) against the exhaustive one on the same space, in one process, alternated
round by round (the machine is shared: the ratio of the two sides of a round is what
to read). Both must give the same answer; the script says so or exits 1.

    python benchmarks/bench_sizing.py [--rounds 3] [--max-workers 32] [--rates 4,8]

The space: the ``1k_vllm_agg2`` payload on the 1k public trace, ``max_num_seqs`` in
{32, 256} x workers 1..max, SLA ttft_p90_ms=300, itl_p90_ms=30, one answer per rate.
Kernels are loaded (or compiled) by a first untimed run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "tests" / "data" / "golden" / "1k_vllm_agg2.spec.json"
TRACE = REPO / "tests" / "data" / "traces" / "mooncake_1k.jsonl"
SLA = "ttft_p90_ms=300,itl_p90_ms=30"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-workers", type=int, default=32)
    parser.add_argument("--rates", default="4,8")
    args = parser.parse_args()
    from aisim_fast.studies.sizing import SizingSpace, size

    rates = tuple(float(r) for r in args.rates.split(","))
    space = SizingSpace(max_num_seqs=(32, 256))

    def run(exhaustive: bool):
        start = time.perf_counter()
        answers = size(SPEC, SLA, trace=str(TRACE), rates=rates, max_workers=args.max_workers, space=space,
                       exhaustive=exhaustive)
        return time.perf_counter() - start, answers

    run(False)  # load (or compile) the kernels
    ratios = []
    for r in range(args.rounds):
        sides = {}
        for exhaustive in ((False, True) if r % 2 == 0 else (True, False)):
            sides[exhaustive] = run(exhaustive)
        (pruned_s, pruned), (every_s, every) = sides[False], sides[True]
        same = all((a.feasible, a.gpus, a.deployment) == (b.feasible, b.gpus, b.deployment)
                   for a, b in zip(pruned, every))
        runs = (sum(len(a.evidence) for a in pruned), sum(len(a.evidence) for a in every))
        ratios.append(every_s / pruned_s)
        print(f"round {r}: pruned {pruned_s:.2f} s ({runs[0]} candidates run), exhaustive {every_s:.2f} s "
              f"({runs[1]}), x{every_s / pruned_s:.2f}; same answers: {same}")
        if not same:
            return 1
    print(f"exhaustive / pruned, median of {len(ratios)} rounds: x{sorted(ratios)[len(ratios) // 2]:.2f}; "
          + "; ".join(f"rate x{a.rate:g}: {a.gpus} GPUs" for a in pruned))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
