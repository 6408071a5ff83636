"""What each command does: replay, sweep, size, warmup, the listings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path

import pandas as pd

from aisim_fast.aic import timing as aic
from aisim_fast.cli.console import MS_PER_S, nothing_completed, pressure_counts, rejection_causes, with_rank
from aisim_fast.cli.flags import at_flag, payload_from_flags, setup_from_flags, setup_from_spec
from aisim_fast.cli.parser import EXIT_NO_ANSWER, EXIT_OK, PROG, UsageError, aic_flags, int_choices
from aisim_fast.cli.signals import interruptible, raise_pending_sigterm
from aisim_fast.config.payload import (SIMULATED_BACKENDS, ConfigError, ReplaySetup, parse_payload,
                                       read_payload_file)
from aisim_fast.config.predict_config import read_predict_config
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import SimulationError, setup_workload, simulation_from_setup
from aisim_fast.engine.warmup import warm_kernels
from aisim_fast.io.progress import Progress
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.io.run_folder import check_out_dir, write_folder, write_run
from aisim_fast.kernels.jit import compile_notice
from aisim_fast.protocol.handoff.audit import audit_handoffs, audited_runs
from aisim_fast.report.agentic import setup_report_keys as agentic_report_keys
from aisim_fast.report.sla import parse_sla_text
from aisim_fast.report.summary import (
    kv_capacity,
    power_report,
    prediction_provenance,
    routing_summary,
    summarize_replay,
)
from aisim_fast.studies.over_time import format_over_time, plot_over_time, size_over_time
from aisim_fast.studies.plots import plot_sizing, sizing_report
from aisim_fast.studies.sizing import (ANSWER_JSON, REPLICAS_PARQUET, REPLICAS_PNG, REPORT_HTML, SIZING_FILES,
                                       SIZING_PARQUET, SIZING_PNG, Confidence, SizingSpace,
                                       answers_json, evidence_frame, format_answers, size, stderr_line)
from aisim_fast.studies.sweeps import MANIFEST_FILE, POINTS_FILE, run_sweep, sla_frontier
from aisim_fast.trace.workload import TraceError, TraceWarning

PROGRESS_DELAY_S = 2.0  # a replay shorter than this shows no progress line


def run_listing(args) -> str:
    """``aisim-fast models`` / ``systems``: what the installed perf database covers."""

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


def _size_base(args) -> tuple[dict, str, tuple]:
    """The base payload of ``size`` (its --spec, --predict-config or replay flags), the
    folder its relative paths resolve against, and the backend choices."""
    backends = tuple(b.strip() for b in args.backend.split(",")) if args.backend else ()
    unknown = [b for b in backends if b not in SIMULATED_BACKENDS]
    if unknown:
        raise UsageError(f"--backend: {unknown[0]!r} is not one of {', '.join(SIMULATED_BACKENDS)}")
    if args.spec is not None or args.predict_config is not None:
        if args.spec is not None and args.predict_config is not None:
            raise UsageError("give one of --spec and --predict-config")
        flag = "--spec" if args.spec is not None else "--predict-config"
        given = [name for attr, name in SIZE_FLAG_NAMES if getattr(args, attr, None) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with {flag}; change the config file "
                             "instead")
        if args.trace is not None:
            raise UsageError(f"with {flag}, give the trace as --trace PATH")
        path = Path(args.spec if args.spec is not None else args.predict_config)
        payload = read_payload_file(path) if args.spec is not None else read_predict_config(path)
        return payload, str(path.resolve().parent), backends
    if not backends:
        raise UsageError("without --spec, --backend is required")
    flags = argparse.Namespace(**vars(args))
    flags.backend = backends[0]
    flags.workers = None if args.disaggregated else 1
    flags.prefill_workers = flags.decode_workers = 1 if args.disaggregated else None
    for attr in ("dp_size", "prefill_dp_size", "decode_dp_size", "arrival_speedup_ratio"):
        setattr(flags, attr, None)
    if args.trace is not None and args.trace_flag is not None:
        raise UsageError("give the trace either as TRACE or as --trace, not both")
    try:
        payload = payload_from_flags(flags)
        parse_payload(payload, ".", None)  # an error names the flag, before any run
    except ConfigError as exc:
        raise at_flag(exc) from None
    return payload, str(Path(".").resolve()), backends


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip()) if text else ()


# size's replay-description flags, refused with --spec / --predict-config
SIZE_FLAG_NAMES = (("engine_args", "--engine-args"), ("disaggregated", "--disaggregated"),
                   ("prefill_engine_args", "--prefill-engine-args"),
                   ("decode_engine_args", "--decode-engine-args"),
                   ("kv_transfer_bandwidth", "--kv-transfer-bandwidth"),
                   ("kv_bytes_per_token", "--kv-bytes-per-token"),
                   ("handoff_latency_ms", "--handoff-latency-ms"), ("concurrency", "--concurrency"),
                   ("trace_block_size", "--trace-block-size"), ("placement", "--placement"),
                   ("placement_seed", "--placement-seed"), ("router_json", "--router-json"),
                   ("max_sim_time_ms", "--max-sim-time-ms"))


def run_size_command(args) -> tuple[str, int]:
    """Run ``aisim-fast size``; returns the answer text and the exit code."""
    if args.goodput is not None and not 0 <= args.goodput <= 1:
        raise UsageError(f"--goodput: must be in [0, 1], got {args.goodput}")
    sla = parse_sla_text(args.sla, goodput=args.goodput)
    rates = (None,)
    if args.rates:
        try:
            rates = tuple(float(r) for r in args.rates.split(","))
        except ValueError:
            raise UsageError(f"--rates: numbers separated by commas, got {args.rates!r}") from None
        bad = [r for r in rates if not (math.isfinite(r) and r > 0)]
        if bad:
            raise UsageError(f"--rates: every rate must be a finite number > 0, got {bad[0]:g}")
    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    payload, base_dir, backends = _size_base(args)
    timing = aic_flags(args)
    tps = int_choices(timing.pop("tp", None), "--tp")
    space = SizingSpace(backend=backends if len(backends) > 1 or args.spec or args.predict_config else (),
                        tp=tps if len(tps) > 1 else (),
                        max_num_seqs=int_choices(args.max_num_seqs, "--max-num-seqs"),
                        max_num_batched_tokens=int_choices(args.max_num_batched_tokens,
                                                           "--max-num-batched-tokens"),
                        prefill_system=_names(args.prefill_system), decode_system=_names(args.decode_system),
                        speculation=_names(args.speculation_choices))
    if len(tps) == 1:
        timing["tp"] = tps[0]
    if args.out is not None:
        check_out_dir(args.out, args.overwrite, probe=True, owned=SIZING_FILES)
    trace = args.trace_flag if args.spec is not None or args.predict_config is not None else None
    say = (lambda line: None) if args.quiet else stderr_line
    options = dict(base_dir=base_dir, trace=trace, max_workers=args.max_workers, max_gpus=args.max_gpus,
                   space=space, timing=timing or None, jobs=args.jobs, quiet=args.quiet, say=say,
                   exhaustive={"auto": None, "exhaustive": True, "pruned": False}[args.search],
                   objective=args.objective, prices=args.gpu_prices,
                   confidence=(Confidence(args.confidence, args.runs, args.timing_perturbation_pct, args.seed)
                               if args.confidence is not None else None))
    if args.window_s is not None:
        return _size_over_time(args, payload, sla, rates, options)
    answers = interruptible(size, payload, sla, rates=rates, **options)
    text = format_answers(answers, sla)
    if args.out is not None:
        frame = evidence_frame(answers)
        answer = answers_json(answers, sla)
        doc = json.dumps(answer, indent=2, default=str) + "\n"
        out = write_folder(args.out, {SIZING_PARQUET: lambda path: frame.to_parquet(path, index=False),
                                      ANSWER_JSON: lambda path: path.write_text(doc, encoding="utf-8"),
                                      **_sizing_pictures(args, frame, answer, sla)},
                           args.overwrite, owned=SIZING_FILES)
        text += "\nwrote:\n" + "\n".join(f"  {out / name}" for name in
                                          (SIZING_PARQUET, ANSWER_JSON, SIZING_PNG, REPORT_HTML))
    return text, (EXIT_OK if all(a.feasible for a in answers) else EXIT_NO_ANSWER)


def _sizing_pictures(args, evidence, answer: dict, sla) -> dict:
    """The writers of sizing.png and report.html (after the files they show)."""
    name = Path(args.out).resolve().name
    return {SIZING_PNG: lambda path: plot_sizing(evidence, path, title=f"{name}: candidates", sla=sla.terms()),
            REPORT_HTML: lambda path: sizing_report(path.parent, answer, path.parent / SIZING_PNG, name)}


def _size_over_time(args, payload, sla, rates, options) -> tuple[str, int]:
    """``size --window-s``: replicas(t), its totals, and with --out its table and plot."""
    if len(rates) > 1:
        raise UsageError("--window-s: sizes one load over time; give at most one --rates value")
    result = interruptible(size_over_time, payload, sla, window_s=args.window_s, rate=rates[0], **options)
    text = format_over_time(result, sla.text())
    if args.out is not None:
        windows = result.windows
        evidence = evidence_frame([a for a in result.answers if a is not None])
        with_window = pd.concat([a.evidence.assign(window=i) for i, a in enumerate(result.answers)
                                 if a is not None], ignore_index=True)
        evidence = evidence.assign(window=with_window["window"].to_numpy())
        doc = json.dumps({"sla": sla.terms(), "over_time": result.totals(),
                          "windows": windows.to_dict("records")}, indent=2, default=str) + "\n"
        title = f"GPUs over time meeting {sla.text()}"
        answer = json.loads(doc)
        out = write_folder(args.out, {
            SIZING_PARQUET: lambda path: evidence.to_parquet(path, index=False),
            REPLICAS_PARQUET: lambda path: windows.to_parquet(path, index=False),
            REPLICAS_PNG: lambda path: plot_over_time(result, path, title),
            ANSWER_JSON: lambda path: path.write_text(doc, encoding="utf-8"),
            **_sizing_pictures(args, evidence, answer, sla)},
            args.overwrite, owned=SIZING_FILES)
        text += "\nwrote:\n" + "\n".join(f"  {out / name}" for name in
                                          (SIZING_PARQUET, REPLICAS_PARQUET, REPLICAS_PNG, ANSWER_JSON,
                                           SIZING_PNG, REPORT_HTML))
    return text, (EXIT_OK if result.feasible else EXIT_NO_ANSWER)


def run_sweep_command(args) -> tuple[str, int]:
    """Run ``aisim-fast sweep``; returns the closing summary text and the exit code
    (``EXIT_NO_ANSWER`` when no point ran)."""

    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size: must be >= 1, got {args.batch_size}")
    start_s = time.perf_counter()
    points = interruptible(run_sweep, args.sweep_spec, args.out, jobs=args.jobs, scheduler=args.scheduler,
                       batch_size=args.batch_size, resume=args.resume, overwrite=args.overwrite,
                       requests=not args.no_requests, quiet=args.quiet,
                       timing=aic_flags(args) or None, retry_failed=args.retry_failed,
                       prices=args.gpu_prices)
    counts = points["status"].value_counts().to_dict() if len(points) else {}
    by_status = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines = [f"{len(points)} points ({by_status}) in {time.perf_counter() - start_s:.1f} s",
             f"  {Path(args.out) / POINTS_FILE}"]
    failed = points[points["status"] != "ok"] if len(points) else points
    if len(failed):
        # each distinct reason once, with its count and first point: the console says why
        reasons = failed.groupby(["status", "error"], sort=False)["point"].agg(["count", "min"])
        lines.append("failed points:")
        for (status, error), row in reasons.head(5).iterrows():
            lines.append(f"  {row['count']} {status} (first: point {row['min']}): {error}")
        if len(reasons) > 5:
            lines.append(f"  ... and {len(reasons) - 5} more reasons (see the error column)")
        lines.append("  --resume --retry-failed reruns them")
    ran = int(counts.get("ok", 0))
    lines += _frontier_lines(points, Path(args.out))
    return "\n".join(lines), (EXIT_OK if ran or not len(points) else EXIT_NO_ANSWER)


def _frontier_lines(points, out: Path, limit: int = 8) -> list[str]:
    """With an SLA: up to which value of each numeric axis every point met it
    (``sweeps.sla_frontier``), per combination of the other axes."""
    columns = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))["sweep"]["columns"]
    frontier = sla_frontier(points, columns)
    if not frontier:
        return []
    lines = ["SLA met from the lowest value up to (every lower point met it too):"]
    for column, others, highest in frontier[:limit]:
        where = ", ".join(f"{c}={v}" for c, v in others.items())
        reach = "not even the lowest value" if highest is None else f"{column} = {highest}"
        lines.append(f"  {reach}" + (f"  ({where})" if where else ""))
    if len(frontier) > limit:
        lines.append(f"  ... and {len(frontier) - limit} more (points.parquet: sla_ok)")
    return lines


def run_warmup(args) -> None:
    """Compile the chosen topologies' kernels: a tiny batch with every simulated backend."""
    topologies = (("aggregated", "disaggregated", "sglang", "sglang_disaggregated") if args.topology == "all"
                  else (args.topology,))
    for topology, seconds in warm_kernels(topologies).items():
        print(f"{topology:14s} ready ({seconds:.1f} s)")


def load_setup_trace(setup: ReplaySetup, max_rows: int | None = None):
    if not setup.from_trace_file:  # inline in the payload, or a synthetic load
        return setup_workload(setup, max_rows)
    path = Path(setup.trace_path)
    if not path.exists():
        raise TraceError(str(path), None, "trace file not found")
    if path.is_dir() and setup.trace_format != "weka":  # a Weka corpus may be a folder of plays
        raise TraceError(str(path), None, "is a folder, not a trace file")
    try:
        return setup_workload(setup, max_rows, closed_loop=setup.concurrency > 0)
    except OSError as exc:
        raise TraceError(str(path), None, f"cannot read ({exc.strerror or exc})") from None


# ---------------------------------------------------------------------------------------
# running


def _warm_up(setup: ReplaySetup) -> None:
    """Run the first trace row alone so the JIT compile (or cache load) of the kernels is
    not counted in wall_time_ms, which measures simulation speed (spec replay.md 12.8)."""
    with warnings.catch_warnings():  # the full load below says it, with its counts
        warnings.simplefilter("ignore", TraceWarning)
        first_row = load_setup_trace(setup, max_rows=1)
    try:
        run_batch([simulation_from_setup(setup, first_row)], record_passes=False)
    except SimulationError:
        pass  # the real run reports it, with the real request count


def _sglang_pool_hint(setup: ReplaySetup) -> str:
    """Why an SGLang run may dead-end where a vLLM run of the same flags does not: its
    num_gpu_blocks counts pages of block_size tokens (default 1), so the default pool
    holds far fewer tokens."""
    for _, rank in setup.pools:
        if rank.backend == "sglang" and rank.block_size * rank.num_gpu_blocks < 1_000_000:
            return (f"; note: SGLang's num_gpu_blocks counts pages of block_size ({rank.block_size}) tokens, "
                    f"so this pool holds {rank.block_size * rank.num_gpu_blocks:,} tokens -- raise it, e.g. "
                    "--engine-args '{\"num_gpu_blocks\": 1000000}'")
    return ""


def run_replay(args) -> dict:
    """Resolve, simulate, and write one replay. Returns what the summary table shows."""
    # (interruptible: a first AIC run builds its timing engine while resolving)
    if args.spec is not None or args.predict_config is not None:
        setup, gpus_per_worker, source = interruptible(setup_from_spec, args)
    else:
        setup, gpus_per_worker, source = interruptible(setup_from_flags, args)
    sla = None
    if args.sla is not None:  # its per-request bounds replace the payload's spec.sla
        sla = parse_sla_text(args.sla)
        setup = dataclasses.replace(setup, sla=dict(sla.request_bounds))
    kv_events = args.kv_events or args.events or any(rank.emit_kv_events for _, rank in setup.pools)
    # refuse a bad --out before spending time on the simulation (checked again at write)
    check_out_dir(args.out, args.overwrite, probe=True)
    # (the replay's kernel set, named with its features, is announced as it compiles)
    compile_notice(["trace"])
    workload = load_setup_trace(setup)
    raise_pending_sigterm()

    compile_start_s = time.perf_counter()
    interruptible(_warm_up, setup)
    raise_pending_sigterm()
    compile_ms = (time.perf_counter() - compile_start_s) * MS_PER_S

    if args.performance_diagnostics:
        setup = dataclasses.replace(setup, capture_performance_diagnostics=True)
    # the diagnostics are summed over the pass log: kept in memory without passes.parquet
    record_passes = not args.no_passes or setup.capture_performance_diagnostics
    run_start_s = time.perf_counter()
    simulation = simulation_from_setup(setup, workload)
    progress = Progress(workload.num_requests, desc=PROG, unit="requests", quiet=args.quiet,
                        delay_s=PROGRESS_DELAY_S)

    def report(sim_ms: float, done: int, total: int) -> None:
        raise_pending_sigterm()
        rate = done / max(time.perf_counter() - run_start_s, 1e-9)
        progress.update(done, f"t={sim_ms / MS_PER_S:,.0f} s simulated, {rate:,.0f} requests/s")

    try:
        result = run_batch([simulation], record_passes=record_passes, record_events=kv_events,
                           record_outputs=args.output_events, progress=report,
                           record_pressure=args.pressure_events, spill_passes=record_passes).check()
    except SimulationError as exc:
        raise SimulationError(str(exc) + _sglang_pool_hint(setup)) from None
    finally:
        progress.close()
    # floored so the per-wall-second rates stay finite on a clock with coarse ticks
    wall_time_ms = max((time.perf_counter() - run_start_s) * MS_PER_S, 1e-6)

    requests = requests_in_uuid_order(result.requests[0], workload.session, workload.turn_index)
    # (a time cap may end a run before anything completes: it still reports)
    if not (requests["terminal_status"] == "completed").any() and setup.max_sim_time_ms is None:
        raise SimulationError(nothing_completed(setup, requests))
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
        "trace_path": str(Path(setup.trace_path).resolve()) if setup.from_trace_file else None,
    }
    if setup.placement == "kv_router":
        routing = result.routing[0]
        summary.update(routing_summary(routing))
    summary["rejected_by_cause"] = rejection_causes(setup, requests)
    summary.update(pressure_counts(setup, requests))
    summary["prediction_provenance"] = prediction_provenance(setup)
    summary["kv_eviction_policy"] = "lru"  # the reference's key: every pool here evicts LRU
    if setup.beyond_reference:
        summary["beyond_reference"] = setup.beyond_reference
    summary["kv_capacity"] = kv_capacity(setup)
    if workload.agentic is not None:  # trajectories, play outcomes, lifecycle (report.agentic)
        summary.update(agentic_report_keys(workload.agentic, requests, setup))
    passes = None
    evidence = None
    if record_passes and any(rank.aic is not None for _, rank in setup.pools):
        evidence = aic.op_latency_evidence(setup, result.started_passes[0])
        if evidence is not None:
            summary["op_latency_evidence"] = evidence
    summary.update(power_report(setup, evidence) or {})
    if setup.capture_performance_diagnostics:
        summary["performance_diagnostics"] = aic.performance_diagnostics(setup, result.started_passes[0])
    if sla is not None:
        verdict = sla.judge(summary)
        summary["sla_verdict"] = {"terms": sla.terms(), "ok": verdict.ok, "failed": list(verdict.failed),
                                  "values": verdict.values, "reason": verdict.reason}
    if not args.no_passes:
        # the pass log as it was drained, part by part (a million-request run has tens
        # of millions of passes: never one frame, never sorted in memory)
        passes = with_rank(result.pass_parts(0))
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
    raise_pending_sigterm()
    written = write_run(args.out, requests, passes, summary, resolved, overwrite=args.overwrite,
                        events=events)
    return {"setup": setup, "summary": summary, "requests": requests, "written": written,
            "compile_ms": compile_ms}
