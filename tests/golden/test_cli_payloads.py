"""Payloads as the reference's own CLI writes them (tests/data/golden_cli), against
reference runs of the same payloads.

``aisimulate predict --stack engine`` lowers a YAML config to an execution payload whose
op-level timing config carries the CLI's canonical keys (``worker_type``,
``estimation_mode``, ``database_mode``, ``estimator_config``, ...), a CUDA-graph reserve,
``num_gpu_blocks_is_explicit: false`` beside the blocks it sized, and ``trace_paths``.
The payloads are the captured ones (``../shared/reference/cli-payloads/timing``) kept as
the CLI wrote them, and two made from them on the 1k trace where the KV capacity binds:
``cg60_1k`` (a 60 GB CUDA-graph reserve: 327 blocks) and ``written_blocks_ignored_1k``
(40 blocks written beside ``num_gpu_blocks_is_explicit: false``, which the reference sizes
again). Each request's timeline must be bit-exact and the report keys the reference adds
(``prediction_provenance``, ``power_w``, ``power_coverage``, ``power_diagnostics``) equal.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest

from aisim_fast.aic import timing as aic
from aisim_fast.config.payload import ConfigError, ConfigWarning, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.report.summary import power_report, prediction_provenance
from support import goldens
from support.aic_cache import fresh_value_cache
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_cli"
TRACES = DATA_DIR / "traces"
CASES = sorted(p.name[:-len(".payload.json")] for p in GOLDEN.glob("*.payload.json"))
# the KV blocks per worker the reference's core sizes (the CLI writes the same number
# beside num_gpu_blocks_is_explicit: false; cg60_1k's 327 is confirmed by a reference run
# of the same payload with 327 explicit blocks, equal request for request)
SIZED_BLOCKS = {"mem_default": 3904, "mem_frac": 294, "mem_frac09_cg4g": 3665, "cg60_1k": 327,
                "written_blocks_ignored_1k": 294}


# the AIC value cache in a folder of this module's own, as on a fresh machine
_own_value_cache = pytest.fixture(autouse=True, scope="module")(fresh_value_cache)


def payload_of(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.payload.json").read_text())


def setup_of(payload: dict):
    """The payload as run from the folder it was written in: its relative trace path
    names a trace of tests/data/traces."""
    trace = TRACES / Path(payload["traffic"]["trace_paths"][0]).name
    return parse_payload(payload, GOLDEN, trace_override=str(trace))


_RUNS: dict = {}


def run(case: str):
    if case not in _RUNS:
        setup = setup_of(payload_of(case))
        result = run_batch([simulation_from_setup(setup)]).check()
        # the passes that started by a time cap: a pass in flight at the cap was timed
        _RUNS[case] = (setup, result.requests[0], result.started_passes[0])
    return _RUNS[case]


def reference_rows(case: str) -> dict:
    return goldens.read_golden(case, GOLDEN)


def reference_report(case: str) -> dict:
    return json.loads((GOLDEN / f"{case}.report.json").read_text())


def test_cases_present():
    assert len(CASES) >= 12 and {"hetero_disagg", "tp2", "cg60_1k", "poly_memfrac"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_requests_match_the_reference(case):
    gold = reference_rows(case)
    setup, requests = run(case)[:2]
    cand = goldens.index_frame(goldens.with_scheduler_numbers(requests, setup.dp_size, setup.prefill_dp_size))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    diffs = timeline_differences(gold, cand)
    assert not diffs, f"{case}: {len(diffs)} cells differ, first {diffs[:3]}"
    assert len(cand) == len(gold)


TOKENIZED = sorted(p.name[:-len(".tokenized.csv")] for p in GOLDEN.glob("*.tokenized.csv"))


@pytest.mark.parametrize("case", TOKENIZED)
def test_tokenized_ms_match_the_reference(case):
    """A tokenization pool ahead of each worker (the payload's ``tokenization``): when
    each prompt reached its scheduler, as the reference records it (its raw per-request
    ``tokenized_ms``; the requests unfinished at a cap have no record)."""
    import pandas as pd
    gold = pd.read_csv(GOLDEN / f"{case}.tokenized.csv")
    ours = run(case)[1].set_index(["request_id", "turn_index"])["tokenized_ms"]
    want = gold.set_index(["request_id", "turn_index"])["tokenized_ms"]
    assert len(want) >= 20
    assert (ours.loc[want.index] - want).abs().max() <= 1e-9


def test_tokenization_cases_present():
    assert {"tokenization", "tok_1k_pools", "tok_sessions_closed"} <= set(TOKENIZED)
    assert {"sg_aic", "sg_aic_pd"} <= set(CASES)  # SGLang with op-level timing, both topologies
    assert payload_of("tok_1k_pools")["tokenization"]["workers"] == 2


@pytest.mark.parametrize("case", sorted(SIZED_BLOCKS))
def test_kv_blocks_sized_as_the_reference(case):
    setup = run(case)[0]
    assert setup.rank.num_gpu_blocks == SIZED_BLOCKS[case]
    assert setup.rank.num_gpu_blocks_estimated


def _without_latencies(node):
    """A report tree with its latency values left out (compared apart, within 1e-9)."""
    if isinstance(node, dict):
        return {k: _without_latencies(v) for k, v in node.items() if k != "latency_ms"}
    if isinstance(node, list):
        return [_without_latencies(v) for v in node]
    return node


def _latencies(node, out=None):
    out = [] if out is None else out
    if isinstance(node, dict):
        if "latency_ms" in node:
            out.append(node["latency_ms"])
        for v in node.values():
            _latencies(v, out)
    elif isinstance(node, list):
        for v in node:
            _latencies(v, out)
    return out


@pytest.mark.parametrize("case", CASES)
def test_report_keys_match_the_reference(case):
    setup, _, passes = run(case)
    want = reference_report(case)
    assert prediction_provenance(setup) == want["prediction_provenance"]
    evidence = aic.op_latency_evidence(setup, passes) if setup.rank.aic is not None else None
    got = power_report(setup, evidence)
    assert got["power_w"] == want["power_w"] and got["power_coverage"] == want["power_coverage"]
    assert _without_latencies(got["power_diagnostics"]) == _without_latencies(want["power_diagnostics"])
    assert _latencies(got["power_diagnostics"]) == pytest.approx(_latencies(want["power_diagnostics"]),
                                                                 rel=1e-9, abs=1e-9)


DIAGNOSED = sorted(p.name[:-len(".perfdiag.json")] for p in GOLDEN.glob("*.perfdiag.json"))


def test_diagnosed_cases_present():
    assert set(DIAGNOSED) == set(CASES)


@pytest.mark.parametrize("case", DIAGNOSED)
def test_performance_diagnostics_match_the_reference(case):
    """``capture_performance_diagnostics: true``: every op's latency and speed of light
    (roofline, math and memory parts) summed over the run's passes, per phase, equal to
    the last bit (NAME.perfdiag.json: the reference's report key for the payload with
    the capture on); polynomial and fixed pools report their phases unobserved."""
    setup, _, passes = run(case)
    want = json.loads((GOLDEN / f"{case}.perfdiag.json").read_text())
    assert aic.performance_diagnostics(setup, passes) == want


def test_cli_keys_are_carried_as_provenance():
    setup = run("hetero_disagg")[0]
    prefill, decode = setup.prefill_rank.to_json()["aic"], setup.rank.to_json()["aic"]
    assert prefill["cli_fields"]["worker_type"] == "prefill"
    assert decode["cli_fields"]["worker_type"] == "decode"
    assert decode["cli_fields"]["estimation_mode"] == "op_level"
    assert prefill["system"] == "h100_sxm" and decode["system"] == "h200_sxm"
    # provenance names the run, it does not time it: one engine per timing config
    plain = dict(setup.rank.aic.values_json())
    assert "cli_fields" not in plain and "cuda_graph_reserved_bytes" not in plain


def test_a_cli_config_reparses_to_itself():
    """``RankConfig.payload()`` (what check_rank validates) keeps every CLI key."""
    rank = run("mem_frac09_cg4g")[0].rank
    config = rank.payload()["timing_model"]["config"]
    assert config["cuda_graph_reserved_bytes"] == 4_000_000_000
    assert config["database_mode"] == "SILICON"


# key, value the CLI writes for a feature not simulated, words the error must hold
REFUSED = [
    ("estimation_mode", "fpm_interpolation", "only op-level estimation"),
    ("database_mode", "hybrid", "SILICON"),
    ("fpm_profile", {"path": "p.parquet"}, "FPM"),
    ("speculation", {"kind": "eagle3", "params": {"num_speculative_tokens": 3}}, "draft op tables"),
    # MTP priced by the timing model is simulated, with the rank's matching aic_nextn
    ("speculation", {"kind": "mtp", "params": {"depth": 2}}, "does not match engine aic_nextn=None"),
    ("dcp", 2, "decode context parallelism"),
    ("decoder_replay", True, "decoder replay"),
    ("fallback_policy", "allow", "deny"),
    ("attention_backend", "flashinfer", "attention kernel backend"),
    ("enable_eplb", True, "load balancing"),
    ("worker_type", "mixed", "aggregated, prefill or decode"),
    ("transfer_policy", ["xop"], "default policy"),
    ("estimator_config", {"op_level": {"scale": 2.0}}, "op-level estimator options"),
    ("estimator_config", {"learned": {}}, "unknown block"),
    ("systems_paths", ["/a", "/b"], "one systems folder"),
    ("cuda_graph_reserved_bytes", -1, "integer in [0, 2**53]"),
    ("cuda_graph_reserved_bytes", True, "integer in [0, 2**53]"),
]


@pytest.mark.parametrize("key,value,words", REFUSED, ids=[f"{k}={v!r}"[:40] for k, v, _ in REFUSED])
def test_features_not_simulated_are_refused_by_name(key, value, words):
    payload = payload_of("oplevel_min")
    payload["spec"]["engine"]["rank"]["timing_model"]["config"][key] = value
    with pytest.raises(ConfigError) as err:
        setup_of(payload)
    message = str(err.value)
    assert message.startswith(f"spec.engine.rank.timing_model.config.{key}"), message
    assert words in message


def test_database_mode_is_read_in_any_case():
    payload = payload_of("oplevel_min")
    payload["spec"]["engine"]["rank"]["timing_model"]["config"]["database_mode"] = "silicon"
    assert setup_of(payload).rank.aic.cli_fields  # accepted, as the reference upper-cases it


def test_traffic_time_cap_does_not_stop_a_trace_replay():
    """The reference stops a trace replay at spec.max_sim_time_ms only (its run of
    poly_memfrac with traffic.max_sim_time_ms 1000 completes all 20 requests, as the
    golden); a differing traffic cap warns once, naming the field."""
    payload = payload_of("poly_memfrac")
    payload["traffic"]["max_sim_time_ms"] = 1000.0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        setup = setup_of(payload)
    assert [str(w.message).split(":")[0] for w in seen if w.category is ConfigWarning] == \
        ["traffic.max_sim_time_ms"]
    assert setup.max_sim_time_ms is None
    requests = run_batch([simulation_from_setup(setup)]).check().requests[0]
    gold = reference_rows("poly_memfrac")
    assert not timeline_differences(gold, goldens.index_frame(requests))


def test_trace_paths_win_over_trace_path(tmp_path):
    """The reference replays ``trace_paths`` when both are given; several files are
    refused by name."""
    payload = payload_of("poly_memfrac")
    payload["traffic"]["trace_path"] = "traces/not_this_one.jsonl"
    payload["traffic"]["trace_paths"] = [str(TRACES / "mooncake_tiny20.jsonl")]
    setup = parse_payload(copy.deepcopy(payload), tmp_path)
    assert Path(setup.trace_path).name == "mooncake_tiny20.jsonl"
    payload["traffic"]["trace_paths"] = ["a.jsonl", "b.jsonl"]
    with pytest.raises(ConfigError,
                       match=r"^traffic\.trace_paths: trace format 'mooncake' takes one file, got 2 \(several: dynamo\)"):
        parse_payload(payload, tmp_path)


def test_an_encoder_pool_is_refused_by_name():
    payload = payload_of("oplevel_min")
    payload["spec"]["encoder"] = {"workers": 1}
    with pytest.raises(ConfigError, match=r"^spec\.encoder: encoder pools"):
        setup_of(payload)


def test_no_kv_budget_stops_with_the_references_words():
    """The reference's run of this payload (the differential's seed 7, case 0) stops with
    "no KV budget: non-KV memory (90757384192 bytes) meets/exceeds the KV-cache memory
    limit (capacity=85899345920 bytes)": H100 prefill workers at fraction 0.761 with
    20 GB of CUDA graphs."""
    payload = payload_of("hetero_disagg")
    prefill = payload["spec"]["engine"]["prefill"]
    prefill["num_gpu_blocks_is_explicit"] = False
    prefill["rank"]["timing_model"]["config"].update(gpu_memory_utilization=0.761,
                                                     cuda_graph_reserved_bytes=20_000_000_000)
    with pytest.raises(ConfigError) as err:
        setup_of(payload)
    assert "no KV budget: non-KV memory (90757384192 bytes) meets/exceeds the KV-cache memory " \
           "limit (capacity=85899345920 bytes)" in str(err.value)


def test_the_prefill_pool_is_sized_first():
    """Neither pool has a KV budget: the reference names the prefill pool's (its run of
    this payload, the differential's seed 8, case 5: H100 capacity 85899345920 bytes)."""
    payload = payload_of("hetero_disagg")
    for role, fraction, reserve in (("prefill", 0.745, 10 ** 9), ("decode", 0.632, 5 * 10 ** 10)):
        payload["spec"]["engine"][role]["num_gpu_blocks_is_explicit"] = False
        payload["spec"]["engine"][role]["rank"]["timing_model"]["config"].update(
            gpu_memory_utilization=fraction, cuda_graph_reserved_bytes=reserve)
    with pytest.raises(ConfigError) as err:
        setup_of(payload)
    assert str(err.value).startswith("spec.engine.prefill.rank.timing_model.config")
    assert "no KV budget: non-KV memory (71757384192 bytes) meets/exceeds the KV-cache memory " \
           "limit (capacity=85899345920 bytes)" in str(err.value)


def test_an_sglang_pool_sized_from_memory_is_refused():
    """SGLang ranks run op-level timing (``sg_aic``, ``sg_aic_pd``) with a pool given;
    one the reference sizes from memory is refused with the reason."""
    payload = copy.deepcopy(payload_of("sg_aic"))
    payload["spec"]["engine"]["num_gpu_blocks_is_explicit"] = False
    with pytest.raises(ConfigError, match=r"spec\.engine\.rank\.num_gpu_blocks: an SGLang pool sized "
                                          r"from GPU memory is not reproduced"):
        setup_of(payload)
