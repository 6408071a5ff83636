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

import os
import signal
import sys
import threading
import warnings

from aisim_fast.cli.commands import run_listing, run_replay, run_size_command, run_sweep_command, run_warmup
from aisim_fast.cli.console import fail, format_summary, show_warning
from aisim_fast.cli.parser import EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, PROG, UsageError, build_parser
from aisim_fast.cli.signals import PENDING_SIGTERM, Terminated, on_sigterm
from aisim_fast.config.payload import ConfigError
from aisim_fast.engine.simulation import SimulationError
from aisim_fast.io import run_folder
from aisim_fast.io.run_folder import OutputError
from aisim_fast.studies.plots import plot_folder, PlotError
from aisim_fast.studies.sweeps import SweepError
from aisim_fast.trace.workload import TraceError


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 ok, 2 user error, 130 Ctrl-C,
    143 SIGTERM: a run being written removes its staging folder either way)."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    if argv is None and hasattr(sys.stdout, "reconfigure"):
        # a log file or pipe gets each line as it is printed (warmup's, a sweep's), not
        # in blocks at exit
        sys.stdout.reconfigure(line_buffering=True)
    run_folder.COMMITTED[0] = None
    PENDING_SIGTERM[0] = False
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    shown = warnings.showwarning
    warnings.showwarning = show_warning
    try:
        code = _main(argv)
    finally:
        warnings.showwarning = shown
        if argv is not None or run_folder.COMMITTED[0] is None:
            signal.signal(signal.SIGTERM, previous)
        else:
            # the process's own command line wrote its run and exits now. Ignored, not
            # handled: the interpreter's shutdown resets handled signals to the default
            # action, so a SIGTERM then would kill a process whose run is written
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if argv is None and code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        # interrupted: its message is out and nothing half-written is left; leave now
        # rather than join the threads still compiling or simulating (a wait of seconds,
        # and a second Ctrl-C there prints the interpreter's threading traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return fail(str(exc))
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    try:
        if args.command == "warmup":
            run_warmup(args)
            return EXIT_OK
        if args.command == "sweep":
            text, code = run_sweep_command(args)
            print(text)
            return code
        if args.command == "size":
            text, code = run_size_command(args)
            print(text)
            return code
        if args.command in ("models", "systems"):
            print(run_listing(args))
            return EXIT_OK
        if args.command == "plot":

            for path in plot_folder(args.folder, args.color_by):
                print(f"  {path}")
            return EXIT_OK
        outcome = run_replay(args)
    except (UsageError, ConfigError, TraceError, SimulationError, OutputError, SweepError,
            PlotError) as exc:
        return fail(str(exc))
    except OSError as exc:  # e.g. the output folder's parent is not writable
        where = f" ({exc.filename})" if exc.filename else ""
        return fail(f"{exc.strerror or exc}{where}")
    except (KeyboardInterrupt, SystemError) as exc:
        if isinstance(exc, SystemError):
            # a native caller (a Numba dispatcher) that got the signal's exception from
            # a Python callback reports it as a SystemError caused by it
            if not isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
                raise
            exc = exc.__cause__ or exc.__context__
        code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
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
