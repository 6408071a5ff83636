"""Replay speed: aisim_fast vs the reference simulator (`aisimulate` wheel), one run.

    python benchmarks/bench_replay.py [--ref-python /work/refvenv/bin/python]
        [--cases 10k_vllm_agg8,batch100_1k_vllm_agg2,10k_vllm_disagg2p4d]
        [--repeat K] [--golden-dir DIR] [--trace-dir DIR] [--no-cold]
        [--numba-threads T] [--aisim-path DIR] [--ref-calls M] [--rounds R] [--json-out FILE]

Case names are golden spec names (`<golden-dir>/<name>.spec.json`); a `batch<N>_`
prefix means N copies of that simulation in ONE aisim_fast run_batch call, compared
with N sequential reference calls in one reference process.

Every measurement runs in its own subprocess so that peak RSS (getrusage) and the
kernel cache state belong to one side and one mode only:
  * aisim_fast cold: fresh process, NUMBA_CACHE_DIR = an empty temp folder, one call
    (import + load + run_batch, kernels compiled from scratch).
  * aisim_fast warm: fresh process with the normal on-disk cache, one warm-up call,
    then K timed calls; best of K (load_spec + trace load + run_batch).
  * reference: `benchmarks/ref_driver.py` run by --ref-python; one warm-up call,
    then K timed samples of the native `run_replay_json` call(s); best of K.
The machine has 2 cores and is shared, so best-of-K is reported together with K and
the load average (best wall and best CPU are minimised independently over the K); CPU seconds are printed next to wall seconds because they are less
sensitive to other jobs (note that aisim_fast's batch kernel runs a prange over
simulations and so may use both cores, the reference runs one thread).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
DEFAULT_GOLDEN_DIR = REPO_ROOT.parent / "shared" / "reference" / "golden"
DEFAULT_CASES = "10k_vllm_agg8,batch100_1k_vllm_agg2,10k_vllm_disagg2p4d"
BATCH_CASE = re.compile(r"^batch(\d+)_(.+)$")


def parse_case(name: str) -> tuple[str, int]:
    """'batch100_1k_vllm_agg2' -> ('1k_vllm_agg2', 100); '10k_vllm_agg8' -> ('10k_vllm_agg8', 1)."""
    m = BATCH_CASE.match(name)
    if m:
        return m.group(2), int(m.group(1))
    return name, 1


def run_child(cmd: list[str], env: dict | None, timeout_s: float) -> dict:
    """Run one driver subprocess; return its JSON plus the parent-side process wall."""
    w0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    process_wall_s = time.perf_counter() - w0
    last_line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not last_line.startswith("{"):
        rc = proc.returncode
        if rc < 0:  # killed by a signal, e.g. SIGSEGV inside a compiled kernel
            try:
                rc = f"{rc} ({signal.Signals(-rc).name})"
            except ValueError:
                pass
        # faulthandler output starts with the fatal error line; keep the Python frames short
        tail = [ln.strip() for ln in (proc.stderr or proc.stdout).strip().splitlines()
                if ln.strip() and not ln.startswith("Extension modules")][:4]
        return {"error": f"rc={rc}: " + " | ".join(tail), "process_wall_s": process_wall_s}
    result = json.loads(last_line)
    result["process_wall_s"] = process_wall_s
    return result


def aisim_cmd(spec: Path, trace_dir: Path, batch: int, repeat: int, cold: bool) -> list[str]:
    # -X faulthandler: a crash in a compiled kernel still names the Python frame
    cmd = [sys.executable, "-X", "faulthandler", str(HERE / "aisim_driver.py"), "--spec", str(spec),
           "--trace-dir", str(trace_dir), "--batch", str(batch), "--repeat", str(repeat)]
    return cmd + (["--cold"] if cold else [])


def bench_case(name: str, args, golden_dir: Path, trace_dir: Path) -> dict:
    spec_name, batch = parse_case(name)
    spec = golden_dir / f"{spec_name}.spec.json"
    if not spec.is_file():
        raise SystemExit(f"no golden spec {spec}")
    row: dict = {"case": name, "spec": str(spec), "batch": batch,
                 "load_before": os.getloadavg()}

    base_env = dict(os.environ)
    if args.aisim_path:
        # PYTHONPATH is searched before the editable install's finder
        base_env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(args.aisim_path).resolve())] + [p for p in [base_env.get("PYTHONPATH")] if p])
    if args.numba_threads:
        base_env["NUMBA_NUM_THREADS"] = str(args.numba_threads)

    if not args.no_cold:
        cache_dir = tempfile.mkdtemp(prefix="aisim_fast_cold_cache_")
        try:
            env = dict(base_env, NUMBA_CACHE_DIR=cache_dir)
            print(f"[{name}] aisim_fast cold (empty NUMBA_CACHE_DIR) ...", file=sys.stderr, flush=True)
            row["aisim_cold"] = run_child(aisim_cmd(spec, trace_dir, batch, 1, True), env, args.timeout)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)

    # The host's other tenants slow either side by up to 2x for seconds at a time, so
    # the two sides alternate for --rounds rounds and each keeps its best round.
    for round_no in range(args.rounds):
        tag = f" round {round_no + 1}/{args.rounds}" if args.rounds > 1 else ""
        if "unsupported" not in row.get("aisim_cold", {}):
            print(f"[{name}] aisim_fast warm (best of {args.repeat}){tag} ...", file=sys.stderr, flush=True)
            warm = run_child(aisim_cmd(spec, trace_dir, batch, args.repeat, False),
                             base_env, args.timeout)
            row.setdefault("aisim_rounds", []).append(warm.get("best_total_wall_s"))
            if _better(warm, row.get("aisim_warm"), "best_total_wall_s"):
                row["aisim_warm"] = warm

        if args.ref_python:
            calls = min(batch, args.ref_calls) if args.ref_calls else batch
            print(f"[{name}] reference ({calls} call(s) per sample, best of {args.repeat}){tag} ...",
                  file=sys.stderr, flush=True)
            ref = run_child([args.ref_python, str(HERE / "ref_driver.py"), "--spec", str(spec),
                             "--trace-dir", str(trace_dir), "--repeat", str(args.repeat),
                             "--calls-per-sample", str(calls)], None, args.timeout)
            # time fewer calls than simulations and scale linearly, if asked to
            ref["scale"] = batch / calls
            row.setdefault("ref_rounds", []).append(ref.get("best_native_wall_s"))
            if _better(ref, row.get("ref"), "best_native_wall_s"):
                row["ref"] = ref
    row["load_after"] = os.getloadavg()
    return row


def _better(new: dict, old: dict | None, key: str) -> bool:
    """Keep the round with the smaller best time (a failed round never wins)."""
    if old is None or old.get(key) is None:
        return True
    return new.get(key) is not None and new[key] < old[key]


# ---------------------------------------------------------------------------- report
def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cold_s(cold: dict) -> float | None:
    """Import + first call (load + compile + run) in a fresh process with an empty cache."""
    if not cold or "first_call" not in cold:
        return None
    return cold["import_s"] + cold["first_call"]["total_wall_s"]


def _status(part: dict | None) -> str | None:
    if part is None:
        return None
    if "unsupported" in part:
        return "unsupported"
    if "error" in part:
        return "FAILED"
    return None


def summarize(rows: list[dict], args) -> str:
    lines = []
    head = ("| case | sims | aisim_fast cold s | aisim_fast warm s | aisim_fast warm CPU s "
            "| reference s | reference CPU s | ratio ref/aisim_fast (warm) "
            "| aisim_fast peak RSS MiB (warm / cold) | reference peak RSS MiB |")
    lines += [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        cold, warm, ref = r.get("aisim_cold"), r.get("aisim_warm"), r.get("ref")
        cold_s = _status(cold) or _fmt(_cold_s(cold))
        if cold is None:
            cold_s = "not run"
        warm_s = _status(warm) or (_fmt(warm.get("best_total_wall_s")) if warm else None)
        if warm is None:
            warm_s = _status(cold) or "not run"
        warm_cpu = _fmt(warm.get("best_total_cpu_s")) if warm and not _status(warm) else "-"
        ref_s = ref_cpu = ratio = "-"
        if ref is not None:
            ref_s = _status(ref) or _fmt(ref["best_native_wall_s"] * ref["scale"])
            if not _status(ref):
                ref_cpu = _fmt(ref["best_native_cpu_s"] * ref["scale"])
                if warm and not _status(warm):
                    ratio = f"{ref['best_native_wall_s'] * ref['scale'] / warm['best_total_wall_s']:.2f}x"
        rss_a = "/".join(_fmt(p.get("peak_rss_mib"), 0) if p and not _status(p) else "-"
                         for p in (warm, cold))
        rss_r = _fmt(ref.get("peak_rss_mib"), 0) if ref and not _status(ref) else "-"
        lines.append(f"| {r['case']} | {r['batch']} | {cold_s} | {warm_s} | {warm_cpu} | {ref_s} "
                     f"| {ref_cpu} | {ratio} | {rss_a} | {rss_r} |")

    lines += ["", "Details (wall s unless noted):"]
    for r in rows:
        cold, warm, ref = r.get("aisim_cold"), r.get("aisim_warm"), r.get("ref")
        lines.append(f"* {r['case']} (load avg before {r['load_before'][0]:.2f}, "
                     f"after {r['load_after'][0]:.2f})")
        if len(r.get("aisim_rounds", [])) > 1 or len(r.get("ref_rounds", [])) > 1:
            lines.append("  - best of each round, alternating sides: aisim_fast "
                         + ", ".join(_fmt(x) for x in r.get("aisim_rounds", []))
                         + "; reference " + ", ".join(_fmt(x) for x in r.get("ref_rounds", [])))
        for label, part in (("aisim_fast cold", cold), ("aisim_fast warm", warm), ("reference", ref)):
            if part is None:
                continue
            if "error" in part or "unsupported" in part:
                lines.append(f"  - {label}: {part.get('error') or 'unsupported: ' + part['unsupported']}")
                continue
            if part["side"] == "aisim_fast":
                fc = part["first_call"]
                text = (f"import {part['import_s']:.2f}, first call {fc['total_wall_s']:.3f} "
                        f"(load {fc['load_wall_s']:.3f} + run_batch {fc['run_wall_s']:.3f}, "
                        f"CPU {fc['total_cpu_s']:.3f})")
                if "samples" in part:
                    text += (f"; best of {len(part['samples'])}: total {part['best_total_wall_s']:.3f} "
                             f"= load {part['best_load_wall_s']:.3f} + run_batch "
                             f"{part['best_run_wall_s']:.3f}; all totals "
                             + ", ".join(f"{s['total_wall_s']:.3f}" for s in part["samples"]))
                text += (f"; {part['aisim_fast_file']}; numba threads {part['numba_num_threads']}"
                         f" ({part.get('threading_layer')})")
            else:
                calls = part["calls_per_sample"]
                scale = part["scale"]
                text = (f"import {part['import_s']:.2f}, {calls} native call(s) per sample"
                        + (f" scaled x{scale:g}" if scale != 1 else "")
                        + f"; best of {len(part['samples'])}: native {part['best_native_wall_s']:.3f}"
                        f", native + json.loads {part['best_native_plus_parse_wall_s']:.3f}; "
                        "all native " + ", ".join(f"{s['native_wall_s']:.3f}" for s in part["samples"]))
            text += (f"; sanity: {part['completed_requests']}/{part['num_requests']} completed, "
                     f"mean TTFT {_fmt(part['mean_ttft_ms'], 4)} ms, "
                     f"mean E2E {_fmt(part['mean_e2e_latency_ms'], 4)} ms"
                     f"; peak RSS {part['peak_rss_mib']:.0f} MiB; process wall "
                     f"{part['process_wall_s']:.2f}, process CPU {part['process_cpu_s']:.2f}")
            lines.append(f"  - {label}: {text}")
    return "\n".join(lines)


def machine_facts() -> str:
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        uptime = "load average: %.2f, %.2f, %.2f" % os.getloadavg()
    return (f"date {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}; "
            f"{os.cpu_count()} cores; python {platform.python_version()}; uptime: {uptime}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-python", default=None,
                   help="python of a virtualenv with aisimulate installed; omit for aisim_fast only")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated (default {DEFAULT_CASES})")
    p.add_argument("--repeat", type=int, default=3, help="K: timed repetitions, best of K is reported")
    p.add_argument("--golden-dir", default=str(DEFAULT_GOLDEN_DIR))
    p.add_argument("--trace-dir", default=None,
                   help="folder the specs' relative trace paths refer to (default: <golden-dir>/../traces)")
    p.add_argument("--no-cold", action="store_true", help="skip the empty-cache compile measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the two sides this many times; each keeps its best round")
    p.add_argument("--numba-threads", type=int, default=None,
                   help="NUMBA_NUM_THREADS for aisim_fast (1 = same single core as the reference)")
    p.add_argument("--aisim-path", default=None,
                   help="folder to put first on PYTHONPATH for aisim_fast (time another tree)")
    p.add_argument("--ref-calls", type=int, default=None,
                   help="for batch cases, time only this many reference calls per sample and scale")
    p.add_argument("--timeout", type=float, default=3600.0, help="per subprocess, seconds")
    p.add_argument("--json-out", default=None, help="also write all raw measurements here")
    args = p.parse_args(argv)

    golden_dir = Path(args.golden_dir).resolve()
    trace_dir = Path(args.trace_dir).resolve() if args.trace_dir else (golden_dir.parent / "traces")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]

    facts = machine_facts()
    print(facts, flush=True)
    print(f"repeat K={args.repeat}; golden {golden_dir}; traces {trace_dir}", flush=True)
    rows = [bench_case(c, args, golden_dir, trace_dir) for c in cases]
    print()
    print(summarize(rows, args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"facts": facts, "argv": sys.argv, "rows": rows},
                                                  indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
