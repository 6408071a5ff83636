"""Speculative decoding (kernels.spec) against reference runs
(tests/data/golden_speculation) and its acceptance draw against a plain-Python oracle:

* every request's timeline bit for bit on vLLM (ngram 3 drafts on the captured CLI
  payload; 2 drafts at the default rates on two workers), TRT-LLM and disaggregated
  vLLM 1P2D, with a 256-token budget on vLLM (its drafts take budget) and TRT-LLM
  (they do not), MTP priced by op-level (AIC) timing (the CLI's ``nextn`` and
  ``mtp`` scheme payloads, 3 drafts on two workers over the 1k trace), and SGLang
  (two workers; sessions on 16-token pages with five retractions; disaggregated 1P2D);
* the draw is rand's Bernoulli chain over the rank's StdRng stream: a rate of 1 draws
  nothing, any other rate one ``u64``; its mean is ``1 + r0 + r0 r1 + ...``;
* the rank keys are checked as the reference checks them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from numba import njit

from aisim_fast.config import speculation
from aisim_fast.config.payload import ConfigError, accept_rates, load_spec, parse_rank
from aisim_fast.config.predict_config import read_predict_config
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.spec.sampler import accept_thresholds, accepted_tokens, stream_key
from aisim_fast.trace.seeded_rng import StdRng
from support import goldens
from support.parity_rules import timeline_differences
from support.aic_cache import fresh_value_cache
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_speculation"
CASES = sorted(p.name[:-len(".spec.json")] for p in GOLDEN.glob("*.spec.json"))
_RUNS: dict = {}

# the AIC value cache in a folder of this module's own, as on a fresh machine
_own_value_cache = pytest.fixture(autouse=True, scope="module")(fresh_value_cache)


def run(case: str):
    if case not in _RUNS:
        spec = GOLDEN / f"{case}.spec.json"
        trace = DATA_DIR / "traces" / Path(json.loads(spec.read_text())["traffic"]["trace_path"]).name
        setup = load_spec(spec, trace_override=str(trace))
        _RUNS[case] = run_batch([simulation_from_setup(setup)]).check().requests[0]
    return _RUNS[case]


def test_cases_present():
    assert CASES == ["mtp_aic_1k", "mtp_aic_tiny20", "mtp_scheme_aic_tiny20", "ngram3_tiny20",
                     "sglang_disagg_1p2d", "sglang_nextn2_1k", "sglang_sessions_retract",
                     "trtllm_budget256_1k", "trtllm_nextn3_1k", "vllm_budget256_1k", "vllm_disagg_1p2d",
                     "vllm_nextn2_default_1k", "vllm_pressure_1k_b16x1200", "vllm_pressure_recompute_21",
                     "vllm_pressure_recompute_nextn2_lifo_21"]


@pytest.mark.parametrize("case", CASES)
def test_requests_match_the_reference(case):
    gold = goldens.read_golden(case, GOLDEN)
    cand = goldens.index_frame(run(case))
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(case, missing, bad)
    diffs = timeline_differences(gold, cand)
    assert not diffs, f"{case}: {len(diffs)} cells differ, first {diffs[:3]}"


@pytest.mark.parametrize("case", ["ngram3_tiny20", "mtp_aic_tiny20", "mtp_scheme_aic_tiny20"])
def test_the_predict_config_lowers_as_the_reference_cli_lowers_it(case):
    """Each ``CASE.predict.yaml`` is the config the reference's CLI wrote the case's
    payload for (../shared/reference/cli-payloads/specdec: ngram_poly, nextn_aic,
    mtp_scheme_aic): ngram under polynomial timing, MTP as ``nextn`` with
    ``nextn_accepted`` and as the ``mtp`` scheme, both priced by AIC timing."""
    got = read_predict_config(GOLDEN / f"{case}.predict.yaml")["spec"]["engine"]["rank"]
    want = json.loads((GOLDEN / f"{case}.spec.json").read_text())["spec"]["engine"]["rank"]
    assert got == want


def test_mtp_lowers_expected_accepted_drafts_and_prices_its_drafts():
    legacy = read_predict_config(GOLDEN / "mtp_aic_tiny20.predict.yaml")["spec"]["engine"]["rank"]
    scheme = read_predict_config(GOLDEN / "mtp_scheme_aic_tiny20.predict.yaml")["spec"]["engine"]["rank"]
    assert legacy["aic_nextn_accept_rates"] == scheme["aic_nextn_accept_rates"] == "1,0.19999999999999996"
    assert legacy["timing_model"]["config"]["nextn"] == 2
    assert scheme["timing_model"]["config"]["speculation"] == {"kind": "mtp", "params": {"depth": 2}}
    # the two spellings run the same engine: the same timeline
    a, b = run("mtp_aic_tiny20"), run("mtp_scheme_aic_tiny20")
    assert a["last_token_ms"].tolist() == b["last_token_ms"].tolist()


# ---------------------------------------------------------------------------------
# the acceptance draw
# ---------------------------------------------------------------------------------
def _rank_state(rates, seed):
    cfg_i = np.zeros((1, L.CFG_I_FIELDS), np.int64)
    cfg_i[0, L.CFG_SPEC_NEXTN] = len(rates)
    for i, threshold in enumerate(accept_thresholds(rates)):
        cfg_i[0, L.CFG_SPEC_ACCEPT_0 + i] = threshold
    cfg = L.RankConfig(i64=cfg_i, f64=np.zeros((1, L.CFG_F_FIELDS)))
    spec_rng = np.zeros((1, 24), np.uint32)
    spec_rng[0, :8] = stream_key(seed)
    wk = L.Workers(i64=L.WORKER.new(1), pass_end_ms=np.zeros(1), run_q=np.zeros(1, np.int64),
                   wait_q=np.zeros(1, np.int64), spec_rng=spec_rng)
    return cfg, wk


@njit(_nrt=False)
def _draw_n(cfg, wk, out):
    for i in range(len(out)):
        out[i] = accepted_tokens(cfg, wk, 0)


def _draws(cfg, wk, n):
    out = np.zeros(n, np.int64)
    _draw_n(cfg, wk, out)
    return out.tolist()


def _oracle(rates, seed, n):
    """rand 0.9: Bernoulli(p) is always true for p == 1 without a draw, else
    ``next_u64() < floor(p * 2**64)``; the chain stops at the first rejection."""
    rng = StdRng(seed)
    out = []
    for _ in range(n):
        tokens = 1
        for p in rates:
            if p != 1.0 and not rng.next_u64() < int(p * 2.0 ** 64):
                break
            tokens += 1
        out.append(tokens)
    return out


@pytest.mark.parametrize("rates,seed", [((0.7, 0.5, 0.3), 42), ((1.0, 0.2), 43), ((0.85, 0.3, 0.0, 0.0, 0.0), 7),
                                        ((0.9, 0.9, 0.5, 1.0), 2 ** 64 - 1)])
def test_draws_match_the_oracle(rates, seed):
    cfg, wk = _rank_state(rates, seed)
    got = _draws(cfg, wk, 3000)
    assert got == _oracle(rates, seed, 3000)


def test_a_rate_of_one_draws_nothing_and_zero_draws_once():
    cfg, wk = _rank_state((1.0, 1.0), 42)
    assert _draws(cfg, wk, 5) == [3] * 5
    assert wk.i64[0, L.WK_SPEC_WORD] == 0
    cfg, wk = _rank_state((0.0, 1.0), 42)
    assert _draws(cfg, wk, 5) == [1] * 5
    assert wk.i64[0, L.WK_SPEC_WORD] == 10  # one u64 (two stream words) per pass


def test_mean_accepted_is_the_conditional_expectation():
    rates = (0.7, 0.5, 0.2)
    cfg, wk = _rank_state(rates, 42)
    mean = np.mean(_draws(cfg, wk, 200_000))
    assert mean == pytest.approx(1 + 0.7 + 0.7 * 0.5 + 0.7 * 0.5 * 0.2, abs=0.01)


def test_rank_keys_are_checked_as_the_reference_checks_them():
    assert accept_rates(3, "1, 0.5") == (1.0, 0.5, 0.0)
    assert accept_rates(2, "1,0.5,0.25") == (1.0, 0.5)
    assert accept_rates(2, None) == (0.85, 0.3)
    rank = parse_rank({"aic_nextn": 2, "aic_nextn_accept_rates": "0.7,0.4", "aic_mtp_seed": 9})
    assert (rank.aic_nextn, rank.aic_nextn_accept_rates, rank.aic_mtp_seed) == (2, "0.7,0.4", 9)
    for raw, field in [({"aic_nextn": 6}, "aic_nextn"), ({"aic_nextn": 0}, "aic_nextn"),
                       ({"aic_nextn_accept_rates": "0.5"}, "aic_nextn_accept_rates"),
                       ({"aic_nextn": 2, "aic_nextn_accept_rates": "1.1"}, "aic_nextn_accept_rates[0]"),
                       ({"aic_nextn": 1, "aic_nextn_accept_rates": "x"}, "aic_nextn_accept_rates"),
                       ({"aic_nextn": 1, "decode_speedup_ratio": 2.0}, "decode_speedup_ratio"),
                       ({"aic_mtp_seed": -1}, "aic_mtp_seed")]:
        with pytest.raises(ConfigError, match=re.escape(f"rank.{field}:")):
            parse_rank(raw)


# ---------------------------------------------------------------------------------
# the command line: replay flags, sizing with speculation as a choice
# ---------------------------------------------------------------------------------
def _cli(args, capsys):
    from aisim_fast.cli.app import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_speculation_choices_lower_as_the_reference_lowers_expected_counts():
    assert speculation.rank_fields("none") == {}
    assert speculation.rank_fields("mtp:2@1.2") == {"aic_nextn": 2, "aic_nextn_accept_rates": "1,0.19999999999999996"}
    assert speculation.rank_fields("eagle:3@1.5")["aic_nextn_accept_rates"] == "1,0.5,0"
    assert speculation.rank_fields("ngram:3@0.7/0.5/0.3")["aic_nextn_accept_rates"] == "0.7,0.5,0.3"
    assert speculation.rates_for_expected(5, 2.75) == "1,1,0.75,0,0"
    for bad in ("mtp:6", "beam:2", "mtp:2@x", "mtp"):
        with pytest.raises(ConfigError, match="--speculation"):
            speculation.rank_fields(bad)
    with pytest.raises(ConfigError, match=r"must be a number in \[0, 2\]"):
        speculation.rank_fields("mtp:2@2.5")


def test_replay_flags_set_the_ranks_speculation(tmp_path, capsys):
    spec = GOLDEN / "ngram3_tiny20.spec.json"
    trace = DATA_DIR / "traces" / "mooncake_tiny20.jsonl"
    code, _, err = _cli(["replay", trace, "--backend", "vllm", "--workers", "1", "--engine-args",
                         json.dumps({k: v for k, v in json.loads(spec.read_text())["spec"]["engine"]["rank"].items()
                                     if not k.startswith("aic_")}),
                         "--trace-block-size", "512", "--speculation", "ngram:3", "--acceptance", "0.7,0.5,0.3",
                         "--out", tmp_path / "r", "--quiet"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    gold = json.loads((GOLDEN / "ngram3_tiny20.report.json").read_text())
    # the report's token-gap statistics count the gaps of 0 inside a burst, as the reference's do
    for key in ("duration_ms", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "median_itl_ms", "p90_itl_ms",
                "p99_itl_ms", "mean_ttst_ms", "total_output_tokens"):
        assert summary[key] == pytest.approx(gold[key], rel=1e-9, abs=1e-9), key
    for args, message in ((["--accepted", "1"], "--accepted needs --speculation KIND:N"),
                          (["--speculation", "mtp:2", "--accepted", "3"], "--accepted: must be a number in [0, 2]"),
                          (["--speculation", "mtp:2", "--acceptance", "0.5", "--accepted", "1"], "give one")):
        code, _, err = _cli(["replay", trace, "--backend", "vllm", "--workers", "1", *args,
                             "--out", tmp_path / "x", "--quiet"], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_sizing_treats_the_speculation_scheme_as_a_choice(tmp_path, capsys):
    """One command answers "does MTP-2 at 1.4 accepted drafts save GPUs at this SLA?"."""
    trace = DATA_DIR / "traces" / "mooncake_1k.jsonl"
    code, out, err = _cli(["size", trace, "--backend", "vllm", "--speculation", "none,mtp:2@1.4",
                           "--sla", "ttft_ms=300,itl_ms=12", "--rates", "4", "--max-workers", "6",
                           "--out", tmp_path / "s", "--quiet"], capsys)
    assert code == 0, err
    evidence = pd.read_parquet(tmp_path / "s" / "sizing.parquet")
    assert set(evidence["speculation"]) == {"none", "mtp:2@1.4"}
    best = {choice: int(group[group["feasible"]]["gpus"].min()) for choice, group in evidence.groupby("speculation")}
    answer = json.loads((tmp_path / "s" / "answer.json").read_text())["answers"][0]
    assert answer["gpus"] == min(best.values())
    assert best["mtp:2@1.4"] <= best["none"]


def test_a_burst_that_can_never_fit_is_a_dead_end_not_a_spin():
    """64 blocks of 16 tokens and 4 drafts: a lone running request whose longest burst
    outgrows the pool. The reference preempts it, readmits it and fails again, pass
    after pass, and never returns (timed out after 300 s); here the request stays,
    emits nothing, and the run ends as a dead end with the reason."""
    folder = GOLDEN / "dead_end"
    setup = load_spec(folder / "lone_burst.spec.json", trace_override=str(folder / "lone_burst.jsonl"))
    res = run_batch([simulation_from_setup(setup)])
    assert res.status[0] == "dead_end" and "can never be scheduled" in res.error[0]
