"""Command line: ``aisim-fast replay``.

Two ways to describe a replay:

* ``aisim-fast replay --spec SPEC.json [--trace PATH] --out DIR`` runs a reference
  execution payload (``{"spec": ..., "traffic": ...}``); ``--trace`` replaces
  ``traffic.trace_path``, and a relative trace path in the spec resolves against the spec
  file's folder.
* ``aisim-fast replay [TRACE] --backend vllm|trtllm --workers N [--engine-args JSON] ...
  --out DIR`` for a Mooncake trace without a spec (no TRACE = the bundled default trace).
  ``--engine-args`` holds reference rank fields, e.g. ``'{"num_gpu_blocks": 4096}'``.

Outputs: DIR/requests.parquet, DIR/passes.parquet, DIR/summary.json (see output.py).
Every user error (bad config, bad trace, refused output folder, a simulation that cannot
finish) ends with one line ``aisim-fast: error: ...`` on stderr and exit code 2, and
nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from aisim_fast import __version__
from aisim_fast.config import SIMULATED_BACKENDS, ConfigError, ReplaySetup, parse_payload, parse_rank
from aisim_fast.output import (
    OutputError,
    check_out_dir,
    requests_in_uuid_order,
    summarize_aggregated_run,
    write_run,
)
from aisim_fast.replay import Simulation, SimulationError, run_batch
from aisim_fast.workload import TraceError, default_trace_path, load_mooncake

PROG = "aisim-fast"
EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
MS_PER_S = 1000.0

# Flags that describe a replay without a spec; with --spec they would be silently
# ignored or contradict the spec, so they are refused.
NO_SPEC_FLAGS = (("backend", "--backend"), ("workers", "--workers"),
                 ("engine_args", "--engine-args"), ("concurrency", "--concurrency"),
                 ("trace_block_size", "--trace-block-size"),
                 ("arrival_speedup_ratio", "--arrival-speedup-ratio"))
DEFAULT_TRACE_BLOCK_SIZE = 512
DEFAULT_ARRIVAL_SPEEDUP_RATIO = 1.0


class UsageError(Exception):
    """A command-line mistake; reported as one line like every other user error."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; one line keeps every error alike
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Batch LLM-inference cluster simulator.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    replay = commands.add_parser(
        "replay", help="replay a Mooncake trace on aggregated vLLM / TRT-LLM workers",
        description="Replay a Mooncake JSONL trace. Either --spec SPEC.json (a reference "
                    "execution payload) or --backend and --workers.")
    replay.add_argument("trace", nargs="?", metavar="TRACE",
                        help="Mooncake JSONL trace (without --spec; default: the bundled trace)")
    replay.add_argument("--spec", metavar="SPEC.json",
                        help="reference execution payload {\"spec\": ..., \"traffic\": ...}")
    replay.add_argument("--trace", dest="trace_flag", metavar="PATH",
                        help="trace file; with --spec it replaces traffic.trace_path")
    replay.add_argument("--backend", choices=SIMULATED_BACKENDS, help="rank scheduler")
    replay.add_argument("--workers", type=int, metavar="N", help="aggregated workers")
    replay.add_argument("--engine-args", metavar="JSON",
                        help="JSON object of reference rank fields, merged over {\"backend\": ...}")
    replay.add_argument("--concurrency", type=int, metavar="N",
                        help="closed loop: at most N sessions in flight (default: trace timestamps)")
    replay.add_argument("--trace-block-size", type=int, metavar="TOKENS",
                        help=f"tokens per trace hash id (default {DEFAULT_TRACE_BLOCK_SIZE})")
    replay.add_argument("--arrival-speedup-ratio", type=float, metavar="RATIO",
                        help="divide trace timestamps and think times by RATIO (default 1.0)")
    replay.add_argument("--out", required=True, metavar="DIR", help="output folder")
    replay.add_argument("--overwrite", action="store_true",
                        help="replace an existing output folder of an earlier run")
    replay.add_argument("--no-passes", action="store_true",
                        help="do not record forward passes (no passes.parquet)")
    return parser


# ---------------------------------------------------------------------------------------
# resolving the replay


def _read_json_file(path: Path, what: str):
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def _setup_from_spec(args) -> tuple[ReplaySetup, int, dict]:
    given = [flag for attr, flag in NO_SPEC_FLAGS if getattr(args, attr) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be combined with --spec; "
                         "change the spec file instead")
    if args.trace is not None:
        raise UsageError("with --spec, give the trace as --trace PATH")
    spec_path = Path(args.spec)
    payload = _read_json_file(spec_path, "spec file")
    setup = parse_payload(payload, spec_path.parent, args.trace_flag)
    source = {"mode": "spec", "spec_file": str(spec_path.resolve()),
              "trace_override": args.trace_flag is not None}
    return setup, setup.tensor_parallel_size, source


def _setup_from_flags(args) -> tuple[ReplaySetup, int, dict]:
    if args.trace is not None and args.trace_flag is not None:
        raise UsageError("give the trace either as TRACE or as --trace, not both")
    missing = [flag for attr, flag in (("backend", "--backend"), ("workers", "--workers"))
               if getattr(args, attr) is None]
    if missing:
        raise UsageError(f"without --spec, {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} required")
    rank_fields = {"backend": args.backend}
    if args.engine_args is not None:
        try:
            extra = json.loads(args.engine_args)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--engine-args: not valid JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"--engine-args: must be a JSON object of rank fields, got {extra!r}")
        if "backend" in extra and extra["backend"] != args.backend:
            raise ConfigError(f"--engine-args.backend: {extra['backend']!r} contradicts "
                              f"--backend {args.backend}")
        rank_fields.update(extra)
    rank = parse_rank(rank_fields, "--engine-args")
    if args.workers < 1:
        raise ConfigError(f"--workers: must be an integer >= 1, got {args.workers}")
    concurrency = 0
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise ConfigError(f"--concurrency: must be an integer >= 1, got {args.concurrency}")
        concurrency = args.concurrency
    block_tokens = DEFAULT_TRACE_BLOCK_SIZE if args.trace_block_size is None else args.trace_block_size
    if block_tokens < 1:
        raise ConfigError(f"--trace-block-size: must be an integer >= 1, got {block_tokens}")
    ratio = (DEFAULT_ARRIVAL_SPEEDUP_RATIO if args.arrival_speedup_ratio is None
             else args.arrival_speedup_ratio)
    if not (math.isfinite(ratio) and ratio > 0.0):
        raise ConfigError(f"--arrival-speedup-ratio: must be a finite number > 0, got {ratio}")
    trace = args.trace if args.trace is not None else args.trace_flag
    default_trace = trace is None
    trace_path = str(default_trace_path() if default_trace else Path(trace))
    setup = ReplaySetup(rank=rank, workers=args.workers, trace_path=trace_path,
                        trace_block_size=block_tokens, arrival_speedup_ratio=ratio,
                        concurrency=concurrency, sla={})
    return setup, 1, {"mode": "flags", "default_trace": default_trace}


def _load_trace(setup: ReplaySetup, max_rows: int | None = None):
    path = Path(setup.trace_path)
    if not path.exists():
        raise TraceError(str(path), None, "trace file not found")
    if path.is_dir():
        raise TraceError(str(path), None, "is a folder, not a trace file")
    try:
        return load_mooncake(path, trace_block_size=setup.trace_block_size,
                             arrival_speedup_ratio=setup.arrival_speedup_ratio, max_rows=max_rows)
    except OSError as exc:
        raise TraceError(str(path), None, f"cannot read ({exc.strerror or exc})") from None


# ---------------------------------------------------------------------------------------
# running


def _warm_up(setup: ReplaySetup) -> None:
    """Run the first trace row alone so the JIT compile (or cache load) of the kernels is
    not counted in wall_time_ms, which measures simulation speed (spec replay.md 12.8)."""
    first_row = _load_trace(setup, max_rows=1)
    try:
        run_batch([Simulation(first_row, setup.rank, 1, 0)], record_passes=False)
    except SimulationError:
        pass  # the real run reports it, with the real request count


def run_replay(args) -> dict:
    """Resolve, simulate, and write one replay. Returns what the summary table shows."""
    if args.spec is not None:
        setup, gpus_per_worker, source = _setup_from_spec(args)
    else:
        setup, gpus_per_worker, source = _setup_from_flags(args)
    # refuse a bad --out before spending time on the simulation (checked again at write)
    check_out_dir(args.out, args.overwrite)
    workload = _load_trace(setup)

    compile_start_s = time.perf_counter()
    _warm_up(setup)
    compile_ms = (time.perf_counter() - compile_start_s) * MS_PER_S

    record_passes = not args.no_passes
    run_start_s = time.perf_counter()
    result = run_batch([Simulation(workload, setup.rank, setup.workers, setup.concurrency)],
                       record_passes=record_passes)
    # floored so the per-wall-second rates stay finite on a clock with coarse ticks
    wall_time_ms = max((time.perf_counter() - run_start_s) * MS_PER_S, 1e-6)

    requests = requests_in_uuid_order(result.requests[0], workload.session, workload.turn_index)
    summary = summarize_aggregated_run(
        requests, result.token_stat[0], result.token_hist[0], workers=setup.workers,
        gpus_per_worker=gpus_per_worker, sla=setup.sla, wall_time_ms=wall_time_ms)
    resolved = {
        "command": "replay",
        **source,
        "topology": "aggregated",
        "gpus_per_worker": gpus_per_worker,
        "record_passes": record_passes,
        **setup.to_json(),
        "trace_path": str(Path(setup.trace_path).resolve()),
    }
    passes = None
    if record_passes:
        passes = result.passes[0]
        if "rank" not in passes.columns:
            # ForwardPassMetrics name the attention-DP rank; only dp_size 1 is simulated
            passes.insert(passes.columns.get_loc("worker") + 1, "rank", 0)
    written = write_run(args.out, requests, passes, summary, resolved, overwrite=args.overwrite)
    return {"setup": setup, "summary": summary, "requests": requests, "written": written,
            "compile_ms": compile_ms}


# ---------------------------------------------------------------------------------------
# printing


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:,.{digits}f}"


def format_summary(setup: ReplaySetup, summary: dict, requests, written: dict,
                   compile_ms: float) -> str:
    status = requests["terminal_status"].to_numpy(object)
    rejected = int((status == "rejected").sum())
    wall_s = summary["wall_time_ms"] / MS_PER_S
    simulated_rps = summary["num_requests"] / wall_s if wall_s > 0 else math.inf
    lines = [
        f"replay: {Path(setup.trace_path).name} on {setup.workers} {setup.rank.backend} "
        f"worker(s)" + (f", closed loop {setup.concurrency}" if setup.concurrency else ""),
        f"  requests            {summary['num_requests']} arrived, "
        f"{summary['completed_requests']} completed, {rejected} rejected",
        f"  duration            {_fmt(summary['duration_ms'])} ms",
        f"  throughput          {_fmt(summary['request_throughput_rps'])} req/s, "
        f"{_fmt(summary['output_throughput_tok_s'], 1)} output tok/s, "
        f"{_fmt(summary['total_throughput_tok_s'], 1)} total tok/s",
        f"  {'latency (ms)':<18}{'mean':>12}{'p50':>12}{'p99':>12}",
    ]
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_latency_ms"),
                       ("ITL", "itl_ms")):
        lines.append(f"  {label:<18}{_fmt(summary['mean_' + key]):>12}"
                     f"{_fmt(summary['median_' + key]):>12}{_fmt(summary['p99_' + key]):>12}")
    lines += [
        f"  prefix reuse        {100.0 * summary['prefix_cache_reused_ratio']:.2f} % of input tokens",
        f"  wall time           {_fmt(summary['wall_time_ms'], 1)} ms "
        f"(kernels + driver; JIT compile / cache load {_fmt(compile_ms / MS_PER_S, 1)} s not counted)",
        f"  simulated speed     {_fmt(simulated_rps, 0)} requests per wall second",
        "wrote:",
    ]
    lines += [f"  {path}" for path in written.values()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# entry point


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 ok, 2 user error, 130 Ctrl-C)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        outcome = run_replay(args)
    except (UsageError, ConfigError, TraceError, SimulationError, OutputError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # e.g. the output folder's parent is not writable
        where = f" ({exc.filename})" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_summary(outcome["setup"], outcome["summary"], outcome["requests"],
                         outcome["written"], outcome["compile_ms"]))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
