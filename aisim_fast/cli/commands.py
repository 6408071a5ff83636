"""What each command does: replay, sweep, size, warmup, the listings."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from aisim_fast.aic import timing as aic
from aisim_fast.cli.console import MS_PER_S, nothing_completed, pressure_counts, rejection_causes, with_rank
from aisim_fast.cli.flags import setup_from_flags, setup_from_spec
from aisim_fast.cli.parser import PROG, UsageError, aic_flags, sla_flag
from aisim_fast.cli.signals import raise_pending_sigterm
from aisim_fast.config.payload import ConfigError, ReplaySetup
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import SimulationError, setup_workload, simulation_from_setup
from aisim_fast.engine.warmup import warm_kernels
from aisim_fast.io.progress import Progress
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.io.run_folder import check_out_dir, write_run
from aisim_fast.kernels.jit import compile_notice
from aisim_fast.protocol.handoff.audit import audit_handoffs, audited_runs
from aisim_fast.report.summary import (
    kv_capacity,
    power_report,
    prediction_provenance,
    routing_summary,
    summarize_replay,
)
from aisim_fast.studies.sizing import format_answers, size
from aisim_fast.studies.sweeps import POINTS_FILE, run_sweep
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


def run_size_command(args) -> str:

    sla = sla_flag(args.sla)
    rates = (None,)
    if args.rates:
        try:
            rates = tuple(float(r) for r in args.rates.split(","))
        except ValueError:
            raise UsageError(f"--rates: numbers separated by commas, got {args.rates!r}") from None
    answers = size(args.spec, sla, trace=args.trace, goodput=args.goodput,
                   max_workers=args.max_workers, rates=rates, jobs=args.jobs,
                   timing=aic_flags(args) or None)
    return format_answers(answers, sla, args.goodput)


def run_sweep_command(args) -> str:
    """Run ``aisim-fast sweep``; returns the closing summary text."""

    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size: must be >= 1, got {args.batch_size}")
    start_s = time.perf_counter()
    points = run_sweep(args.sweep_spec, args.out, jobs=args.jobs, scheduler=args.scheduler,
                       batch_size=args.batch_size, resume=args.resume, overwrite=args.overwrite,
                       requests=not args.no_requests, quiet=args.quiet,
                       timing=aic_flags(args) or None)
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


def load_setup_trace(setup: ReplaySetup, max_rows: int | None = None):
    if setup.requests is not None:  # inline in the payload
        return setup_workload(setup, max_rows)
    path = Path(setup.trace_path)
    if not path.exists():
        raise TraceError(str(path), None, "trace file not found")
    if path.is_dir():
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


def run_replay(args) -> dict:
    """Resolve, simulate, and write one replay. Returns what the summary table shows."""
    if args.spec is not None or args.predict_config is not None:
        setup, gpus_per_worker, source = setup_from_spec(args)
    else:
        setup, gpus_per_worker, source = setup_from_flags(args)
    kv_events = args.kv_events or args.events or any(rank.emit_kv_events for _, rank in setup.pools)
    # refuse a bad --out before spending time on the simulation (checked again at write)
    check_out_dir(args.out, args.overwrite, probe=True)
    # (the replay's kernel set, named with its features, is announced as it compiles)
    compile_notice(["trace"])
    workload = load_setup_trace(setup)
    raise_pending_sigterm()

    compile_start_s = time.perf_counter()
    _warm_up(setup)
    raise_pending_sigterm()
    compile_ms = (time.perf_counter() - compile_start_s) * MS_PER_S

    record_passes = not args.no_passes
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
        "trace_path": str(Path(setup.trace_path).resolve()) if setup.requests is None else None,
    }
    if setup.placement == "kv_router":
        routing = result.routing[0]
        summary.update(routing_summary(routing))
    summary["rejected_by_cause"] = rejection_causes(setup, requests)
    summary.update(pressure_counts(setup, requests))
    summary["prediction_provenance"] = prediction_provenance(setup)
    summary["kv_capacity"] = kv_capacity(setup)
    passes = None
    evidence = None
    if record_passes and any(rank.aic is not None for _, rank in setup.pools):
        evidence = aic.op_latency_evidence(setup, result.passes[0])
        if evidence is not None:
            summary["op_latency_evidence"] = evidence
    summary.update(power_report(setup, evidence) or {})
    if record_passes:
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
