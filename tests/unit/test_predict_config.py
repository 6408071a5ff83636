"""``config.predict_config``: a reference predict config lowered to its payload, and every
key aisim_fast does not simulate (or the reference refuses) stopped with its path in the
config. The lowering of whole configs against the reference's CLI is
``tests/golden/test_predict_configs.py``."""

from __future__ import annotations

import copy

import pytest

from aisim_fast.config.payload import ConfigError, parse_payload
from aisim_fast.config.predict_config import lower_predict_config, read_predict_config

BASE = {
    "traffic": {"source": {"type": "trace", "paths": ["t.jsonl"]}, "load": {"type": "trace_timestamps"}},
    "engine": {"model": "Qwen/Qwen3-32B", "hardware": "h200_sxm",
               "workers": {"aggregated": {"kv_cache": {"capacity": {"type": "fixed", "blocks": 500}},
                                          "timing": {"type": "polynomial"}}}},
}


def edited(*edits) -> dict:
    doc = copy.deepcopy(BASE)
    for path, value in edits:
        node = doc
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is KeyError:
            node.pop(leaf)
        else:
            node[leaf] = value
    return doc


AGG = "engine.workers.aggregated"
BASE_TRAFFIC_PAYLOAD = {"source_type": "trace", "load_type": "trace_timestamps", "trace_path": "t.jsonl"}


def test_the_defaults_the_reference_fills_in():
    payload = lower_predict_config(BASE)
    rank = payload["spec"]["engine"]["rank"]
    assert rank == {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "prefill_schedule_interval": 1,
                    "prefill_decode_interval": 0, "block_size": 64, "enable_prefix_caching": True,
                    "max_model_len": 40960, "num_gpu_blocks": 500, "timing_model": {"type": "polynomial"},
                    "backend": "vllm"}
    assert payload["spec"]["engine"]["num_gpu_blocks_is_explicit"] is True
    assert payload["traffic"] == {"source_type": "trace", "load_type": "trace_timestamps",
                                  "trace_paths": ["t.jsonl"], "trace_path": "t.jsonl",
                                  "trace_format": "mooncake", "trace_block_size": 512,
                                  "arrival_speedup_ratio": 1.0}
    assert payload["spec"]["max_in_flight"] is None and payload["spec"]["sla"] == {}
    parse_payload(payload)  # the payload parser takes what the lowering writes


def test_role_defaults_of_a_disaggregated_config():
    doc = edited(("engine.mode", "disaggregated"),
                 ("engine.workers", {"prefill": BASE["engine"]["workers"]["aggregated"],
                                     "decode": BASE["engine"]["workers"]["aggregated"]}),
                 ("engine.kv_transfer", {"bandwidth_gb_per_second": 10.0}))
    spec = lower_predict_config(doc)["spec"]
    assert spec["engine"]["prefill"]["rank"]["max_num_seqs"] == 1  # a prefill worker admits one
    assert spec["engine"]["decode"]["rank"]["max_num_seqs"] == 256
    # auto KV bytes per token: Qwen3-32B, 64 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    assert spec["engine"]["decode"]["rank"]["kv_transfer_bytes_per_token"] == 262144
    assert spec["topology"]["kind"] == "disaggregated" and spec["topology"]["handoff_latency_ms"] == 0.0


def test_backend_geometry_and_context():
    doc = edited(("engine.backend", "sglang"))
    rank = lower_predict_config(doc)["spec"]["engine"]["rank"]
    assert rank["block_size"] == 1 and "max_model_len" not in rank  # only vLLM takes max by default
    doc = edited(("engine.backend", "trtllm"), ("engine.context_length", 4096))
    rank = lower_predict_config(doc)["spec"]["engine"]["rank"]
    assert rank["block_size"] == 32 and rank["max_model_len"] == 4096


def test_startup_seconds_become_the_pool_delay():
    """Carried as the reference's CLI writes it; it delays only workers a scaler adds."""
    spec = lower_predict_config(edited((f"{AGG}.startup_seconds", 0.25)))["spec"]
    assert spec["topology"]["workers"]["startup_delay_ms"] == 250.0
    parse_payload({"spec": spec, "traffic": BASE_TRAFFIC_PAYLOAD})


def test_trace_concurrency_sla_and_time_cap():
    doc = edited(("traffic.load", {"type": "concurrency", "concurrency": 7}),
                 ("traffic.stop", {"max_virtual_time_seconds": 2.5}),
                 ("evaluation", {"sla": {"ttft_ms": 300, "itl_ms": 25}}))
    payload = lower_predict_config(doc)
    assert payload["spec"]["max_in_flight"] == 7 and payload["traffic"]["replay_concurrency"] == 7
    assert payload["spec"]["max_sim_time_ms"] == payload["traffic"]["max_sim_time_ms"] == 2500.0
    assert payload["spec"]["sla"] == {"ttft_ms": 300.0, "itl_ms": 25.0}


@pytest.mark.parametrize("edits, where", [
    ([("traffic.source", {"type": "synthetic-session"})], "traffic.source.session: required"),
    ([("traffic.source.format", "agentic_mooncake"),
      ("traffic.load", {"type": "trace_timestamps", "agentic_lanes": 1, "agentic_snapshot": {"seed": 7},
                        "agentic_profile": {"duration_seconds": 10}})],
     "traffic.load.agentic_profile: not simulated"),
    ([("traffic.load.agentic_lanes", 2)], "traffic.load.agentic_lanes: agentic_lanes requires weka, agentic_mooncake"),
    ([("traffic.source.format", "agentic_mooncake"),
      ("traffic.load", {"type": "trace_timestamps", "agentic_lanes": 1,
                        "agentic_snapshot": {"seed": 7, "initial_selections": [{"source_play_id": "p",
                                                                                 "t_star_ms": 0.0}],
                                             "corpus_cursor": 1}})],
     "traffic.load.agentic_snapshot.initial_selections: not simulated"),
    ([("engine.speculation", {"kind": "eagle3", "params": {"num_speculative_tokens": 3}})],
     "engine.speculation.kind: not simulated"),
    ([("engine.speculation", {"kind": "mtp", "params": {"depth": 2}})],
     "engine.speculation.expected_accepted_tokens: required"),
    ([("engine.speculation", {"kind": "ngram", "num_speculative_tokens": 2, "acceptance_rates": [0.5]})],
     "engine.speculation.acceptance_rates: must list 2 rates"),
    ([("engine.nextn", 2)], "engine.nextn: nextn requires explicit nextn_accepted"),
    ([("engine.nextn", 2), ("engine.nextn_accepted", 2.5)], "engine.nextn_accepted: must be a number in"),
    ([("engine.mode", "afd")], "engine.mode: not simulated"),
    ([("engine.fpm_profile", {"x": 1})], "engine.fpm_profile: not simulated"),
    ([("engine.estimation_mode", "fpm_interpolation")], "engine.estimation_mode: not simulated"),
    ([("engine.workers.encoder", {})], "engine.workers.encoder: not simulated"),
    ([(f"{AGG}.host_profile", {"x": 1})], f"{AGG}.host_profile: not simulated"),
    ([(f"{AGG}.host_loop", True)], f"{AGG}.host_loop: workers.aggregated.host_loop and "
                                   "workers.aggregated.vision are supported only for backend=sglang"),
    ([(f"{AGG}.kv_cache.host_offload", {"num_host_blocks": 10})], f"{AGG}.kv_cache.host_offload: not simulated"),
    ([(f"{AGG}.kv_cache.state_cache", {})], f"{AGG}.kv_cache.state_cache: not simulated"),
    ([(f"{AGG}.parallelism", {"decode_context": 2})], f"{AGG}.parallelism.decode_context: not simulated"),
    ([(f"{AGG}.parallelism", {"pipeline": 2})], f"{AGG}.parallelism.pipeline: not simulated"),
    ([("engine.backend", "sglang"), (f"{AGG}.kv_cache.capacity", {"type": "default"})],
     f"{AGG}.kv_cache.capacity: an SGLang KV pool sized from GPU memory"),
])
def test_what_is_not_simulated_is_refused_by_its_path(edits, where):
    with pytest.raises(ConfigError, match="^" + where.replace(".", r"\.")):
        lower_predict_config(edited(*edits))


@pytest.mark.parametrize("edits, where", [
    ([("engine.workers.aggregated.kv_cache.capcity", 1)], "engine.workers.aggregated.kv_cache.capcity: unknown field"),
    ([("engine.bogus", 1)], "engine.bogus: unknown field"),
    ([("extra", 1)], "extra: unknown field"),
    ([("engine.model", KeyError)], "engine.model: required"),
    ([("engine.hardware", "auto")], "engine.hardware: 'auto' is for recommendation only"),
    ([("engine.backend", "tgi")], "engine.backend: must be one of vllm, sglang, trtllm"),
    ([("engine.kv_transfer", {"bandwidth_gb_per_second": 1.0})], "engine.kv_transfer: aggregated mode rejects"),
    ([("engine.mode", "disaggregated")], "engine.workers.prefill: disaggregated mode requires"),
    ([(f"{AGG}.hardware", "h100_sxm")], f"{AGG}.hardware: worker hardware overrides require"),
    ([(f"{AGG}.kv_cache.capacity", {"type": "fixed"})], f"{AGG}.kv_cache.capacity: fixed KV capacity takes"),
    ([(f"{AGG}.kv_cache.capacity", {"type": "fixed", "blocks": 5, "memory_fraction": 0.5})],
     f"{AGG}.kv_cache.capacity.memory_fraction: fixed KV capacity rejects"),
    ([(f"{AGG}.kv_cache.capacity", {"type": "default", "blocks": 5})], f"{AGG}.kv_cache.capacity: default KV capacity rejects"),
    ([(f"{AGG}.kv_cache.capacity", {"type": "fixed", "bytes": 10 ** 9})], f"{AGG}.kv_cache.capacity.bytes: capacity in bytes requires"),
    ([(f"{AGG}.kv_cache.block_size", 1)], f"{AGG}.kv_cache.block_size: vLLM and TensorRT-LLM require"),
    ([(f"{AGG}.timing", {"type": "fixed", "prefill_ms": 1.0})], f"{AGG}.timing.decode_ms: fixed timing requires"),
    ([(f"{AGG}.timing", {"type": "polynomial", "gemm_quant_mode": "fp8"})], f"{AGG}.timing.gemm_quant_mode: requires default timing"),
    ([(f"{AGG}.scheduler", {"prefill_decode_interval": 2})], f"{AGG}.scheduler.prefill_decode_interval: is supported only for backend=sglang"),
    ([("traffic.load", {"type": "poisson"})], "traffic.load.type: trace traffic requires"),
    ([("traffic.stop", {"requests": 5})], "traffic.stop.requests: trace traffic only accepts"),
    ([("traffic.source.paths", ["a", "b"])], "traffic.source.paths: trace format 'mooncake' takes exactly one path"),
    ([("evaluation", {"sla": {"e2e_ms": 5, "ttft_ms": 3}})], "evaluation.sla.e2e_ms: is mutually exclusive"),
])
def test_invalid_configs_name_the_field(edits, where):
    with pytest.raises(ConfigError, match="^" + where.replace(".", r"\.").replace("(", r"\(")):
        lower_predict_config(edited(*edits))


def test_a_file_that_is_not_yaml_names_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  model: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3: not valid YAML"):
        read_predict_config(path)
    with pytest.raises(ConfigError, match="predict config not found"):
        read_predict_config(tmp_path / "missing.yaml")


def test_tokenization_becomes_the_payload_pool():
    payload = lower_predict_config(edited(("engine.tokenization",
                                           {"workers": 3, "base_ms": 2.0, "per_input_token_us": 1.5})))
    assert payload["tokenization"] == {"workers": 3, "base_ms": 2.0, "per_input_token_ms": 0.0015}
    assert parse_payload(payload).tokenization.workers == 3
    # a pool that costs nothing is none, as the reference writes it
    assert "tokenization" not in lower_predict_config(edited(("engine.tokenization", {"workers": 2})))
