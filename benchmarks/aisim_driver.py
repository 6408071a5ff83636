"""Time aisim_fast on one golden spec, in its own process. Prints one JSON object.

    python benchmarks/aisim_driver.py --spec GOLDEN.spec.json --trace-dir TRACES \
        [--batch N] [--repeat K] [--cold]

One *call* = load_spec + simulation_from_setup (reads the trace once) + one
run_batch over N copies of the simulation (N=1 for a single replay). The
reference's native call also parses the trace, so the load is part of the
timed work; run_batch alone is reported too.

--cold: exactly one call, nothing else. The parent runs this with
NUMBA_CACHE_DIR pointing at an empty folder, so the call includes compiling
every kernel. Without --cold the first call is the warm-up (it loads the
kernels from the on-disk cache, or compiles them if the cache is stale) and
K further calls are timed; the parent reports the best.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

PROCESS_START_S = time.perf_counter()


def peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def resolve_trace(spec_path: Path, trace_dir: Path | None) -> str | None:
    """Absolute trace path for a golden spec whose trace_path is relative to trace_dir."""
    payload = json.loads(spec_path.read_text())
    trace = (payload.get("traffic") or {}).get("trace_path")
    if not trace or os.path.isabs(trace):
        return None  # keep what the spec says
    base = trace_dir if trace_dir is not None else spec_path.parent
    return str((base / trace).resolve())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--batch", type=int, default=1, help="simulations per run_batch call")
    p.add_argument("--repeat", type=int, default=3, help="timed calls after the warm-up")
    p.add_argument("--cold", action="store_true", help="one call only (empty kernel cache)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    import numba

    import aisim_fast
    try:
        from aisim_fast import ConfigError, load_spec, run_batch, simulation_from_setup
        from aisim_fast.kernels.jit import cache_root
    except ImportError:  # a tree before the public surface (bench_replay --aisim-path)
        from aisim_fast.config import ConfigError, load_spec
        from aisim_fast.kernels import cache_root
        from aisim_fast.replay import run_batch, simulation_from_setup
    import_s = time.perf_counter() - t0

    spec_path = Path(args.spec)
    trace = resolve_trace(spec_path, Path(args.trace_dir) if args.trace_dir else None)
    out = {
        "side": "aisim_fast",
        "spec": str(spec_path),
        "trace_path": trace,
        "batch": args.batch,
        "mode": "cold" if args.cold else "warm",
        "aisim_fast_file": aisim_fast.__file__,  # which tree was measured (see --aisim-path)
        "numba_version": numba.__version__,
        "numba_cache_dir": cache_root(),
        "numba_num_threads": numba.config.NUMBA_NUM_THREADS,
        "import_s": import_s,
    }

    def one_call():
        w0, c0 = time.perf_counter(), time.process_time()
        setup = load_spec(spec_path, trace_override=trace)
        sim = simulation_from_setup(setup)
        w1, c1 = time.perf_counter(), time.process_time()
        res = run_batch([sim] * args.batch, record_passes=False)
        w2, c2 = time.perf_counter(), time.process_time()
        timing = {"load_wall_s": w1 - w0, "run_wall_s": w2 - w1, "total_wall_s": w2 - w0,
                  "load_cpu_s": c1 - c0, "run_cpu_s": c2 - c1, "total_cpu_s": c2 - c0}
        return timing, res

    try:
        first, res = one_call()
    except ConfigError as exc:
        # e.g. a backend aisim_fast does not simulate yet (SGLang)
        out.update({"unsupported": str(exc), "peak_rss_mib": peak_rss_mib()})
        print(json.dumps(out))
        return 0
    out["first_call"] = first

    samples = []
    if not args.cold:
        for _ in range(max(1, args.repeat)):
            # drop the previous result first so peak RSS reflects one result, not two
            res = None
            timing, res = one_call()
            samples.append(timing)
        out["samples"] = samples
        out["best_total_wall_s"] = min(s["total_wall_s"] for s in samples)
        out["best_total_cpu_s"] = min(s["total_cpu_s"] for s in samples)
        out["best_run_wall_s"] = min(s["run_wall_s"] for s in samples)
        out["best_load_wall_s"] = min(s["load_wall_s"] for s in samples)

    # sanity values from the first simulation of the last call (all copies are identical)
    frame = res.requests[0]
    done = frame[frame["terminal_status"] == "completed"]
    out.update({
        "num_requests": int(len(frame)),
        "completed_requests": int(len(done)),
        "mean_ttft_ms": float(done["ttft_ms"].mean()) if len(done) else None,
        "mean_e2e_latency_ms": float(done["e2e_ms"].mean()) if len(done) else None,
        "threading_layer": _threading_layer(numba),
        "peak_rss_mib": peak_rss_mib(),
        "process_cpu_s": time.process_time(),
        "in_process_wall_s": time.perf_counter() - PROCESS_START_S,
    })
    print(json.dumps(out))
    return 0


def _threading_layer(numba) -> str | None:
    try:
        return numba.threading_layer()
    except Exception:  # no parallel kernel has run yet
        return None


if __name__ == "__main__":
    sys.exit(main())
