"""Synthetic traffic (``traffic.source_type: synthetic``, ``trace.synthetic``) against
reference runs (tests/data/golden_synthetic): the five loads its CLI wrote
(concurrency, concurrency stopped per load unit, constant rate, constant rate with a
cached prefix, poisson) and two made from them (poisson with seed 7 at 40 requests/s
with a 300-token shared prefix on two workers; 64 in flight over 600 KV blocks, where
the pool binds); and four ``kv_capacity_fraction`` loads (a fraction of the requests
the generating pool's KV holds: one worker, two with a per-load-unit count, attention
DP, disaggregated); the CLI's default traffic (a config without ``traffic``); and
synthetic sessions (``synthetic-session``: the CLI's poisson payload, closed loops of 2
and of 16 sessions over a tight pool, a cached prefix, max_model_len cutting turns, a
constant rate stopped per load unit, SGLang, TRT-LLM and disaggregated with the prefill
rank's blocks). Every request's timeline must be bit-exact; the predict configs the
payloads came from lower to the same payloads; the reference's seeded generator is
checked draw for draw."""

from __future__ import annotations

import json
import math
import sys

import pytest

from aisim_fast.cli import app as cli
from aisim_fast.config.payload import ConfigError, kv_fraction_concurrency, parse_payload
from aisim_fast.config.predict_config import read_predict_config
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.trace.seeded_rng import StdRng
from aisim_fast.trace.synthetic import SyntheticLoad, synthetic_workload
from aisim_fast.trace.workload import prompt_tokens
from support import goldens
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_synthetic"
CASES = sorted(p.name[:-len(".payload.json")] for p in GOLDEN.glob("*.payload.json"))
CONFIGS = sorted(p.name[:-len(".predict.yaml")] for p in GOLDEN.glob("*.predict.yaml"))


def reference_rows(case: str) -> dict:
    return goldens.read_golden(case, GOLDEN)


def test_cases_present():
    assert len(CASES) == 22 and len(CONFIGS) == 7


@pytest.mark.parametrize("case", CASES)
def test_requests_match_the_reference(case):
    payload = json.loads((GOLDEN / f"{case}.payload.json").read_text())
    setup = parse_payload(payload, GOLDEN)
    assert setup.synthetic is not None and not setup.from_trace_file
    requests = run_batch([simulation_from_setup(setup)]).check().requests[0]
    gold = reference_rows(case)
    # the reference names attention-DP ranks by scheduler number (worker x dp_size + rank)
    cand = goldens.index_frame(goldens.with_scheduler_numbers(requests, setup.dp_size, setup.prefill_dp_size))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    assert not timeline_differences(gold, cand)
    assert len(cand) == len(gold) == json.loads((GOLDEN / f"{case}.report.json").read_text())["num_requests"]


@pytest.mark.parametrize("case", CONFIGS)
def test_predict_config_lowers_to_the_captured_payload(case):
    """The CLI's lowering of the config: the traffic the reference sent."""
    mine = read_predict_config(GOLDEN / f"{case}.predict.yaml")
    captured = json.loads((GOLDEN / f"{case}.payload.json").read_text())
    assert mine["traffic"] == captured["traffic"]
    assert mine["spec"]["max_in_flight"] == captured["spec"]["max_in_flight"]


@pytest.mark.parametrize("ratio,isl,osl,tokens,want", [
    (0.5, 512, 32, 200 * 64, 12), (0.37, 700, 33, 333 * 64 * 2, 21), (0.8, 512, 32, 150 * 64 * 2, 28),
    (0.6, 900, 101, 120 * 64 * 2, 9), (1e-9, 512, 32, 64, 1)])
def test_kv_fraction_concurrency(ratio, isl, osl, tokens, want):
    """floor(ratio x (pool tokens // (isl + osl // 2))), at least 1: the reference's
    concurrency in the four kv_capacity_fraction goldens (their most requests in flight)."""
    assert kv_fraction_concurrency(ratio, isl, osl, tokens) == want


def test_kv_fraction_refuses_a_zero_ratio():
    payload = json.loads((GOLDEN / "syn_kvfrac.payload.json").read_text())
    payload["traffic"]["kv_load_ratio"] = 0
    with pytest.raises(ConfigError, match="traffic.kv_load_ratio: must be a finite number > 0"):
        parse_payload(payload, GOLDEN)


def test_prefix_groups_are_drawn_as_the_reference_draws_them():
    """rand 0.9's random_range(0..G) over StdRng::seed_from_u64(0), one draw a session:
    the groups the reference's generator gives its first 16 sessions."""
    want = {2: [1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1],
            3: [2, 2, 1, 2, 2, 0, 2, 1, 2, 0, 0, 2, 0, 0, 2, 2],
            8: [6, 5, 4, 6, 6, 0, 5, 4, 6, 2, 0, 6, 0, 1, 6, 6],
            16: [12, 11, 8, 12, 12, 0, 10, 9, 13, 4, 1, 12, 1, 3, 12, 12]}
    for groups, draws in want.items():
        rng = StdRng(0)
        assert [rng.random_range(groups) for _ in range(16)] == draws


def test_session_block_ids_are_the_references():
    """isl 8 in blocks of 2, half of them shared, three groups: the ids the reference's
    generator gives (groups 2, 2, 1, 2 for the first sessions): a session's turns repeat
    its group's blocks at the start of their new tokens, sessions of a group share
    them, every other block is fresh, in first-use order."""
    load = SyntheticLoad("concurrency", 4, isl=8, osl=2, concurrency=1, source_type="synthetic-session",
                         turns_per_session=3, shared_prefix_ratio=0.5, num_prefix_groups=3)
    ids = load.turn_block_ids(2)
    assert ids[0, 0].tolist() == [0, 1, 2, 3]
    assert ids[0, 1].tolist() == [0, 1, 4, 5]
    assert ids[1, 0].tolist() == [0, 1, 8, 9]
    assert ids[2, 0].tolist() == [14, 15, 16, 17]
    wl = synthetic_workload(load, 2)
    # a turn's prompt: its session's history, then its own new tokens
    assert wl.input_len[:3].tolist() == [8, 18, 28]
    assert prompt_tokens(wl, 1)[:8].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert prompt_tokens(wl, 1)[10:].tolist() == [0, 0, 1, 1, 4, 4, 5, 5]


def test_predict_config_runs_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["replay", "--predict-config", str(GOLDEN / "syn_poisson.predict.yaml"),
                     "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == summary["completed_requests"] == 100


def test_seeded_generator_draws_the_reference_arrivals():
    """StdRng::seed_from_u64(1): the first gaps of the syn_poisson golden (20/s)."""
    rows = reference_rows("syn_poisson")
    want = sorted(float(r["arrival_ms"]) for r in rows.values())
    rng, t, got = StdRng(1), 0.0, [0.0]
    for _ in range(99):  # more than one 64-word buffer: the refill and the straddling read
        t += -50.0 * math.log(min(max(1.0 - rng.random_f64(), sys.float_info.min), 1.0))
        got.append(t)
    assert got == want


def test_generator_properties():
    a, b = StdRng(7), StdRng(7)
    draws = [a.random_f64() for _ in range(1000)]
    assert draws == [b.random_f64() for _ in range(1000)]  # seeded
    assert all(0.0 <= x < 1.0 for x in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05
    assert StdRng(8).random_f64() != draws[0]


def test_loads_arrive_and_share_as_asked():
    const = SyntheticLoad("constant_rate", 5, isl=100, osl=4, arrival_interval_ms=30.1)
    assert list(const.arrivals_ms()) == [0.0, 30.1, 60.2, 90.30000000000001, 120.4]
    assert not SyntheticLoad("concurrency", 4, isl=8, osl=1, concurrency=2).arrivals_ms().any()
    wl = synthetic_workload(SyntheticLoad("poisson", 3, isl=10, osl=2, cached_prefix_tokens=4,
                                          request_rate=5.0, arrival_seed=3), 64)
    assert wl.trace_block_size == 1  # a cached prefix: one-token blocks
    prompts = wl.hash_ids.reshape(3, 10)
    assert prompts[0].tolist() == list(range(10))                   # ids in first-use order
    assert (prompts[:, :4] == prompts[0, :4]).all()                # the shared prefix
    assert len({tuple(p[4:]) for p in prompts}) == 3               # the rest their own
    assert not set(prompts[0, 4:]) & set(prompts[1, 4:])
    # no cached prefix: one id per engine block, none shared
    wl = synthetic_workload(SyntheticLoad("concurrency", 3, isl=100, osl=2, concurrency=1), 64)
    assert wl.trace_block_size == 64 and wl.hash_ids.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("edit,words", [
    ({"load_type": "kv_capacity_fraction"}, "traffic.kv_load_ratio: must be a finite number > 0"),
    ({"load_type": "burst"}, "traffic.load_type"),
    ({"source_type": "synthetic-session", "shared_prefix_ratio": 1.5}, "traffic.shared_prefix_ratio: must be within"),
    ({"source_type": "synthetic-session", "turns_per_session": 0}, "traffic.turns_per_session: must be an integer >= 1"),
    ({"inter_turn_delay_ms": -1}, "traffic.inter_turn_delay_ms: must be a finite number >= 0"),
    ({"cached_prefix_tokens": 600}, "traffic.cached_prefix_tokens: must be <= isl"),
    ({"isl": 0}, "traffic.isl"),
    ({"request_count": None}, "traffic.request_count: required"),
    ({"trace_path": "x.jsonl"}, "traffic.trace_path: unknown or unsupported field of a synthetic load"),
    ({"max_sim_time_ms": 5.0}, "traffic.max_sim_time_ms: a cap on a synthetic load's generation"),
])
def test_bad_synthetic_traffic_is_refused_by_field(edit, words):
    payload = json.loads((GOLDEN / "syn_conc.payload.json").read_text())
    payload["traffic"].update(edit)
    payload["traffic"] = {k: v for k, v in payload["traffic"].items() if v is not None}
    with pytest.raises(ConfigError, match="^" + words.replace("(", r"\(").replace(")", r"\)")):
        parse_payload(payload, GOLDEN)


def test_predict_config_time_cap_is_trace_only(tmp_path):
    """As the reference's config model: a synthetic source takes no virtual-time cap."""
    text = (GOLDEN / "syn_conc.predict.yaml").read_text().replace(
        "stop: {requests: 100}", "stop: {requests: 100, max_virtual_time_seconds: 2}")
    (tmp_path / "c.predict.yaml").write_text(text)
    with pytest.raises(ConfigError, match="max_virtual_time_seconds is trace-only"):
        read_predict_config(tmp_path / "c.predict.yaml")
