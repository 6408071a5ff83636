"""Time the reference simulator (the `aisimulate` wheel) on one execution payload.

Run with a python that has `aisimulate` installed (a separate virtualenv; aisim_fast
never depends on it). Prints one JSON object on stdout.

    REF_PY=/work/refvenv/bin/python
    $REF_PY benchmarks/ref_driver.py --spec GOLDEN.spec.json --trace-dir TRACES \
        [--repeat K] [--calls-per-sample N] [--warmup 1]

One *sample* = N back-to-back calls of `aisimulate._runtime.run_replay_json`
(N=1 for a single replay, N=100 to compare with a batch of 100 simulations).
The native call is timed alone (payload string in, report string out); parsing
the report with json.loads is timed separately because it is Python-side work
that a caller needs before it can use the per-request records.
Only the standard library and the wheel are imported so this runs in any venv.
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


def load_payload(spec_path: Path, trace_dir: Path | None) -> dict:
    payload = json.loads(spec_path.read_text())
    traffic = payload.get("traffic") or {}
    trace = traffic.get("trace_path")
    if trace and not os.path.isabs(trace):
        # golden specs store the trace name relative to the traces folder; the native
        # loader resolves relative paths against the cwd, so make it absolute
        base = trace_dir if trace_dir is not None else spec_path.parent
        traffic["trace_path"] = str((base / trace).resolve())
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="execution payload JSON (golden *.spec.json)")
    p.add_argument("--trace-dir", default=None, help="folder that relative trace paths live in")
    p.add_argument("--repeat", type=int, default=3, help="timed samples (best-of-k is reported)")
    p.add_argument("--calls-per-sample", type=int, default=1,
                   help="sequential native calls per timed sample")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before the samples")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    import aisimulate._runtime as runtime  # public native entry point of the wheel
    import_s = time.perf_counter() - t0

    payload = load_payload(Path(args.spec), Path(args.trace_dir) if args.trace_dir else None)
    payload_json = json.dumps(payload, allow_nan=False, separators=(",", ":"))

    report = None
    for _ in range(args.warmup):
        report = json.loads(runtime.run_replay_json(payload_json))

    samples = []
    for _ in range(max(1, args.repeat)):
        native_wall_s = native_cpu_s = parse_s = 0.0
        for _ in range(max(1, args.calls_per_sample)):
            # drop the previous report first so peak RSS reflects one report, not two
            report = None
            w0, c0 = time.perf_counter(), time.process_time()
            raw = runtime.run_replay_json(payload_json)
            w1, c1 = time.perf_counter(), time.process_time()
            report = json.loads(raw)
            w2 = time.perf_counter()
            del raw
            native_wall_s += w1 - w0
            native_cpu_s += c1 - c0
            parse_s += w2 - w1
        samples.append({"native_wall_s": native_wall_s, "native_cpu_s": native_cpu_s,
                        "json_parse_s": parse_s})

    try:
        from importlib.metadata import version
        ref_version = version("aisimulate")
    except Exception:
        ref_version = None
    out = {
        "side": "reference",
        "aisimulate_version": ref_version,
        "spec": str(args.spec),
        "trace_path": payload.get("traffic", {}).get("trace_path"),
        "calls_per_sample": args.calls_per_sample,
        "warmup_calls": args.warmup,
        "import_s": import_s,
        "samples": samples,
        "best_native_wall_s": min(s["native_wall_s"] for s in samples),
        "best_native_cpu_s": min(s["native_cpu_s"] for s in samples),
        "best_native_plus_parse_wall_s": min(s["native_wall_s"] + s["json_parse_s"] for s in samples),
        # sanity values: both sides must have simulated the same workload
        "num_requests": report.get("num_requests"),
        "completed_requests": report.get("completed_requests"),
        "mean_ttft_ms": report.get("mean_ttft_ms"),
        "mean_e2e_latency_ms": report.get("mean_e2e_latency_ms"),
        "peak_rss_mib": peak_rss_mib(),
        "process_cpu_s": time.process_time(),
        "in_process_wall_s": time.perf_counter() - PROCESS_START_S,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
