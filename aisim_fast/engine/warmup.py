"""Compile every replay kernel set ahead of a first run."""

from __future__ import annotations

import time

from aisim_fast.config.payload import SIMULATED_BACKENDS, parse_rank
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import Simulation
from aisim_fast.kernels.jit import compile_notice
from aisim_fast.protocol.rank import rank_kernels
from aisim_fast.trace.workload import default_trace_path, load_mooncake


def warm_kernels(topologies=("aggregated", "disaggregated", "sglang", "sglang_disaggregated")) -> dict:
    """Compile (or load from the cache) the kernel sets given (kernels.COMPILE_PARTS): a
    tiny batch of the bundled trace with every backend of the set ("rank": the rank
    protocol's kernels). Returns seconds per set."""

    compile_notice(["trace"] + (["rank"] if "rank" in topologies else []))  # replay_batch: the rest
    workload = load_mooncake(default_trace_path(), max_rows=8)
    seconds = {}
    for topology in topologies:
        start_s = time.perf_counter()
        if topology == "rank":  # the rank protocol's kernels (aisim_fast.protocol.rank)
            rank_kernels()
            seconds[topology] = time.perf_counter() - start_s
            continue
        for backend in SIMULATED_BACKENDS:
            if (backend == "sglang") != topology.startswith("sglang"):
                continue  # SGLang runs in loops of its own
            # an SGLang pool counts tokens: the default 16384 holds fewer than some
            # prompts of the trace (which would never be admitted)
            extra = {"num_gpu_blocks": 1 << 20} if backend == "sglang" else {}
            # one batch per backend: TRT-LLM's policy is an optional feature (its own
            # kernel set), and a plain vLLM run must find the plain set warm
            if topology in ("aggregated", "sglang"):
                sim = Simulation(workload, parse_rank({"backend": backend, **extra}), workers=2)
            else:
                sim = Simulation(
                    workload, parse_rank({"backend": backend, "worker_type": "decode", **extra}), workers=1,
                    prefill_rank=parse_rank({"backend": backend, "worker_type": "prefill", **extra}),
                    prefill_workers=1)
            run_batch([sim], record_passes=True).check()
        seconds[topology] = time.perf_counter() - start_s
    return seconds
