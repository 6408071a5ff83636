"""The SLA vocabulary (report/sla.py): parsing, each term's meaning, the reference's
per-request goodput against the distribution bounds (TPOT against ITL)."""

from __future__ import annotations

import numpy as np
import pytest

from aisim_fast.config.payload import ConfigError, ConfigWarning
from aisim_fast.report.metrics import summarize
from aisim_fast.report.sla import parse_sla, parse_sla_text, stat_key


def _one_request_run(token_ms, sla):
    """The summary of a run of one request whose tokens came at ``token_ms``, with the
    reference's per-request bounds ``sla`` (goodput keys) and every token gap pooled."""
    n = len(token_ms)
    req = {"arrival_ms": [0.0], "first_admit_ms": [0.0], "first_token_ms": [token_ms[0]],
           "second_token_ms": [token_ms[1]], "last_token_ms": [token_ms[-1]],
           "completion_ms": [token_ms[-1]], "input_tokens": [10], "output_tokens": [n],
           "cached_tokens": [0], "first_admission_cached_tokens": [0], "terminal_status": ["completed"]}
    row = summarize(req, None, None, sla=sla)
    gaps = np.diff(token_ms)
    row["p90_itl_ms"] = float(np.sort(gaps)[int(round(0.9 * (len(gaps) - 1)))])
    return row


def test_tpot_and_itl_differ_as_the_readme_says():
    """Tokens at 0, 10, 20, 90 ms: TPOT 30 ms (a good request under itl_ms=40), gaps
    10, 10, 70 ms (their p90, 70 ms, fails itl_p90_ms=40)."""
    row = _one_request_run([0.0, 10.0, 20.0, 90.0], {"itl_ms": 40})
    assert row["mean_tpot_ms"] == 30.0 and row["goodput_completed_requests"] == 1
    assert parse_sla({"itl_ms": 40}).judge(row).ok
    verdict = parse_sla({"itl_p90_ms": 40}).judge(row)
    assert not verdict.ok and verdict.failed == ("itl_p90_ms",) and verdict.values["itl_p90_ms"] == 70.0
    assert verdict.reason == "itl_p90_ms 70 > 40"
    assert parse_sla({"tpot_p90_ms": 30}).judge(row).ok  # one request: its TPOT is every percentile


def test_terms_parse_from_text_and_mapping_alike():
    sla = parse_sla_text("ttft_ms=300,itl_p99_ms=50,goodput=0.9,min_goodput_rps=2")
    assert sla == parse_sla({"ttft_ms": 300, "itl_p99_ms": 50, "goodput": 0.9, "min_goodput_rps": 2})
    assert sla.request_bounds == {"ttft_ms": 300.0} and sla.stat_bounds == {"itl_p99_ms": 50.0}
    assert sla.text() == "ttft_ms=300,itl_p99_ms=50,goodput=0.9,min_goodput_rps=2"
    assert parse_sla(dict(sla.terms())) == sla
    assert stat_key("itl_p50_ms") == "median_itl_ms" and stat_key("e2e_mean_ms") == "mean_e2e_latency_ms"


@pytest.mark.parametrize("terms, message", [
    ({"ttfb_ms": 1}, "sla.ttfb_ms: unknown SLA term; allowed: ttft_ms"),
    ({"itl_p80_ms": 1}, "sla.itl_p80_ms: unknown SLA term"),
    ({"ttft_ms": 0}, "sla.ttft_ms: must be finite and > 0"),
    ({"ttft_ms": "x"}, "sla.ttft_ms: must be a number"),
    ({"ttft_ms": True}, "sla.ttft_ms: must be a number"),
    ({"e2e_ms": 1, "itl_ms": 2}, "e2e_ms is mutually exclusive with ttft_ms / itl_ms"),
    ({"ttft_ms": 1, "goodput": 1.5}, "sla.goodput: must be in [0, 1]"),
    ({"ttft_p90_ms": 1, "min_goodput_rps": 2}, "sla.min_goodput_rps: needs a per-request bound"),
    ({"goodput": 0.5}, "sla: give at least one bound"),
    ({"ttft_ms": 1, "strict": "yes"}, "sla.strict: must be true or false"),
    ({"ttft_p90_ms": 1, "strict": True}, "sla.strict: applies the per-request bounds"),
    ({"ttft_ms": 1, "percentile": 80}, "sla.percentile: must be one of [50, 75, 90, 95, 99]"),
])
def test_bad_terms_are_named(terms, message):
    with pytest.raises(ConfigError) as err:
        parse_sla(terms)
    assert message in str(err.value)


def test_the_sweep_specs_older_percentile_form_reads_as_distribution_bounds():
    with pytest.warns(ConfigWarning, match="sla.percentile: read as the distribution bounds "
                                           "ttft_p99_ms, itl_p99_ms"):
        sla = parse_sla({"ttft_ms": 500, "itl_ms": 50, "percentile": 99})
    assert sla.stat_bounds == {"ttft_p99_ms": 500.0, "itl_p99_ms": 50.0} and not sla.request_bounds


def test_strict_applies_the_bounds_to_the_means_as_the_reference_does():
    sla = parse_sla({"ttft_ms": 100, "itl_ms": 20, "strict": True, "goodput": 0, "min_goodput_rps": 1})
    assert sla.stat_bounds == {"ttft_mean_ms": 100.0, "tpot_mean_ms": 20.0}
    row = {"num_requests": 4, "completed_requests": 4, "goodput_completed_requests": 1,
           "goodput_request_throughput_rps": 2.0, "mean_ttft_ms": 90.0, "mean_tpot_ms": 21.0}
    verdict = sla.judge(row)  # goodput=0: no fraction gate; the mean TPOT fails
    assert verdict.failed == ("tpot_mean_ms",) and verdict.values["goodput"] == 0.25


def test_rejections_fail_a_distribution_bound_and_count_against_goodput():
    row = {"num_requests": 10, "completed_requests": 9, "goodput_completed_requests": 9,
           "p90_ttft_ms": 1.0}
    assert parse_sla({"ttft_p90_ms": 5}).judge(row).failed == ("completed",)
    verdict = parse_sla({"ttft_ms": 5, "goodput": 0.95}).judge(row)
    assert verdict.failed == ("goodput",) and verdict.values["goodput"] == 0.9
    failed_run = parse_sla({"ttft_ms": 5}).judge({"status": "dead_end", "error": "dead end at t=3"})
    assert not failed_run.ok and failed_run.reason == "run dead_end: dead end at t=3"
