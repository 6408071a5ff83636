"""The payload's top-level keys beside spec and traffic: the ``tokenization`` pool
(``config.payload.parse_tokenization``): its fields,
and the combinations not simulated refused by name. Its timing against the reference is
``tests/golden/test_cli_payloads.py`` (``*.tokenized.csv``); and
``capture_performance_diagnostics`` (a boolean; the diagnostics themselves against the
reference: ``*.perfdiag.json`` there)."""

import copy

import pytest

from aisim_fast.config.payload import ConfigError, TokenizationConfig, parse_payload

PAYLOAD = {
    "spec": {"topology": {"kind": "aggregated", "workers": {"initial_workers": 2}},
             "engine": {"rank": {"backend": "vllm"}}},
    "traffic": {"trace_path": "t.jsonl"},
    "tokenization": {"workers": 2, "base_ms": 3.0, "per_input_token_ms": 0.001},
}


def with_(path: str, value) -> dict:
    payload = copy.deepcopy(PAYLOAD)
    node = payload
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return payload


def test_the_pool_is_read():
    assert parse_payload(PAYLOAD).tokenization == TokenizationConfig(2, 3.0, 0.001)
    assert parse_payload(with_("tokenization", None)).tokenization is None
    assert parse_payload(with_("tokenization", {})).tokenization == TokenizationConfig(1, 0.0, 0.0)


@pytest.mark.parametrize("path, value, words", [
    ("tokenization.workers", 0, "tokenization.workers: must be an integer >= 1"),
    ("tokenization.base_ms", -1.0, "tokenization.base_ms: must be a finite number >= 0"),
    ("tokenization.per_input_token_ms", "fast", "tokenization.per_input_token_ms: must be a finite number"),
    ("tokenization.threads", 2, "tokenization.threads: unknown field"),
    ("spec.adapters", {"placement": {"provider": "kv_router"}}, "tokenization: a tokenization pool with kv_router"),
])
def test_bad_pools_are_named(path, value, words):
    with pytest.raises(ConfigError, match="^" + words.replace(".", r"\.")):
        parse_payload(with_(path, value))


def test_disaggregated_pools_go_ahead_of_the_prefill_workers_only():
    """A pool per prefill worker (the reference's, tests/golden/test_cli_payloads.py
    tok_pd_*), shared by its attention-DP ranks (tok_pd_dp): on its first rank."""
    import aisim_fast.kernels.schema.layout as L
    from aisim_fast.engine.build import build_state
    from aisim_fast.engine.simulation import simulation_from_setup

    payload = with_("spec.topology", {"kind": "disaggregated", "prefill": {"initial_workers": 2},
                                      "decode": {"initial_workers": 3}})
    payload["spec"]["engine"] = {"prefill": {"rank": {"backend": "vllm"}}, "decode": {"rank": {"backend": "vllm"}}}
    from support.paths import DATA_DIR

    setup = parse_payload(payload, ".", str(DATA_DIR / "traces" / "mooncake_tiny20.jsonl"))
    assert setup.disaggregated and setup.tokenization is not None
    cfg = build_state([simulation_from_setup(setup)])[0]
    assert list(cfg.i64[:, L.CFG_TOK_SERVERS]) == [setup.tokenization.workers] * 2 + [0] * 3
    payload["spec"]["engine"]["prefill"]["dp_size"] = 2
    setup = parse_payload(payload, ".", str(DATA_DIR / "traces" / "mooncake_tiny20.jsonl"))
    cfg = build_state([simulation_from_setup(setup)])[0]
    assert list(cfg.i64[:, L.CFG_TOK_SERVERS]) == [setup.tokenization.workers, 0] * 2 + [0] * 3


def test_performance_diagnostics_capture_is_a_boolean():
    assert parse_payload(PAYLOAD).capture_performance_diagnostics is False
    assert parse_payload(dict(PAYLOAD, capture_performance_diagnostics=True)).capture_performance_diagnostics
    with pytest.raises(ConfigError, match="^capture_performance_diagnostics: "):
        parse_payload(dict(PAYLOAD, capture_performance_diagnostics="yes"))


def test_kv_eviction_policy_lru_is_the_explicit_default():
    """The reference's spec.engine.kv_eviction_policy: 'lru' (its default, what runs
    here) is accepted; its Belady oracle is refused naming the field and what runs."""
    import copy
    import json

    from support.paths import DATA_DIR

    payload = json.loads((DATA_DIR / "golden" / "tiny20_vllm_agg1.spec.json").read_text())
    plain = parse_payload(copy.deepcopy(payload), DATA_DIR / "traces")
    payload["spec"]["engine"]["kv_eviction_policy"] = "lru"
    assert parse_payload(copy.deepcopy(payload), DATA_DIR / "traces") == plain
    payload["spec"]["engine"]["kv_eviction_policy"] = "belady"
    with pytest.raises(ConfigError, match="spec.engine.kv_eviction_policy: 'belady' .* is not simulated yet; 'lru'"):
        parse_payload(copy.deepcopy(payload), DATA_DIR / "traces")
    payload["spec"]["engine"]["kv_eviction_policy"] = "fifo"
    with pytest.raises(ConfigError, match="spec.engine.kv_eviction_policy.*lru, belady"):
        parse_payload(payload, DATA_DIR / "traces")
