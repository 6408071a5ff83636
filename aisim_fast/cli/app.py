"""Command line: ``aisim-fast replay``, ``aisim-fast sweep``, ``aisim-fast warmup``.

Two ways to describe a replay:

* ``aisim-fast replay --spec SPEC.json [--trace PATH] --out DIR`` runs a reference
  execution payload (``{"spec": ..., "traffic": ...}``); ``--trace`` replaces
  ``traffic.trace_path``, and a relative trace path in the spec resolves against the spec
  file's folder.
* ``aisim-fast replay [TRACE] --backend vllm|trtllm|sglang --workers N [--engine-args JSON] ...
  --out DIR`` for a Mooncake trace without a spec (no TRACE = the bundled default trace).
  ``--engine-args`` holds reference rank fields, e.g. ``'{"num_gpu_blocks": 4096}'``.
* ``aisim-fast replay [TRACE] --backend vllm|trtllm|sglang --prefill-workers P --decode-workers D
  [--prefill-engine-args JSON] [--decode-engine-args JSON] [--kv-transfer-bandwidth GBPS]
  [--kv-bytes-per-token N] [--handoff-latency-ms MS] --out DIR``: disaggregated
  prefill/decode pools with the KV handoff between them.

Outputs: DIR/requests.parquet, DIR/passes.parquet, DIR/summary.json, and with --events
DIR/kv_events.parquet, DIR/engine_events.parquet and DIR/pressure_events.parquet, with
--kv-events (or emit_kv_events in the spec) DIR/kv_events.parquet, with
--pressure-events DIR/pressure_events.parquet alone, with --output-events
DIR/output_events.parquet (see output.py).
Every user error (bad config, bad trace, refused output folder, a simulation that cannot
finish) ends with one line ``aisim-fast: error: ...`` on stderr and exit code 2, and
nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from aisim_fast import __version__
from aisim_fast.config.payload import (PLACEMENTS, SIMULATED_BACKENDS, ConfigError, ReplaySetup,
                                       check_attention_dp, check_disaggregated_pair, parse_payload,
                                       parse_placement, parse_rank, set_aic_timing)
from aisim_fast.io.output import (OutputError, check_out_dir, kv_capacity, prediction_provenance,
                                  requests_in_uuid_order, routing_summary, summarize_replay,
                                  write_run)
from aisim_fast.io import output as output_module
from aisim_fast.protocol.handoff.audit import audit_handoffs, audited_runs
from aisim_fast.kernels.jit import compile_notice
from aisim_fast.studies.plots import PlotError
from aisim_fast.io.progress import Progress
from aisim_fast.studies.sweeps import SweepError
from aisim_fast.engine.replay import SimulationError, run_batch, simulation_from_setup, warm_kernels
from aisim_fast.trace.workload import TraceError, TraceWarning, default_trace_path, load_mooncake

PROG = "aisim-fast"
EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
MS_PER_S = 1000.0
PROGRESS_DELAY_S = 2.0  # a replay shorter than this shows no progress line

# Flags that describe a replay without a spec; with --spec they would be silently
# ignored or contradict the spec, so they are refused.
DISAGG_FLAGS = (("prefill_workers", "--prefill-workers"), ("decode_workers", "--decode-workers"),
                ("prefill_engine_args", "--prefill-engine-args"),
                ("decode_engine_args", "--decode-engine-args"),
                ("kv_transfer_bandwidth", "--kv-transfer-bandwidth"),
                ("kv_bytes_per_token", "--kv-bytes-per-token"),
                ("handoff_latency_ms", "--handoff-latency-ms"),
                ("prefill_dp_size", "--prefill-dp-size"), ("decode_dp_size", "--decode-dp-size"))
NO_SPEC_FLAGS = (("backend", "--backend"), ("workers", "--workers"),
                 ("engine_args", "--engine-args"), ("concurrency", "--concurrency"),
                 ("trace_block_size", "--trace-block-size"),
                 ("arrival_speedup_ratio", "--arrival-speedup-ratio"),
                 ("placement", "--placement"), ("placement_seed", "--placement-seed"),
                 ("router_json", "--router-json"), ("dp_size", "--dp-size"),
                 ("max_sim_time_ms", "--max-sim-time-ms")) + DISAGG_FLAGS
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
        "replay", help="replay a Mooncake trace on vLLM / TRT-LLM workers (aggregated or "
                       "disaggregated prefill/decode)",
        description="Replay a Mooncake JSONL trace. Either --spec SPEC.json (a reference "
                    "execution payload) or --backend with --workers (aggregated) or "
                    "--prefill-workers and --decode-workers (disaggregated).")
    replay.add_argument("trace", nargs="?", metavar="TRACE",
                        help="Mooncake JSONL trace (without --spec; default: the bundled trace)")
    replay.add_argument("--spec", metavar="SPEC.json",
                        help="reference execution payload {\"spec\": ..., \"traffic\": ...}")
    replay.add_argument("--trace", dest="trace_flag", metavar="PATH",
                        help="trace file; with --spec it replaces traffic.trace_path")
    replay.add_argument("--backend", choices=SIMULATED_BACKENDS,
                        help="rank scheduler (sglang: its num_gpu_blocks counts pages of block_size "
                             "tokens, default 1, so it is a token count; disaggregated sglang reserves "
                             "the decode slot before the prefill)")
    replay.add_argument("--workers", type=int, metavar="N", help="aggregated workers")
    replay.add_argument("--dp-size", type=int, metavar="N",
                        help="attention-DP ranks per aggregated worker, behind one pass barrier "
                             "(default 1; spec: engine.dp_size)")
    replay.add_argument("--engine-args", metavar="JSON",
                        help="JSON object of reference rank fields, merged over {\"backend\": ...}; "
                             "SGLang knobs in its \"sglang\" block (schedule_policy, max_prefill_tokens, "
                             "chunked_prefill_size, clip_max_new_tokens, schedule_conservativeness)")
    disagg = replay.add_argument_group(
        "disaggregated prefill/decode (instead of --workers / --engine-args)")
    disagg.add_argument("--prefill-workers", type=int, metavar="P", help="prefill pool size")
    disagg.add_argument("--decode-workers", type=int, metavar="D", help="decode pool size")
    disagg.add_argument("--prefill-engine-args", metavar="JSON", help="rank fields of the prefill pool")
    disagg.add_argument("--decode-engine-args", metavar="JSON", help="rank fields of the decode pool")
    disagg.add_argument("--prefill-dp-size", type=int, metavar="N",
                        help="attention-DP ranks per prefill worker (default 1; spec: "
                             "engine.prefill.dp_size)")
    disagg.add_argument("--decode-dp-size", type=int, metavar="N",
                        help="attention-DP ranks per decode worker (default 1; spec: engine.decode.dp_size)")
    disagg.add_argument("--kv-transfer-bandwidth", type=float, metavar="GBPS",
                        help="KV transfer bandwidth, decimal GB/s (0 or unset: --handoff-latency-ms)")
    disagg.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                        help="KV bytes per prompt token moved from prefill to decode")
    disagg.add_argument("--handoff-latency-ms", type=float, metavar="MS",
                        help="transfer delay when bandwidth or bytes per token is unset (default 0)")
    replay.add_argument("--concurrency", type=int, metavar="N",
                        help="closed loop: at most N sessions in flight (default: trace timestamps)")
    replay.add_argument("--trace-block-size", type=int, metavar="TOKENS",
                        help=f"tokens per trace hash id (default {DEFAULT_TRACE_BLOCK_SIZE})")
    replay.add_argument("--arrival-speedup-ratio", type=float, metavar="RATIO",
                        help="divide trace timestamps and think times by RATIO (default 1.0)")
    replay.add_argument("--max-sim-time-ms", type=float, metavar="MS",
                        help="stop the simulation after its last instant at or before MS of "
                             "simulated time: requests unfinished by then get no row and "
                             "count only as arrivals (spec: max_sim_time_ms)")
    replay.add_argument("--placement", choices=PLACEMENTS,
                        help="worker placement (default round_robin, the reference's; random: "
                             "uniform from a seeded generator)")
    replay.add_argument("--placement-seed", type=int, metavar="N",
                        help="seed of --placement random or kv_router (ties, sampling; default 0)")
    replay.add_argument("--router-json", metavar="JSON",
                        help="kv_router knobs: overlap_score_credit, prefill_load_scale, "
                             "router_temperature, pin_to_trace_worker (Dynamo's names)")
    _add_aic_flags(replay)
    replay.add_argument("--out", required=True, metavar="DIR", help="output folder")
    replay.add_argument("--overwrite", action="store_true",
                        help="replace an existing output folder of an earlier run")
    replay.add_argument("--no-passes", action="store_true",
                        help="do not record forward passes (no passes.parquet)")
    replay.add_argument("--events", action="store_true",
                        help="also write kv_events.parquet (KV Stored / Removed facts), "
                             "engine_events.parquet (admissions, preemptions, finishes) and "
                             "pressure_events.parquet")
    replay.add_argument("--kv-events", action="store_true",
                        help="also write kv_events.parquet: the KV events each worker emits "
                             "(Stored / Removed, one row per block: event id, visibility time, "
                             "block, parent and tokens hashes; the reference's event stream; "
                             "SGLang: its radix cache's pages); emit_kv_events: true in a spec's "
                             "rank does the same")
    replay.add_argument("--pressure-events", action="store_true",
                        help="also write pressure_events.parquet: one row per vLLM preemption "
                             "or SGLang retraction (worker, request, running / waiting requests "
                             "and active blocks before and after; any backend)")
    replay.add_argument("--quiet", action="store_true",
                        help="no progress line (shown on stderr for runs longer than a few seconds)")
    replay.add_argument("--output-events", action="store_true",
                        help="also write output_events.parquet: one row per output token "
                             "(request, worker, pass end time, token index)")
    models = commands.add_parser(
        "models", help="models the installed AIC perf database covers (extra aisim-fast[aic])",
        description="List the model ids --model and timing_model.config.model accept.")
    models.add_argument("--grep", metavar="TEXT", help="only ids containing TEXT (case-insensitive)")
    systems = commands.add_parser(
        "systems", help="GPU systems of the installed AIC perf database, with framework versions",
        description="List the GPU systems --system accepts and, per framework, the versions "
                    "of its perf data (current first).")
    systems.add_argument("--backend", choices=("vllm", "trtllm", "sglang"),
                         help="only this framework's versions")
    warmup = commands.add_parser(
        "warmup", help="compile the kernels into the on-disk cache (for images and CI)",
        description="Compile (or load from the cache) the kernels a replay uses, by running "
                    "a few requests of the bundled trace on every backend, so that later runs "
                    "start at once.")
    warmup.add_argument("--topology", choices=("aggregated", "disaggregated", "sglang", "sglang_disaggregated", "rank", "all"), default="all",
                        help="which kernels: a replay topology, rank (the rank protocol API), or all (every replay topology; default)")
    sweep = commands.add_parser(
        "sweep", help="run many configurations of one base payload (grid, zip, random axes)",
        description="Run a sweep spec (YAML or JSON; see aisim_fast/studies/sweeps.py and the README): "
                    "points.parquet (one row per point), requests/point=<id>/part-0.parquet, "
                    "manifest.json. An interrupted sweep keeps its finished points; --resume "
                    "runs the rest.")
    sweep.add_argument("sweep_spec", metavar="SPEC", help="sweep spec file (.yaml / .yml / .json)")
    sweep.add_argument("--out", required=True, metavar="DIR", help="output folder")
    sweep.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="local worker processes (default 1: this process)")
    sweep.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the batches on this Dask distributed scheduler")
    sweep.add_argument("--batch-size", type=int, metavar="N",
                       help="points per kernel batch (default: the spec's batch_size, else 64)")
    sweep.add_argument("--resume", action="store_true", help="run only the points DIR lacks")
    sweep.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in DIR")
    sweep.add_argument("--no-requests", action="store_true",
                       help="do not write the per-request dataset")
    sweep.add_argument("--quiet", action="store_true", help="no progress output")
    _add_aic_flags(sweep)
    size = commands.add_parser(
        "size", help="find the fewest GPUs that meet an SLA at a trace's load",
        description="Size a base payload: the cheapest worker count (or prefill/decode split) "
                    "whose replay meets the SLA for the --goodput fraction of requests, by batched "
                    "sweeps (a coarse grid, then every cheaper candidate near its best point).")
    size.add_argument("--spec", required=True, metavar="SPEC.json", help="base execution payload")
    size.add_argument("--trace", metavar="PATH", help="replace the payload's traffic.trace_path")
    size.add_argument("--sla", required=True, metavar="ttft_ms=..,itl_ms=..",
                      help="SLA bounds, comma-separated (ttft_ms, itl_ms, e2e_ms)")
    size.add_argument("--goodput", type=float, default=0.99, metavar="F",
                      help="fraction of requests that must meet the SLA (default 0.99)")
    size.add_argument("--max-workers", type=int, default=64, metavar="N",
                      help="largest worker count (both pools together) to consider (default 64)")
    size.add_argument("--rates", metavar="R1,R2,..",
                      help="size for these arrival speedup ratios (offered loads), one answer each")
    size.add_argument("--jobs", type=int, default=1, metavar="N", help="local worker processes")
    _add_aic_flags(size)
    plot = commands.add_parser(
        "plot", help="PNG plots of a sweep or replay folder (DIR/plots/)",
        description="A sweep folder: Pareto fronts of throughput per GPU against throughput per "
                    "user and against TTFT p90. A replay folder: TTFT/TPOT CDFs and throughput, "
                    "queue depth and KV use over time.")
    plot.add_argument("folder", metavar="DIR", help="output folder of aisim-fast sweep or replay")
    return parser


def _add_aic_flags(parser) -> None:
    aic_flags = parser.add_argument_group(
        "op-level timing (AIC)", "time passes for a model on a GPU system from the perf database "
        "of the optional extra aisim-fast[aic] (with --spec: replaces every pool's timing)")
    aic_flags.add_argument("--model", metavar="ID", help="model, e.g. Qwen/Qwen3-32B ('aisim-fast models')")
    aic_flags.add_argument("--system", metavar="GPU", help="GPU system, e.g. h200_sxm ('aisim-fast systems')")
    aic_flags.add_argument("--tp", type=int, metavar="N", help="tensor parallel size (GPUs per worker)")
    aic_flags.add_argument("--backend-version", metavar="V",
                           help="framework version of the perf data (default: the database's current)")


def _aic_flags(args) -> dict:
    """The given --model / --system / --tp / --backend-version, by set_aic_timing name."""
    return {k: getattr(args, k) for k in ("model", "system", "tp", "backend_version")
            if getattr(args, k, None) is not None}


def _sla_flag(text: str) -> dict:
    sla = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "itl_ms", "e2e_ms"):
            raise UsageError(f"--sla: unknown bound {key!r}; allowed: ttft_ms, itl_ms, e2e_ms")
        try:
            sla[key] = float(value)
        except ValueError:
            raise UsageError(f"--sla: {key} needs a number, got {value!r}") from None
    return sla


def run_listing(args) -> str:
    """``aisim-fast models`` / ``systems``: what the installed perf database covers."""
    from aisim_fast.aic import timing as aic

    try:
        if args.command == "models":
            ids = [m for m in aic.models() if not args.grep or args.grep.lower() in m.lower()]
            return "\n".join(ids) if ids else f"no model id contains {args.grep!r}"
        lines = []
        for system in aic.systems():
            versions = []
            for backend in ([args.backend] if args.backend else ["vllm", "trtllm", "sglang"]):
                slots = aic.backend_versions(system, backend)
                if slots:
                    ordered = sorted(slots.items(), key=lambda kv: kv[0] != "current")
                    versions.append(f"{backend} " + ", ".join(f"{v} ({k})" for k, v in ordered))
            if versions:
                lines.append(f"{system:12s} " + "; ".join(versions))
        return "\n".join(lines)
    except aic.AicError as exc:
        raise ConfigError(str(exc)) from None


def run_size_command(args) -> str:
    from aisim_fast.studies.sizing import format_answers, size

    sla = _sla_flag(args.sla)
    rates = (None,)
    if args.rates:
        try:
            rates = tuple(float(r) for r in args.rates.split(","))
        except ValueError:
            raise UsageError(f"--rates: numbers separated by commas, got {args.rates!r}") from None
    answers = size(args.spec, sla, trace=args.trace, goodput=args.goodput,
                   max_workers=args.max_workers, rates=rates, jobs=args.jobs,
                   timing=_aic_flags(args) or None)
    return format_answers(answers, sla, args.goodput)


def run_sweep_command(args) -> str:
    """Run ``aisim-fast sweep``; returns the closing summary text."""
    from aisim_fast.studies.sweeps import POINTS_FILE, run_sweep

    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size: must be >= 1, got {args.batch_size}")
    start_s = time.perf_counter()
    points = run_sweep(args.sweep_spec, args.out, jobs=args.jobs, scheduler=args.scheduler,
                       batch_size=args.batch_size, resume=args.resume, overwrite=args.overwrite,
                       requests=not args.no_requests, quiet=args.quiet,
                       timing=_aic_flags(args) or None)
    counts = points["status"].value_counts().to_dict() if len(points) else {}
    by_status = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return (f"{len(points)} points ({by_status}) in {time.perf_counter() - start_s:.1f} s\n"
            f"  {Path(args.out) / POINTS_FILE}")


def run_warmup(args) -> None:
    """Compile the chosen topologies' kernels: a tiny batch with every simulated backend."""
    topologies = (("aggregated", "disaggregated", "sglang", "sglang_disaggregated") if args.topology == "all"
                  else (args.topology,))
    for topology, seconds in warm_kernels(topologies).items():
        print(f"{topology:14s} ready ({seconds:.1f} s)")


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
    if _aic_flags(args):
        payload = set_aic_timing(payload, **_aic_flags(args), where="--")
    setup = parse_payload(payload, spec_path.parent, args.trace_flag)
    source = {"mode": "spec", "spec_file": str(spec_path.resolve()),
              "trace_override": args.trace_flag is not None}
    return setup, setup.gpus_per_worker, source


def _engine_args(text: str | None, flag: str, backend: str) -> dict:
    """Reference rank fields from a --*engine-args JSON object, over {"backend": ...}."""
    fields = {"backend": backend}
    if text is None:
        return fields
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"{flag}: must be a JSON object of rank fields, got {extra!r}")
    if "backend" in extra and extra["backend"] != backend:
        raise ConfigError(f"{flag}.backend: {extra['backend']!r} contradicts --backend {backend} "
                          "(prefill and decode pools must use the same backend)")
    fields.update(extra)
    return fields


def _flag_count(value: int | None, flag: str) -> int:
    if value is None or value < 1:
        raise ConfigError(f"{flag}: must be an integer >= 1, got {value}")
    return value


def _disaggregated_from_flags(args) -> dict:
    """Pools and transfer model of a disaggregated replay given by flags. The transfer
    flags are the source (prefill) ranks' engine args; a value also given in an
    engine-args JSON must agree with the flag."""
    if args.workers is not None:
        raise UsageError("--workers is the aggregated pool size; with --prefill-workers give "
                         "--decode-workers instead")
    if args.engine_args is not None:
        raise UsageError("--engine-args describes an aggregated pool; use --prefill-engine-args "
                         "and --decode-engine-args")
    if args.decode_workers is None or args.prefill_workers is None:
        raise UsageError("a disaggregated replay needs both --prefill-workers and --decode-workers")
    transfer = {}
    if args.kv_transfer_bandwidth is not None:
        bw = args.kv_transfer_bandwidth
        if not math.isfinite(bw) or bw < 0:
            raise ConfigError(f"--kv-transfer-bandwidth: must be a finite number >= 0 "
                              f"(decimal GB/s), got {bw}")
        transfer["kv_transfer_bandwidth"] = bw
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token < 1:
            raise ConfigError(f"--kv-bytes-per-token: must be an integer >= 1, got "
                              f"{args.kv_bytes_per_token}")
        transfer["kv_transfer_bytes_per_token"] = args.kv_bytes_per_token
    latency = 0.0 if args.handoff_latency_ms is None else args.handoff_latency_ms
    if not math.isfinite(latency) or latency < 0:
        raise ConfigError(f"--handoff-latency-ms: must be a finite number >= 0, got {latency}")
    pools = {}
    for role, text, flag in (("prefill", args.prefill_engine_args, "--prefill-engine-args"),
                             ("decode", args.decode_engine_args, "--decode-engine-args")):
        fields = _engine_args(text, flag, args.backend)
        for key, value in transfer.items():
            if key in fields and fields[key] != value:
                raise ConfigError(f"{flag}.{key}: {fields[key]!r} contradicts the flag value {value!r}")
            fields[key] = value
        if fields.setdefault("worker_type", role) != role:
            raise ConfigError(f"{flag}.worker_type: must be {role!r}, got {fields['worker_type']!r}")
        pools[role] = parse_rank(fields, flag)
    check_disaggregated_pair(pools["prefill"], pools["decode"], "--decode-engine-args")
    dp = {role: 1 if value is None else _flag_count(value, flag)
          for role, value, flag in (("prefill", args.prefill_dp_size, "--prefill-dp-size"),
                                    ("decode", args.decode_dp_size, "--decode-dp-size"))}
    for role, flag in (("prefill", "--prefill-engine-args"), ("decode", "--decode-engine-args")):
        check_attention_dp(pools[role], dp[role], flag, role)
    return dict(rank=pools["decode"], workers=_flag_count(args.decode_workers, "--decode-workers"),
                prefill_rank=pools["prefill"],
                prefill_workers=_flag_count(args.prefill_workers, "--prefill-workers"),
                handoff_latency_ms=float(latency), dp_size=dp["decode"], prefill_dp_size=dp["prefill"])


def _setup_from_flags(args) -> tuple[ReplaySetup, int, dict]:
    if args.trace is not None and args.trace_flag is not None:
        raise UsageError("give the trace either as TRACE or as --trace, not both")
    disaggregated = any(getattr(args, attr) is not None for attr, _ in DISAGG_FLAGS)
    missing = [flag for flag, absent in (("--backend", args.backend is None),
                                         ("--workers", args.workers is None and not disaggregated))
               if absent]
    if missing:
        raise UsageError(f"without --spec, {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} required"
                         + (" (or --prefill-workers and --decode-workers for disaggregated pools)"
                            if "--workers" in missing else ""))
    if _aic_flags(args):
        # the flags' pools, timed by AIC: one payload through the spec path's parser
        return _setup_from_flag_payload(args, disaggregated)
    if disaggregated:
        if args.prefill_workers is None and args.decode_workers is None:
            given = [flag for attr, flag in DISAGG_FLAGS if getattr(args, attr) is not None]
            raise UsageError(f"{', '.join(given)} need a disaggregated topology: give "
                             "--prefill-workers and --decode-workers")
        if args.dp_size is not None:
            raise UsageError("--dp-size: sets the aggregated workers' ranks; a disaggregated pool's are "
                             "--prefill-dp-size and --decode-dp-size")
        topology = _disaggregated_from_flags(args)
    else:
        topology = dict(rank=parse_rank(_engine_args(args.engine_args, "--engine-args", args.backend),
                                        "--engine-args"),
                        workers=_flag_count(args.workers, "--workers"),
                        dp_size=1 if args.dp_size is None else _flag_count(args.dp_size, "--dp-size"))
        check_attention_dp(topology["rank"], topology["dp_size"], "--engine-args")
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
    if args.placement_seed is not None and args.placement not in ("random", "kv_router"):
        raise UsageError("--placement-seed needs --placement random or kv_router")
    if args.router_json is not None and args.placement != "kv_router":
        raise UsageError("--router-json needs --placement kv_router")
    if args.placement_seed is not None and not 0 <= args.placement_seed < 2 ** 63:
        raise ConfigError(f"--placement-seed: must be an integer in [0, 2**63), got {args.placement_seed}")
    router = None
    if args.placement == "kv_router":
        try:
            knobs = json.loads(args.router_json) if args.router_json is not None else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--router-json: not valid JSON ({exc})") from None
        if not isinstance(knobs, dict) or "seed" in knobs:
            raise ConfigError("--router-json: must be a JSON object of router knobs (the seed is "
                              "--placement-seed)")
        _, _, router = parse_placement({"provider": "kv_router", "config": knobs}, "--router-json")
    max_sim_time_ms = None
    if args.max_sim_time_ms is not None:
        max_sim_time_ms = args.max_sim_time_ms
        if not (math.isfinite(max_sim_time_ms) and max_sim_time_ms >= 0.0):
            raise ConfigError(f"--max-sim-time-ms: must be a finite number >= 0, got {max_sim_time_ms}")
    setup = ReplaySetup(trace_path=trace_path, trace_block_size=block_tokens,
                        arrival_speedup_ratio=ratio, concurrency=concurrency, sla={},
                        placement=args.placement or "round_robin",
                        placement_seed=args.placement_seed or 0, router=router,
                        max_sim_time_ms=max_sim_time_ms, **topology)
    return setup, setup.gpus_per_worker, {"mode": "flags", "default_trace": default_trace}


def _setup_from_flag_payload(args, disaggregated: bool) -> tuple[ReplaySetup, int, dict]:
    """Flags with --model / --system: the setup the flags give, as a payload, with
    every pool's timing set by set_aic_timing (which also sets tensor parallelism)."""
    plain = argparse.Namespace(**{**vars(args), "model": None, "system": None, "tp": None,
                                  "backend_version": None})
    setup, _, source = _setup_from_flags(plain)

    def block(rank, tp):
        return {"tensor_parallel_size": tp, "rank": rank.payload()}

    explicit_blocks = "num_gpu_blocks" in json.dumps([args.engine_args, args.prefill_engine_args,
                                                      args.decode_engine_args])
    if disaggregated:
        topology = {"kind": "disaggregated", "prefill": {"initial_workers": setup.prefill_workers},
                    "decode": {"initial_workers": setup.workers},
                    "handoff_latency_ms": setup.handoff_latency_ms}
        engine = {"prefill": {**block(setup.prefill_rank, 1), "dp_size": setup.prefill_dp_size},
                  "decode": {**block(setup.rank, 1), "dp_size": setup.dp_size}}
    else:
        topology = {"kind": "aggregated", "workers": {"initial_workers": setup.workers}}
        engine = {**block(setup.rank, 1), "dp_size": setup.dp_size}
    if not explicit_blocks:  # no --*engine-args capacity: estimated from model + GPU memory
        for b in ([engine["prefill"], engine["decode"]] if disaggregated else [engine]):
            b["rank"].pop("num_gpu_blocks", None)
    payload = {"spec": {"topology": topology, "engine": engine,
                        "adapters": {"placement": {"provider": setup.placement,
                                                   "config": _placement_config(setup)}},
                        "max_sim_time_ms": setup.max_sim_time_ms},
               "traffic": {"trace_path": setup.trace_path, "trace_block_size": setup.trace_block_size,
                           "arrival_speedup_ratio": setup.arrival_speedup_ratio,
                           **({"load_type": "concurrency", "replay_concurrency": setup.concurrency}
                              if setup.concurrency else {})}}
    payload = set_aic_timing(payload, **_aic_flags(args), where="--")
    setup = parse_payload(payload, ".", None)
    return setup, setup.gpus_per_worker, source


def _placement_config(setup: ReplaySetup) -> dict | None:
    if setup.placement == "random":
        return {"seed": setup.placement_seed}
    if setup.placement == "kv_router":
        return {"seed": setup.placement_seed, **dataclasses.asdict(setup.router)}
    return None


def _load_trace(setup: ReplaySetup, max_rows: int | None = None):
    path = Path(setup.trace_path)
    if not path.exists():
        raise TraceError(str(path), None, "trace file not found")
    if path.is_dir():
        raise TraceError(str(path), None, "is a folder, not a trace file")
    try:
        return load_mooncake(path, trace_block_size=setup.trace_block_size,
                             arrival_speedup_ratio=setup.arrival_speedup_ratio, max_rows=max_rows,
                             closed_loop=setup.concurrency > 0)
    except OSError as exc:
        raise TraceError(str(path), None, f"cannot read ({exc.strerror or exc})") from None


# ---------------------------------------------------------------------------------------
# running


def _warm_up(setup: ReplaySetup) -> None:
    """Run the first trace row alone so the JIT compile (or cache load) of the kernels is
    not counted in wall_time_ms, which measures simulation speed (spec replay.md 12.8)."""
    with warnings.catch_warnings():  # the full load below says it, with its counts
        warnings.simplefilter("ignore", TraceWarning)
        first_row = _load_trace(setup, max_rows=1)
    try:
        run_batch([simulation_from_setup(setup, first_row)], record_passes=False)
    except SimulationError:
        pass  # the real run reports it, with the real request count


def run_replay(args) -> dict:
    """Resolve, simulate, and write one replay. Returns what the summary table shows."""
    if args.spec is not None:
        setup, gpus_per_worker, source = _setup_from_spec(args)
    else:
        setup, gpus_per_worker, source = _setup_from_flags(args)
    kv_events = args.kv_events or args.events or any(rank.emit_kv_events for _, rank in setup.pools)
    # refuse a bad --out before spending time on the simulation (checked again at write)
    check_out_dir(args.out, args.overwrite, probe=True)
    # (the replay's kernel set, named with its features, is announced as it compiles)
    compile_notice(["trace"])
    workload = _load_trace(setup)
    _raise_pending_sigterm()

    compile_start_s = time.perf_counter()
    _warm_up(setup)
    _raise_pending_sigterm()
    compile_ms = (time.perf_counter() - compile_start_s) * MS_PER_S

    record_passes = not args.no_passes
    run_start_s = time.perf_counter()
    simulation = simulation_from_setup(setup, workload)
    progress = Progress(workload.num_requests, desc=PROG, unit="requests", quiet=args.quiet,
                        delay_s=PROGRESS_DELAY_S)

    def report(sim_ms: float, done: int, total: int) -> None:
        _raise_pending_sigterm()
        rate = done / max(time.perf_counter() - run_start_s, 1e-9)
        progress.update(done, f"t={sim_ms / MS_PER_S:,.0f} s simulated, {rate:,.0f} requests/s")

    try:
        result = run_batch([simulation], record_passes=record_passes, record_events=kv_events,
                           record_outputs=args.output_events, progress=report,
                           record_pressure=args.pressure_events, spill_passes=record_passes).check()
    finally:
        progress.close()
    # floored so the per-wall-second rates stay finite on a clock with coarse ticks
    wall_time_ms = max((time.perf_counter() - run_start_s) * MS_PER_S, 1e-6)

    requests = requests_in_uuid_order(result.requests[0], workload.session, workload.turn_index)
    # (a time cap may end a run before anything completes: it still reports)
    if not (requests["terminal_status"] == "completed").any() and setup.max_sim_time_ms is None:
        raise SimulationError(_nothing_completed(setup, requests))
    if setup.disaggregated:
        # every handoff re-checked by the coordinator (outside the timed run)
        audit_handoffs(audited_runs([simulation], result))
    summary = summarize_replay(setup, requests, result.token_stat[0], result.token_hist[0],
                               end_ms=float(result.end_ms[0]), gpus_per_worker=gpus_per_worker,
                               wall_time_ms=wall_time_ms, cap=result.capped[0])
    resolved = {
        "command": "replay",
        **source,
        "topology": "disaggregated" if setup.disaggregated else "aggregated",
        "gpus_per_worker": gpus_per_worker,
        "record_passes": record_passes,
        "record_events": args.events,
        "record_kv_events": kv_events,
        "record_pressure": args.pressure_events,
        "record_outputs": args.output_events,
        **setup.to_json(),
        "trace_path": str(Path(setup.trace_path).resolve()),
    }
    if setup.placement == "kv_router":
        routing = result.routing[0]
        summary.update(routing_summary(routing))
    summary["rejected_by_cause"] = rejection_causes(setup, requests)
    summary.update(pressure_counts(setup, requests))
    summary["prediction_provenance"] = prediction_provenance(setup)
    summary["kv_capacity"] = kv_capacity(setup)
    passes = None
    if record_passes:
        if any(rank.aic is not None for _, rank in setup.pools):
            from aisim_fast.aic import timing as aic
            evidence = aic.op_latency_evidence(setup, result.passes[0])
            if evidence is not None:
                summary["op_latency_evidence"] = evidence
        # the pass log as it was drained, part by part (a million-request run has tens
        # of millions of passes: never one frame, never sorted in memory)
        passes = _with_rank(result.pass_parts(0))
    events = {}
    if kv_events:
        events["kv_events"] = result.kv_events[0]
    if args.events:
        events["engine_events"] = result.engine_events[0]
    if args.events or args.pressure_events:
        events["pressure_events"] = result.pressure_events[0]
    if args.output_events:
        events["output_events"] = result.output_events[0]
    if setup.placement == "kv_router":
        events["routing"] = routing
    _raise_pending_sigterm()
    written = write_run(args.out, requests, passes, summary, resolved, overwrite=args.overwrite,
                        events=events)
    return {"setup": setup, "summary": summary, "requests": requests, "written": written,
            "compile_ms": compile_ms}


def _with_rank(parts):
    """Pass-log parts (Arrow tables) with the attention-DP ``rank`` right after
    ``worker``, as ForwardPassMetrics name them."""
    for part in parts:
        names = [c for c in part.column_names if c != "rank"]
        names.insert(names.index("worker") + 1, "rank")
        yield part.select(names)


def pressure_counts(setup: ReplaySetup, requests) -> dict:
    """The run's pressure actions by kind (the reference's ``vllm_preemptions_total`` /
    ``sglang_retractions_total``): every preemption of every request, both pools of a
    disaggregated run (one backend there)."""
    total = int(requests["preemptions"].sum())
    sglang = setup.rank.backend == "sglang"
    return {"vllm_preemptions_total": 0 if sglang else total,
            "sglang_retractions_total": total if sglang else 0}


def rejection_causes(setup: ReplaySetup, requests) -> dict:
    """Rejected requests by cause: ``max_model_len`` (prompt at or over the limit) and
    ``kv_pool`` (a prompt the pool of its first rank can never hold)."""
    status = requests["terminal_status"].to_numpy(object)
    prompt = requests["input_tokens"].to_numpy(np.int64)
    rejected = status == "rejected"
    limit = setup.rank.max_model_len
    too_long = rejected & (prompt >= limit) if limit is not None else np.zeros(len(status), bool)
    return {"max_model_len": int(too_long.sum()), "kv_pool": int((rejected & ~too_long).sum())}


def _describe_rejections(setup: ReplaySetup, causes: dict) -> list[str]:
    rank = setup.prefill_rank if setup.disaggregated else setup.rank
    out = []
    if causes["max_model_len"]:
        out.append(f"{causes['max_model_len']} with a prompt of max_model_len "
                   f"({setup.rank.max_model_len}) tokens or more")
    if causes["kv_pool"]:
        out.append(f"{causes['kv_pool']} that do not fit the KV pool ({rank.num_gpu_blocks} blocks x "
                   f"{rank.block_size} tokens); raise num_gpu_blocks")
    return out


def _nothing_completed(setup: ReplaySetup, requests) -> str:
    """Why a run completed no request: the rejections by cause (nothing is written, and
    the summary's latencies would only be the reference's 0.0 of an empty sample)."""
    status = requests["terminal_status"].to_numpy(object)
    rejected = status == "rejected"
    causes = _describe_rejections(setup, rejection_causes(setup, requests))
    others = int((~rejected).sum())
    if others:
        causes.append(f"{others} ended otherwise ({', '.join(sorted(set(status[~rejected]) - {''}) or ['unfinished'])})")
    return f"no request completed: of {len(status)}, " + "; ".join(causes)


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
    pools = (f"{setup.prefill_workers} prefill + {setup.workers} decode" if setup.disaggregated
             else f"{setup.workers}")
    dp = ""  # attention-DP ranks per worker, when some pool has several
    if setup.disaggregated and max(setup.prefill_dp_size, setup.dp_size) > 1:
        dp = f", attention DP {setup.prefill_dp_size} / {setup.dp_size} ranks per prefill / decode worker"
    elif not setup.disaggregated and setup.dp_size > 1:
        dp = f", attention DP {setup.dp_size} ranks per worker"
    lines = [
        f"replay: {Path(setup.trace_path).name} on {pools} {setup.rank.backend} "
        f"worker(s)" + dp + (f", closed loop {setup.concurrency}" if setup.concurrency else ""),
        f"  requests            {summary['num_requests']} arrived, "
        f"{summary['completed_requests']} completed, {rejected} rejected"
        + ("" if setup.max_sim_time_ms is None else
           f", {summary['num_requests'] - len(requests)} unfinished at the "
           f"{_fmt(setup.max_sim_time_ms)} ms cap"),
        *(["  rejected            " + "; ".join(_describe_rejections(
            setup, summary.get("rejected_by_cause") or rejection_causes(setup, requests)))]
          if rejected else []),
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
        *([f"  KV pressure         {summary['vllm_preemptions_total']} preemptions"]
          if summary.get("vllm_preemptions_total") else []),
        *([f"  KV pressure         {summary['sglang_retractions_total']} retractions"]
          if summary.get("sglang_retractions_total") else []),
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


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that a run being written cleans up."""


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Trace warnings as one line each (``aisim-fast: warning: FILE:LINE: ...``)."""
    if issubclass(category, TraceWarning):
        print(f"{PROG}: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


# a SIGTERM that came while llvmlite ran Python code from a native callback (loading
# or compiling a kernel): raised there, the exception would be printed and lost, so it
# is raised at the next check (_raise_pending_sigterm) instead
_PENDING_SIGTERM = [False]


def _on_sigterm(signum, frame):
    if output_module.COMMITTED[0] is not None or output_module.COMMITTING[0]:
        return  # the run folder is (being) written: finish, print the summary, exit 0
    f = frame
    while f is not None:
        if "llvmlite" in f.f_code.co_filename:
            _PENDING_SIGTERM[0] = True
            return
        f = f.f_back
    raise _Terminated()


def _raise_pending_sigterm() -> None:
    if _PENDING_SIGTERM[0]:
        _PENDING_SIGTERM[0] = False
        raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 ok, 2 user error, 130 Ctrl-C,
    143 SIGTERM: a run being written removes its staging folder either way)."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    output_module.COMMITTED[0] = None
    _PENDING_SIGTERM[0] = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return _main(argv)
    finally:
        warnings.showwarning = shown
        if argv is not None or output_module.COMMITTED[0] is None:
            signal.signal(signal.SIGTERM, previous)
        else:
            # the process's own command line wrote its run and exits now. Ignored, not
            # handled: the interpreter's shutdown resets handled signals to the default
            # action, so a SIGTERM then would kill a process whose run is written
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        if args.command == "warmup":
            run_warmup(args)
            return EXIT_OK
        if args.command == "sweep":
            print(run_sweep_command(args))
            return EXIT_OK
        if args.command == "size":
            print(run_size_command(args))
            return EXIT_OK
        if args.command in ("models", "systems"):
            print(run_listing(args))
            return EXIT_OK
        if args.command == "plot":
            from aisim_fast.studies.plots import plot_folder

            for path in plot_folder(args.folder):
                print(f"  {path}")
            return EXIT_OK
        outcome = run_replay(args)
    except (UsageError, ConfigError, TraceError, SimulationError, OutputError, SweepError,
            PlotError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # e.g. the output folder's parent is not writable
        where = f" ({exc.filename})" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}")
    except (KeyboardInterrupt, SystemError) as exc:
        if isinstance(exc, SystemError):
            # a native caller (a Numba dispatcher) that got the signal's exception from
            # a Python callback reports it as a SystemError caused by it
            if not isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
                raise
            exc = exc.__cause__ or exc.__context__
        code = EXIT_TERMINATED if isinstance(exc, _Terminated) else EXIT_INTERRUPTED
        if args.command == "sweep":
            print(f"{PROG}: interrupted; every finished point is kept in {args.out}, "
                  "--resume runs the rest", file=sys.stderr)
            return code
        print(f"{PROG}: interrupted; nothing written", file=sys.stderr)
        return code
    print(format_summary(outcome["setup"], outcome["summary"], outcome["requests"],
                         outcome["written"], outcome["compile_ms"]))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
