"""GPU cost (report/cost.py): the price table and its file, a run's cost columns, and
the sizing objective "cost" over heterogeneous prefill / decode hardware."""

from __future__ import annotations

import json
import math

import pytest

from aisim_fast.config.payload import ConfigError, load_spec
from aisim_fast.report.cost import DEFAULT_PRICES_USD_PER_GPU_HOUR, load_prices, run_cost
from aisim_fast.studies.sweeps import run_sweep
from support.aic_cache import fresh_value_cache
from support.paths import DATA_DIR

own_value_cache = pytest.fixture(autouse=True, scope="module")(fresh_value_cache)
ONE_K = str(DATA_DIR / "traces" / "mooncake_1k.jsonl")
HETERO = DATA_DIR / "golden_aic" / "1k_vllm_disagg1p2d_aic.spec.json"


def test_a_price_file_overrides_the_defaults(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("h100_sxm: 2.25\nl40s: 0.9\n")
    prices = load_prices(path)
    assert prices["h100_sxm"] == 2.25 and prices["l40s"] == 0.9
    assert prices["h200_sxm"] == DEFAULT_PRICES_USD_PER_GPU_HOUR["h200_sxm"]
    (tmp_path / "bad.json").write_text(json.dumps({"h100_sxm": -1}))
    with pytest.raises(ConfigError, match=r"bad.json.h100_sxm: must be a price >= 0"):
        load_prices(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="price file not found"):
        load_prices(tmp_path / "none.yaml")


def test_a_runs_cost_is_its_pools_gpus_at_their_prices():
    """The spec's pools (1 prefill, 2 decode workers) at their systems' prices."""
    setup = load_spec(HETERO, trace_override=ONE_K)
    summary = {"input_throughput_tok_s": 36_000.0, "output_throughput_tok_s": 1_800.0}
    prices = load_prices({"h100_sxm": 3.0, "h200_sxm": 4.0})
    systems = (setup.prefill_rank.aic.system, setup.rank.aic.system)
    per_hour = 1 * prices[systems[0]] + 2 * prices[systems[1]]
    cost = run_cost(setup, summary, prices)
    assert cost["cost_per_hour_usd"] == per_hour
    assert cost["cost_per_million_output_tokens_usd"] == per_hour / (1_800.0 * 3600) * 1e6
    assert cost["cost_per_million_input_tokens_usd"] == per_hour / (36_000.0 * 3600) * 1e6
    # a pool not timed by AIC has no system: priced at the table's default, else unknown
    plain = load_spec(DATA_DIR / "golden" / "1k_vllm_agg2.spec.json", trace_override=ONE_K)
    assert math.isnan(run_cost(plain, summary, load_prices())["cost_per_hour_usd"])
    assert run_cost(plain, summary, load_prices({"default": 1.5}))["cost_per_hour_usd"] == 3.0


def test_sweep_rows_carry_the_cost_columns():
    points = run_sweep({"base": {"spec": str(DATA_DIR / "golden" / "1k_vllm_agg2.spec.json"),
                                 "trace": str(DATA_DIR / "traces" / "mooncake_tiny20.jsonl")},
                        "workers": [1, 3], "prices": {"default": 2.0}}, None, quiet=True)
    assert list(points["cost_per_hour_usd"]) == [2.0, 6.0]
    want = points["cost_per_hour_usd"] / (points["output_throughput_tok_s"] * 3600) * 1e6
    assert (points["cost_per_million_output_tokens_usd"] == want).all()


def test_the_cheapest_fleet_over_heterogeneous_prefill_and_decode_hardware():
    """Objective cost over H100 / H200 for each pool: the pruned search's answer is the
    exhaustive one, and it is the cheapest feasible candidate per hour."""
    from aisim_fast.studies.sizing import SizingSpace, size

    space = SizingSpace(prefill_system=("h100_sxm", "h200_sxm"), decode_system=("h100_sxm", "h200_sxm"))
    kwargs = dict(trace=ONE_K, max_workers=5, rates=(2.0,), space=space, objective="cost")
    sla = "ttft_p90_ms=1000,itl_p90_ms=40"
    [pruned] = size(HETERO, sla, exhaustive=False, **kwargs)
    [every] = size(HETERO, sla, exhaustive=True, **kwargs)
    assert pruned.feasible and (pruned.gpus, pruned.deployment) == (every.gpus, every.deployment)
    feasible = every.evidence[every.evidence["feasible"]]
    assert feasible["cost_per_hour_usd"].min() == feasible.iloc[0]["cost_per_hour_usd"]
    best = pruned.evidence[pruned.evidence["feasible"]].iloc[0]
    prices = load_prices()
    p, d = best["spec.topology.prefill.initial_workers"], best["spec.topology.decode.initial_workers"]
    assert best["cost_per_hour_usd"] == p * prices[best["shape.prefill_system"]] \
        + d * prices[best["shape.decode_system"]]
    assert len(pruned.evidence) < len(every.evidence)


def test_sizing_chooses_backend_and_tensor_parallelism():
    """Shapes are the product of the choices; a candidate's GPUs are its workers times
    its tp; the answer is the cheapest feasible candidate of them all."""
    from aisim_fast.studies.sizing import SizingSpace, size

    spec = DATA_DIR / "golden_aic" / "1k_vllm_agg2_aic.spec.json"
    space = SizingSpace(backend=("vllm", "trtllm"), tp=(1, 2))
    [answer] = size(spec, "ttft_p90_ms=2000,itl_p90_ms=60", trace=ONE_K, rates=(2.0,), max_workers=3,
                    space=space, exhaustive=True)
    e = answer.evidence
    assert len(e) == 2 * 2 * 3
    assert set(zip(e["shape.backend"], e["shape.tp"])) == {("vllm", 1), ("vllm", 2), ("trtllm", 1), ("trtllm", 2)}
    assert (e["gpus"] == e["spec.topology.workers.initial_workers"] * e["shape.tp"]).all()
    feasible = e[e["feasible"]]
    assert answer.feasible and answer.gpus == feasible["gpus"].min()
    assert answer.deployment["shape.backend"] in ("vllm", "trtllm")
