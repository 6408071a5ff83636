"""Op-level (AIC) timing against reference runs (tests/data/golden_aic).

Each case is a run of the reference with ``--timing aic`` on the 1k public trace
(README there): Qwen3-32B on h200 (the public golden, KV capacity estimated),
Llama-3.1-8B on h100, Qwen3-8B on b200 under KV pressure, Qwen3-32B at tp 2, the
MoE Qwen3-30B-A3B, TRT-LLM, and a disaggregated run. Every request's timeline must
be bit-exact, the per-op evidence must match the reference's ``power_diagnostics``
latencies, and the one correction of the package against the reference's engine
(the Q/K-norm term of decode attention) is pinned by its worked values.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from aisim_fast.aic import timing as aic
from aisim_fast.config.payload import ConfigError, load_spec, parse_payload
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from support import goldens
from support.aic_cache import fresh_value_cache
from support.parity_rules import timeline_differences
from support.paths import TESTS_DIR

GOLDEN = TESTS_DIR / "data" / "golden_aic"
TRACE = TESTS_DIR / "data" / "traces" / "mooncake_1k.jsonl"
CASES = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json"))


# the AIC value cache in a folder of this module's own, as on a fresh machine
_own_value_cache = pytest.fixture(autouse=True, scope="module")(fresh_value_cache)


def setup_of(case):
    return load_spec(GOLDEN / f"{case}.spec.json", trace_override=str(TRACE))


_RUNS: dict = {}


def run(case):
    if case not in _RUNS:
        setup = setup_of(case)
        res = run_batch([simulation_from_setup(setup)]).check()
        _RUNS[case] = (setup, res.requests[0], res.passes[0])
    return _RUNS[case]


def golden_rows(case):
    return goldens.read_golden(case, GOLDEN)


def test_cases_present():
    assert len(CASES) >= 7 and "1k_vllm_agg2_aic" in CASES


@pytest.mark.parametrize("case", CASES)
def test_aic_golden_bit_exact(case):
    gold = golden_rows(case)
    cand = goldens.index_frame(run(case)[1])
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    diffs = timeline_differences(gold, cand)
    assert not diffs, f"{case}: {len(diffs)} cells differ, first {diffs[:3]}"


@pytest.mark.parametrize("case", CASES)
def test_op_latency_evidence_matches_the_reference(case):
    setup, _, passes = run(case)
    got = aic.op_latency_evidence(setup, passes)
    want = json.loads((GOLDEN / f"{case}.report.json").read_text())["report"]["power_diagnostics"]
    assert got["latency_ms"] == pytest.approx(want["latency_ms"], rel=1e-9)
    assert [p["name"] for p in got["phases"]] == [p["name"] for p in want["phases"]]
    for mine, theirs in zip(got["phases"], want["phases"]):
        assert mine["latency_ms"] == pytest.approx(theirs["latency_ms"], rel=1e-9)
        ops = {o["name"]: o for o in theirs["operations"]}
        assert {o["name"] for o in mine["operations"]} == set(ops)
        for op in mine["operations"]:
            assert op["latency_ms"] == pytest.approx(ops[op["name"]]["latency_ms"], rel=1e-9, abs=1e-9), op
            assert op["source"] == ops[op["name"]]["source"], op["name"]


def test_kv_capacity_is_estimated_like_the_reference():
    """No num_gpu_blocks in the golden's rank: the capacity comes from model + GPU
    memory (3904 blocks for Qwen3-32B on h200, vLLM, block 64: spec/aic-timing.md)."""
    setup = setup_of("1k_vllm_agg2_aic")
    assert setup.rank.num_gpu_blocks == 3904 and setup.rank.num_gpu_blocks_estimated
    explicit = setup_of("1k_vllm_agg1_aic_qwen8b_b200_kvpressure")
    assert explicit.rank.num_gpu_blocks == 1024 and not explicit.rank.num_gpu_blocks_estimated


def _config(**over):
    raw = {"model": "Qwen/Qwen3-32B", "backend": "vllm", "system": "h200_sxm", "tp": 1,
           "kv_block_size": 64, **over}
    return aic.parse_config(raw, "cfg", backend="vllm", block_size=64, tp=raw["tp"])


def test_qk_norm_correction_pinned():
    """Qwen3's decode attention gets the reference's Q/K RMSNorm term; Llama none.
    Worked values (spec/aic-timing.md §2-3): request 1 of the public golden, TTFT
    prefill(1, 905, 0) = 82.281493 ms, second-token gap decode(1, 906) = 19.963718 ms;
    without the term the package gives 1.69095168 ms less."""
    t = aic.timing(_config())
    assert round(t.prefill(1, 905, 0)[0], 6) == 82.281493
    assert round(t.prefill(1, 1228, 0)[0], 6) == 115.662731
    total, ops = t.decode(1, 906)
    assert round(total, 6) == 19.963718
    attn = dict(zip(t.decode_names, ops))["generation_attention"]
    _, raw = t._engine.run_static_per_op(1, 1, 905, 2, 0, 1.0, 1.0, mode="static_gen", stride=32)
    uncorrected = dict((n, ms) for n, ms, _e, _s in raw)["generation_attention"]
    assert attn - uncorrected == pytest.approx(1.69095168, abs=1e-8)
    llama = aic.timing(_config(model="meta-llama/Meta-Llama-3.1-8B", system="h100_sxm"))
    llama.decode(1, 906)
    assert llama._attention_twin is None


def test_tables_overflow_and_batches_change_nothing(monkeypatch):
    """A batch of AIC simulations sharing a config, with local tables too small to
    keep what the run meets (misses then go to the provider every time), gives each
    simulation exactly its solo result."""
    cases = ["1k_vllm_agg2_aic", "1k_vllm_agg2_aic_llama8b_h100"]
    monkeypatch.setattr(aic, "LOCAL_TABLE_SLOTS", 8)
    for t in aic._TIMINGS:  # nothing known before the run: every key is a miss
        t.prefill_memo.clear()
        t.decode_memo.clear()
    sims = [simulation_from_setup(setup_of(c)) for c in cases + cases[:1]]
    res = run_batch(sims).check()
    for s, case in enumerate(cases + cases[:1]):
        want = run(case)[1]
        got = res.requests[s]
        for col in ("first_token_ms", "last_token_ms", "completion_ms"):
            np.testing.assert_array_equal(got[col].to_numpy(), want[col].to_numpy(), err_msg=case)


def test_values_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AISIM_FAST_CACHE_DIR", str(tmp_path))
    config = _config(model="Qwen/Qwen3-8B", system="b200_sxm")
    first = aic.AicTiming(config)
    value = first.decode(7, 1234)
    first.save()
    files = list((tmp_path / "aic").glob("*.npz"))
    assert len(files) == 1
    again = aic.AicTiming(config)
    assert again._engine is None and again.decode(7, 1234) == value  # served from the file


@pytest.mark.parametrize("over, field, words", [
    ({"model": "Qwen/Qwen3-33B"}, "cfg.model", "Qwen/Qwen3-32B"),
    ({"system": "h201_sxm"}, "cfg.system", "h200_sxm"),
    ({"backend_version": "0.1"}, "cfg.backend_version", "0.24.0 (current)"),
    ({"tp": 2}, "cfg.tp", "tensor_parallel_size 1"),
    ({"kv_block_size": 32}, "cfg.kv_block_size", "block_size 64"),
    ({"nextn": 6}, "cfg.nextn", "0..=5"),
    ({"backend": "trtllm"}, "cfg.backend", "'vllm'"),
    ({"colour": "red"}, "cfg.colour", "unknown field"),
])
def test_bad_configs_name_field_and_choices(over, field, words):
    raw = {"model": "Qwen/Qwen3-32B", "backend": "vllm", "system": "h200_sxm", "tp": 1, **over}
    with pytest.raises(aic.AicError) as exc:
        aic.parse_config(raw, "cfg", backend="vllm", block_size=64, tp=1)
    assert str(exc.value).startswith(field + ":") and words in str(exc.value)


def test_payload_errors_are_config_errors():
    payload = json.loads((GOLDEN / "1k_vllm_agg2_aic.spec.json").read_text())
    payload["spec"]["engine"]["rank"]["timing_model"]["config"]["system"] = "nope"
    with pytest.raises(ConfigError, match=r"^spec\.engine\.rank\.timing_model\.config\.system: "):
        parse_payload(payload, trace_override=str(TRACE))
    payload["spec"]["engine"]["rank"]["timing_model"]["provider"] = "other"
    with pytest.raises(ConfigError, match=r"timing_model\.provider: must be one of aic"):
        parse_payload(payload, trace_override=str(TRACE))


def test_missing_extra_is_one_line(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_aic(name, *args, **kwargs):
        if name.startswith("aiconfigurator_core"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_aic)
    with pytest.raises(aic.AicError) as exc:
        _config()
    assert "pip install 'aisim-fast[aic]'" in str(exc.value) and "\n" not in str(exc.value)


def test_listings():
    assert {"h100_sxm", "h200_sxm", "b200_sxm"} <= set(aic.systems())
    assert {"Qwen/Qwen3-32B", "meta-llama/Meta-Llama-3.1-8B"} <= set(aic.models())
    assert aic.backend_versions("h200_sxm", "vllm")["current"] == "0.24.0"


def test_check_rank_round_trips_an_aic_rank():
    from aisim_fast.config.payload import check_rank
    rank = setup_of("1k_vllm_agg2_aic").rank
    check_rank(rank)
    with pytest.raises(ConfigError, match="rank.aic"):
        check_rank(dataclasses.replace(rank, aic=None))


def test_sweep_over_system_and_tp_matches_the_reference_runs():
    """The model / system / tp shortcuts retime every pool: the h200 points give the
    reference's tp-1 and tp-2 runs, and a GPU is a tensor-parallel rank."""
    import aisim_fast

    spec = {"base": {"spec": str(GOLDEN / "1k_vllm_agg2_aic.spec.json"), "trace": str(TRACE)},
            "system": ["h100_sxm", "h200_sxm"], "tp": [1, 2]}
    df = aisim_fast.sweep(spec, quiet=True).set_index(["system", "tp"])
    assert (df["status"] == "ok").all()
    assert df["gpus"].to_dict() == {("h100_sxm", 1): 2, ("h100_sxm", 2): 4, ("h200_sxm", 1): 2,
                                    ("h200_sxm", 2): 4}
    for tp, case in ((1, "1k_vllm_agg2_aic"), (2, "1k_vllm_agg2_aic_qwen32b_tp2")):
        want = json.loads((GOLDEN / f"{case}.report.json").read_text())["report"]
        for metric in ("mean_ttft_ms", "p90_itl_ms", "mean_e2e_latency_ms", "duration_ms"):
            assert df.loc[("h200_sxm", tp), metric] == pytest.approx(want[metric], rel=1e-9), metric


def test_sweep_shortcut_needs_a_model_when_the_base_is_not_aic():
    from aisim_fast.studies.sweeps import SweepError, load_sweep

    spec = {"base": {"spec": str(TESTS_DIR / "data" / "golden" / "1k_vllm_agg2.spec.json"),
                     "trace": str(TRACE)}, "system": ["h200_sxm"]}
    with pytest.raises(SweepError, match=r"point 0 \(system='h200_sxm'\): model: required"):
        load_sweep(spec)


def test_cli_replay_flags_and_listings(tmp_path, capsys):
    from aisim_fast.cli.app import main

    out = tmp_path / "run"
    code = main(["replay", str(TESTS_DIR / "data" / "mooncake_tiny20.jsonl"), "--backend", "vllm",
                 "--workers", "2", "--model", "Qwen/Qwen3-8B", "--system", "h100_sxm", "--tp", "2",
                 "--out", str(out), "--quiet"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prediction_provenance"]["aggregated"]["timing_source"] == "aic"
    assert summary["kv_capacity"]["aggregated"]["source"].startswith("estimated")
    assert summary["decode_gpus_per_worker"] == 2
    assert {p["name"] for p in summary["op_latency_evidence"]["phases"]} == {"prefill", "decode"}
    # the same flags over a spec replace its timing; a spec's model is kept when only
    # the system changes
    code = main(["replay", "--spec", str(GOLDEN / "1k_vllm_agg2_aic.spec.json"), "--trace", str(TRACE),
                 "--system", "b200_sxm", "--out", str(tmp_path / "b200"), "--quiet"])
    assert code == 0
    cfg = json.loads((tmp_path / "b200" / "summary.json").read_text())["op_latency_evidence"]["configs"]
    assert cfg["aggregated"]["model"] == "Qwen/Qwen3-32B" and cfg["aggregated"]["system"] == "b200_sxm"
    capsys.readouterr()
    assert main(["replay", "--backend", "vllm", "--workers", "1", "--system", "h100_sxm",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--model: required" in capsys.readouterr().err
    assert main(["systems", "--backend", "vllm"]) == 0
    assert "h200_sxm" in capsys.readouterr().out
    assert main(["models", "--grep", "llama-3.1-8b"]) == 0
    assert capsys.readouterr().out.split() == ["meta-llama/Meta-Llama-3.1-8B"]


def test_a_failing_query_fails_its_simulations_only(monkeypatch):
    """An exception in the package while the kernels run cannot cross objmode: it is
    recorded, and the simulations of that timing are reported failed with it; the
    others in the batch are unaffected."""
    bad, good = "1k_vllm_agg2_aic_qwen30b_a3b", "1k_vllm_agg2_aic"
    target = setup_of(bad).rank.aic
    t = aic.timing(target)
    t.prefill_memo.clear()
    t.decode_memo.clear()
    real = aic.AicTiming.values

    def values(self, kind, b, x, y):
        if self.config == target and kind == 1:
            raise RuntimeError("no data for this shape")
        return real(self, kind, b, x, y)

    monkeypatch.setattr(aic.AicTiming, "values", values)
    res = run_batch([simulation_from_setup(setup_of(c)) for c in (bad, good)])
    assert res.status[0] == "rejected_config"
    assert "AIC decode query" in res.error[0] and "no data for this shape" in res.error[0]
    assert res.status[1] == "ok"
    np.testing.assert_array_equal(res.requests[1]["completion_ms"].to_numpy(),
                                  run(good)[1]["completion_ms"].to_numpy())


def test_an_engine_the_package_cannot_build_fails_at_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("AISIM_FAST_CACHE_DIR", str(tmp_path))
    t = aic.AicTiming(_config(model="Qwen/Qwen3-8B", system="h100_sxm"))

    def unbuildable(self):
        raise ValueError("unsupported architecture\nlong traceback text")

    monkeypatch.setattr(aic.AicTiming, "_build", unbuildable)
    with pytest.raises(aic.AicError, match=r"^cfg: the database cannot time Qwen/Qwen3-8B on h100_sxm "
                                           r"with vllm 0\.24\.0 \(tp 1\): unsupported architecture$"):
        t.check_buildable("cfg")


def test_sweep_timing_flags_are_defaults_the_shortcuts_override():
    from aisim_fast.studies.sweeps import SweepError, load_sweep

    spec = {"base": {"spec": str(TESTS_DIR / "data" / "golden" / "1k_vllm_agg2.spec.json"),
                     "trace": str(TRACE)}, "system": ["h100_sxm", "h200_sxm"]}
    sweep = load_sweep(spec, timing={"model": "Qwen/Qwen3-8B", "system": "b200_sxm"})
    systems = [sweep.payload(i)[0]["spec"]["engine"]["rank"]["timing_model"]["config"]["system"]
               for i in range(2)]
    assert systems == ["h100_sxm", "h200_sxm"]
    assert sweep.digest != load_sweep(spec, timing={"model": "Qwen/Qwen3-32B"}).digest
    with pytest.raises(SweepError, match="timing.gpu: unknown"):
        load_sweep(spec, timing={"gpu": "h100"})
