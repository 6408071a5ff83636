"""The coordinator-driven disaggregated replay (``aisim_fast.protocol.rank_replay``): the
handoff coordinator issuing every action to prefill and decode ranks through the
rank API gives the in-kernel replay's results, request by request, on the
disaggregated goldens (vLLM SourceFirst, SGLang DestinationFirst) and on every small
disaggregated reference run it can replay (tight decode pools, transfer bandwidth,
destination_missing timing, TRT-LLM tails, SGLang reservations and activations, the
differential cases), and stops where the in-kernel replay stops (dead ends)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from aisim_fast.config.payload import ConfigError, load_spec, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import SimulationError, setup_workload, simulation_from_setup
from aisim_fast.protocol.rank_replay import replay_through_ranks
from aisim_fast.trace.workload import TraceError
from support.goldens import MINI_CASES, MINI_GOLDEN, case_trace, simulation
from support.paths import DATA_DIR

# the disaggregated goldens and mini goldens
CASES = (["1k_vllm_disagg1p2d", "1k_vllm_disagg1p2d_bw"]
         + list(MINI_CASES)
         + [pytest.param(c, marks=pytest.mark.slow) for c in ("10k_vllm_disagg2p4d", "1k_sglang_disagg1p2d")])

DATA = DATA_DIR


def _disaggregated(case: Path) -> bool:
    """A valid disaggregated payload of a trace the coordinator replays (its rows,
    sessions included; not an agentic graph, which only the kernels release)."""
    payload = json.loads((case / "spec.json").read_text())
    if payload["spec"]["topology"].get("kind") != "disaggregated":
        return False
    try:
        setup = parse_payload(payload, case, trace_override=str(case_trace(case, payload)))
        return setup_workload(setup).agentic is None
    except (ConfigError, TraceError):  # refused before running (as the reference refuses it)
        return False


# the small disaggregated reference runs (test_reference_runs.py)
REFERENCE_RUNS = [c for c in sorted([*DATA.glob("differential/seed*"), *DATA.glob("disagg_corners/*/"),
                                     *DATA.glob("golden_sglang/sx-*/")]) if _disaggregated(c)]


def _assert_same_requests(kernel, ranks):
    """Every column of ``ranks`` equals ``kernel``'s: floats bit for bit (NaN where
    NaN), the rest value for value with missing values in the same rows."""
    assert len(kernel) == len(ranks)
    for col in ranks.columns:
        a, b = kernel[col], ranks[col]
        missing_a, missing_b = a.isna().to_numpy(), b.isna().to_numpy()
        if a.dtype.kind == "f":
            differ = ~((a.to_numpy() == b.to_numpy()) | (missing_a & missing_b))
        else:
            shown_a = np.array(["" if m else str(v) for v, m in zip(a.tolist(), missing_a)], dtype=object)
            shown_b = np.array(["" if m else str(v) for v, m in zip(b.tolist(), missing_b)], dtype=object)
            differ = (missing_a != missing_b) | (shown_a != shown_b)
        if differ.any():
            i = int(np.flatnonzero(differ)[0])
            raise AssertionError(f"{col}: {int(differ.sum())} requests differ, e.g. "
                                 f"{kernel['request_id'].iloc[i]}: in-kernel {a.iloc[i]!r}, through ranks "
                                 f"{b.iloc[i]!r}")


@pytest.mark.parametrize("case", CASES)
def test_the_coordinator_driving_ranks_equals_the_in_kernel_replay(case):
    """Every column the rank protocol exposes, exactly (times bit for bit): arrival,
    admissions on both sides, every token time, the handoff timeline (held, reserved,
    transfer done, activated, released), reuse on both sides, preemptions, status."""
    sim = simulation(case)
    kernel = run_batch([sim]).requests[0]
    ranks = replay_through_ranks(sim)
    assert len(ranks.columns) >= 30
    _assert_same_requests(kernel, ranks)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in REFERENCE_RUNS])
def test_the_coordinator_driving_ranks_equals_the_in_kernel_replay_on_small_reference_runs(case):
    payload = json.loads((case / "spec.json").read_text())
    setup = parse_payload(payload, case, trace_override=str(case_trace(case, payload)))
    sim = simulation_from_setup(setup)
    res = run_batch([sim])
    if res.status[0] == "dead_end":
        stop_ms = float(re.search(r"dead end at t=([0-9.]+) ms", res.error[0]).group(1))
        with pytest.raises(SimulationError, match="dead end") as stop:
            replay_through_ranks(sim)
        assert float(re.search(r"dead end at ([0-9.]+) ms", str(stop.value)).group(1)) == pytest.approx(stop_ms)
        return
    assert res.status[0] == "ok", res.error[0]
    _assert_same_requests(res.requests[0], replay_through_ranks(sim))


def test_small_reference_runs_cover_every_backend_and_a_dead_end():
    backends = {json.loads((c / "spec.json").read_text())["spec"]["engine"]["decode"]["rank"].get("backend", "vllm")
                for c in REFERENCE_RUNS}
    assert backends == {"vllm", "trtllm", "sglang"}
    assert len(REFERENCE_RUNS) >= 40


def test_a_dead_end_is_a_dead_end_through_ranks_too():
    """With 24 decode blocks (the reference aborts; dead25, one block more, finishes)
    both replays stop with the same requests in flight."""
    sim = simulation_from_setup(load_spec(MINI_GOLDEN / "dead24.spec.json"))
    res = run_batch([sim])
    assert res.status[0] == "dead_end"
    in_flight = int(re.search(r"with (\d+) in-flight", res.error[0]).group(1))
    with pytest.raises(SimulationError, match=rf"dead end at .*: {in_flight} requests in flight"):
        replay_through_ranks(sim)


def test_an_aggregated_simulation_is_refused():
    with pytest.raises(ConfigError, match="topology.kind"):
        replay_through_ranks(simulation("1k_vllm_agg2"))
