"""The coordinator-driven disaggregated replay (``aisim_fast.rank_replay``): the
handoff coordinator issuing every action to prefill and decode ranks through the
rank API gives the in-kernel replay's results, request by request, on the vLLM
disaggregated goldens and the small reference runs of the disaggregated corners
(tight decode pools, transfer bandwidth, destination_missing timing, TRT-LLM tails,
a dead end)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from aisim_fast.config import ConfigError, load_spec
from aisim_fast.rank_replay import replay_through_ranks
from aisim_fast.replay import SimulationError, run_batch, simulation_from_setup
from test_parity import MINI_CASES, MINI_GOLDEN, simulation

# every vLLM / TRT-LLM disaggregated reference run without sessions or a concurrency cap
CASES = (["1k_vllm_disagg1p2d", "1k_vllm_disagg1p2d_bw"]
         + [c for c in MINI_CASES if c not in ("disagg_conc8", "disagg_sess")]
         + [pytest.param("10k_vllm_disagg2p4d", marks=pytest.mark.slow)])


def _assert_same_requests(kernel, ranks):
    assert len(kernel) == len(ranks)
    for col in ranks.columns:
        a, b = kernel[col], ranks[col]
        if a.dtype.kind == "f":
            same = np.array_equal(a.to_numpy(float), b.to_numpy(float), equal_nan=True)
        else:
            same = (a.astype(str).to_numpy() == b.astype(str).to_numpy()).all()
        if not same:
            bad = np.flatnonzero(a.astype(str).to_numpy() != b.astype(str).to_numpy())
            i = int(bad[0])
            raise AssertionError(f"{col}: {len(bad)} requests differ, e.g. {kernel['request_id'].iloc[i]}: "
                                 f"in-kernel {a.iloc[i]!r}, through ranks {b.iloc[i]!r}")


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


def test_a_dead_end_is_a_dead_end_through_ranks_too():
    """With 24 decode blocks (the reference aborts; dead25, one block more, finishes)
    both replays stop with the same requests in flight."""
    sim = simulation_from_setup(load_spec(MINI_GOLDEN / "dead24.spec.json"))
    res = run_batch([sim])
    assert res.status[0] == "dead_end"
    in_flight = int(re.search(r"with (\d+) in-flight", res.error[0]).group(1))
    with pytest.raises(SimulationError, match=rf"dead end at .*: {in_flight} requests in flight"):
        replay_through_ranks(sim)


@pytest.mark.parametrize("case,field", [("disagg_sess", "without sessions"), ("disagg_conc8", "concurrency")])
def test_what_the_rank_driven_replay_does_not_run_is_refused_by_name(case, field):
    with pytest.raises(ConfigError, match=field):
        replay_through_ranks(simulation(case))


def test_an_aggregated_simulation_is_refused():
    with pytest.raises(ConfigError, match="topology.kind"):
        replay_through_ranks(simulation("1k_vllm_agg2"))
