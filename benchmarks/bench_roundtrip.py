"""Cost of kernel <-> driver round trips in a disaggregated replay.

    python benchmarks/bench_roundtrip.py [--spec GOLDEN.spec.json] [--trace-dir DIR] [--calls N]

aisim_fast runs the whole disaggregated event loop, handoff actions included,
inside one kernel call per simulation, and afterwards the driver's coordinator
re-checks every handoff in a few batched array calls (``handoff_audit``). This
script measures what the alternative - the driver applying each handoff action
between kernel calls - would cost, on the same run:

* the run itself (one ``run_batch``, kernels already compiled);
* the audit: the coordinator over all handoffs of the run, batched;
* one kernel round trip: a ``replay_batch`` call that finds nothing to do (the
  fixed price of entering and leaving compiled code with the batch state);
* one coordinator step for a single handoff (``apply_facts`` on one row);
* the run's handoff actions and engine passes, from its outputs.

Round trips per run x (round trip + single-handoff step) estimates the driver-side
alternative; it prints that next to the measured run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default=str(ROOT / "tests/data/golden/10k_vllm_disagg2p4d.spec.json"))
    p.add_argument("--trace-dir", default=str(ROOT / "tests/data/traces"))
    p.add_argument("--calls", type=int, default=2000, help="samples of the per-call costs")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)

    from aisim_fast.config.payload import load_spec
    from aisim_fast.engine.batch import run_batch
    from aisim_fast.engine.build import build_state
    from aisim_fast.engine.simulation import simulation_from_setup
    from aisim_fast.kernels.loop.event_loop import replay_batch
    from aisim_fast.protocol.handoff.audit import audit_handoffs, audited_runs
    from aisim_fast.protocol.handoff.actions import FactKind, HandoffOrder, OutcomeKind
    from aisim_fast.protocol.handoff.coordinator import (HandoffState, add_handoffs, apply_facts,
                                                         apply_outcomes, apply_start)
    from aisim_fast.protocol.handoff.timing import TransferTimingArrays

    spec = Path(args.spec)
    trace = json.loads(spec.read_text())["traffic"]["trace_path"]
    setup = load_spec(spec, trace_override=str(Path(args.trace_dir) / Path(trace).name))
    sim = simulation_from_setup(setup)
    run_batch([sim], record_passes=False)  # load or compile the kernels

    res = None

    def run():
        nonlocal res
        res = run_batch([sim], record_passes=True)

    run_s = best_of(run, args.repeat)
    runs = audited_runs([sim], res)
    audit_s = best_of(lambda: audit_handoffs(runs), args.repeat)
    n_handoffs = len(res.requests[0])
    n_passes = len(res.passes[0])
    # SubmitPrefill, ReserveDestination, StartTransfer, ActivateDestination, ReleaseSource
    n_actions = 5 * n_handoffs

    # a kernel call that has nothing to do: every simulation is already done
    state = build_state([sim], 0)
    cfg, pool, rq, wl, wk, st, max_lease, max_bs = state
    replay_batch(cfg, pool, rq, wl, wk, st, np.arange(1), max_lease, max_bs)  # runs it to the end
    ids = np.arange(1)

    def round_trips():
        for _ in range(args.calls):
            replay_batch(cfg, pool, rq, wl, wk, st, ids, max_lease, max_bs)

    trip_s = best_of(round_trips, args.repeat) / args.calls

    # the coordinator driven one handoff at a time, as a per-action driver would
    n_single = max(1, args.calls // 10)
    table = HandoffState(capacity=n_single)
    rows = add_handoffs(table, np.arange(n_single), HandoffOrder.SOURCE_FIRST)
    timing = TransferTimingArrays(mode=[0], full_prompt_tokens=1000, kv_bytes_per_token=163840.0,
                                  bandwidth_gb_s=25.0)

    def single_handoffs():
        for r in rows:
            one = [r]
            ids = apply_start(table, one).action_ids
            apply_outcomes(table, one, ids, OutcomeKind.SUBMITTED)
            ids = apply_facts(table, one, FactKind.SOURCE_HELD, timing=timing).action_ids
            apply_outcomes(table, one, ids, OutcomeKind.ACCEPTED)
            ids = apply_facts(table, one, FactKind.DESTINATION_RESERVED,
                              transferable_prompt_tokens=[1024]).action_ids
            apply_outcomes(table, one, ids, OutcomeKind.SCHEDULED)
            ids = apply_facts(table, one, FactKind.TRANSFER_COMPLETED).action_ids
            ids = apply_outcomes(table, one, ids, OutcomeKind.APPLIED).action_ids
            apply_outcomes(table, one, ids, OutcomeKind.APPLIED)

    step_s = best_of(single_handoffs, 1) / (9 * n_single)  # nine coordinator calls per handoff

    per_action_trip = n_actions * (trip_s + step_s)
    per_pass_trip = (n_actions + n_passes) * (trip_s + step_s)
    lines = [
        f"spec: {spec.name} ({n_handoffs} handoffs, {n_passes} passes, {n_actions} handoff actions)",
        f"run_batch, whole event loop in one kernel call: {run_s * 1e3:.1f} ms",
        f"coordinator audit of every handoff, batched ({n_handoffs} rows): {audit_s * 1e3:.1f} ms",
        f"one kernel round trip (replay_batch with nothing to do): {trip_s * 1e6:.1f} us",
        f"one coordinator call for a single handoff (1 row): {step_s * 1e6:.1f} us",
        f"driver-side actions, one round trip per action: +{per_action_trip * 1e3:.0f} ms "
        f"({per_action_trip / run_s:.1f}x the whole run)",
        f"driver-side actions and pass completions: +{per_pass_trip * 1e3:.0f} ms "
        f"({per_pass_trip / run_s:.1f}x the whole run)",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
