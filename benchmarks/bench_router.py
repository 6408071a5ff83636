"""Cost of the kv_router placement against round robin on one trace, in one process.

    python benchmarks/bench_router.py [--spec tests/data/golden/10k_vllm_agg8.spec.json]
        [--trace tests/data/traces/mooncake_10k.jsonl] [--rounds 5]

Runs the payload as given (round robin: its workers are independent, so it runs as
one unit per worker on the kernel threads) and with ``placement: kv_router``
(defaults; one unit, since routing couples the workers), alternating the two, after
a warm-up of each; prints the best ``run_batch`` wall and CPU seconds of each and
the ratio. The trace is loaded once, outside the timed calls.

``--points N`` runs N simulations of each placement in one ``run_batch`` call, as a
sweep's batch does (kv_router with router seeds 0..N-1): the kernel threads are then
busy on both sides, so the wall ratio is the cost a sweep pays for the router.

``--arrival-speedup-ratio R`` replays the trace at R times its rate (the spec's own
ratio otherwise): below 1, fewer requests share each worker and its passes.

``--whole`` adds two placements that tell the router's own cost from that of running
the workers as one simulation: ``round_robin_whole``, the same round-robin run without
the per-worker split (``batch.worker_shards`` is patched to decline it, in this
process only), and ``random`` (seeded, a whole simulation like kv_router's).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(REPO / "tests/data/golden/10k_vllm_agg8.spec.json"))
    ap.add_argument("--trace", default=str(REPO / "tests/data/traces/mooncake_10k.jsonl"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--points", type=int, default=1, help="simulations of each placement per call")
    ap.add_argument("--arrival-speedup-ratio", type=float, default=None,
                    help="replay the trace at this rate instead of the spec's")
    ap.add_argument("--whole", action="store_true",
                    help="also round robin run whole (no per-worker split) and random placement")
    args = ap.parse_args()

    import contextlib

    from aisim_fast.config.payload import parse_payload
    from aisim_fast.engine import batch
    from aisim_fast.engine.batch import run_batch
    from aisim_fast.engine.simulation import simulation_from_setup
    from aisim_fast.trace.workload import load_mooncake

    base = json.loads(Path(args.spec).read_text())

    def placed(provider):
        payloads = []
        for seed in range(args.points):
            payload = copy.deepcopy(base)
            payload["spec"].setdefault("adapters", {})["placement"] = {"provider": provider,
                                                                        "config": {"seed": seed}}
            payloads.append(payload)
        return payloads

    @contextlib.contextmanager
    def unsplit(name):
        if name != "round_robin_whole":
            yield
            return
        shards = batch.worker_shards
        batch.worker_shards = lambda sim: None  # every simulation runs as one unit
        try:
            yield
        finally:
            batch.worker_shards = shards

    variants = [("round_robin", [base] * args.points)]
    if args.whole:
        variants += [("round_robin_whole", [base] * args.points), ("random", placed("random"))]
    variants.append(("kv_router", placed("kv_router")))
    sims = {}
    workload = None
    for name, payloads in variants:
        sims[name] = []
        for payload in payloads:
            setup = parse_payload(payload, Path(args.spec).parent, args.trace)
            if workload is None:
                ratio = args.arrival_speedup_ratio or setup.arrival_speedup_ratio
                workload = load_mooncake(setup.trace_path, trace_block_size=setup.trace_block_size,
                                         arrival_speedup_ratio=ratio)
            sims[name].append(simulation_from_setup(setup, workload))
        with unsplit(name):
            run_batch(sims[name], record_passes=False).check()  # warm-up (compile / cache load)
    best = {name: (float("inf"), float("inf")) for name in sims}
    for _ in range(args.rounds):
        for name, sim in sims.items():
            with unsplit(name):
                w0, c0 = time.perf_counter(), time.process_time()
                res = run_batch(sim, record_passes=False).check()
                res.requests[len(sim) - 1]
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    rate = f" at {args.arrival_speedup_ratio}x its rate" if args.arrival_speedup_ratio else ""
    print(f"{Path(args.spec).name}{rate}, {workload.num_requests} requests, {args.points} simulation(s) "
          f"per call, best of {args.rounds} "
          f"(load average {os.getloadavg()[0]:.2f})")
    for name, (wall, cpu) in best.items():
        print(f"  {name:17s} wall {wall:.4f} s  CPU {cpu:.4f} s")
    rr, kv = best["round_robin"], best["kv_router"]
    print(f"  kv_router / round_robin: wall {kv[0] / rr[0]:.2f}x, CPU {kv[1] / rr[1]:.2f}x")


if __name__ == "__main__":
    main()
