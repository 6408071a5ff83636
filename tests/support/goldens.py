"""The reference goldens (tests/data/golden, tests/data/golden_disagg): their cases, how each is
read and run, and the per-request parity comparison the reference's parity tool applies."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import pytest

from aisim_fast.config.payload import load_spec
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import Simulation, simulation_from_setup
from aisim_fast.trace.workload import load_mooncake
from support.parity_rules import ATOL, RTOL, as_key_part, as_number, timeline_differences, within
from support.paths import TESTS_DIR

GOLDEN = TESTS_DIR / "data" / "golden"
TRACES = TESTS_DIR / "data" / "traces"
# Small disaggregated runs of the reference made for the corners the big goldens do
# not reach (decode-side preemption, full decode pools, TRT-LLM, destination_missing,
# fallback latency, fixed timing, max_num_seqs); traces next to the specs.
MINI_GOLDEN = TESTS_DIR / "data" / "golden_disagg"
MINI_CASES = ["dm1", "fb1", "fx1", "tiny40", "tiny35", "seqs2", "ptiny2", "trt1", "trt_tiny",
              "trt_tiny2", "dead25", "disagg_conc8", "disagg_sess"]


def case_trace(case: Path, payload: dict) -> Path:
    """A kept reference run's trace (tests/data/differential and the like): the file its
    payload names when the case holds it (an agentic, applied or other own-format
    trace the differential wrote), else its ``trace.jsonl``."""
    own = case / Path((payload.get("traffic") or {}).get("trace_path") or "trace.jsonl").name
    return own if own.exists() else case / "trace.jsonl"


def golden_dir(case):
    return MINI_GOLDEN if case in MINI_CASES else GOLDEN

FAST_CASES = [
    "tiny20_vllm_agg1",
    "1k_vllm_agg1",
    "1k_vllm_agg2",
    "1k_vllm_agg1_fixed",
    "1k_vllm_agg1_conc16",
    "1k_vllm_agg1_kvpressure",
    "1k_vllm_agg2_noprefix",
    "1k_trtllm_agg2",
    "sess200_vllm_agg2",
    "sess200_vllm_agg2_conc6",
    "1k_vllm_disagg1p2d",
    "1k_vllm_disagg1p2d_bw",
    "1k_sglang_agg2",
    "10k_sglang_agg8",
    "1k_sglang_disagg1p2d",
] + MINI_CASES
SLOW_CASES = ["10k_vllm_agg8", "10k_vllm_disagg2p4d"]
ALL_CASES = FAST_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES]

# parity.py's default metric set and tolerance
PARITY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "cached_tokens", "output_tokens")
# Columns compared bit for bit where the golden has them. The golden's
# second_token_ms is written as first + ttst (a float sum), so it is left out.
# ------------------------------------------------------------------------------------------------
# parity.py rules (reimplemented so the test needs nothing outside the repo; the same
# tool is also run as-is in test_reference_parity_tool when it is available)
# ------------------------------------------------------------------------------------------------
def read_golden(case, folder=None):
    """The reference's rows of ``case`` by (request id, turn), from ``folder`` (default
    the parity goldens' folder of the case)."""
    where = golden_dir(case) if folder is None else folder
    with open(where / (case + ".csv"), newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    return {(row["request_id"].strip(), as_key_part(row.get("turn_index"))): row for row in rows}


def index_frame(frame):
    out = {}
    for row in frame.to_dict("records"):
        key = (str(row["request_id"]).strip(), as_key_part(row["turn_index"]))
        assert key not in out, "duplicate candidate key %r" % (key,)
        out[key] = row
    return out


def parity_failures(gold, cand, metrics=PARITY_METRICS, rtol=RTOL, atol=ATOL):
    """Missing keys and [(rel, abs, key, metric, golden, candidate)] worst first."""
    missing = [k for k in gold if k not in cand]
    bad = []
    for key in gold:
        if key not in cand:
            continue
        for metric in metrics:
            try:
                g = as_number(gold[key].get(metric))
                c = as_number(cand[key].get(metric))
            except ValueError:  # an unparsable cell counts as a mismatch
                g, c = 0.0, None
            ok, err, rel = within(g, c, rtol, atol)
            if not ok:
                bad.append((rel, err, key, metric, g, c))
    bad.sort(key=lambda e: (e[0], e[1]), reverse=True)
    return missing, bad


def failure_report(case, missing, bad, limit=5):
    lines = ["%s: %d missing, %d values out of tolerance" % (case, len(missing), len(bad))]
    if missing:
        lines.append("  first missing: " + ", ".join("/".join(k) for k in missing[:5]))
    for rel, err, key, metric, g, c in bad[:limit]:
        lines.append("  %-24s %-14s golden %-22r candidate %-22r abs %.3e rel %.3e"
                     % ("/".join(key), metric, g, c, err, rel))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# running the cases
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _workload(trace_path, trace_block_size, ratio):
    # one Workload object per trace: cases on the same trace then share the
    # kernel's workload table rows when they run in one batch
    return load_mooncake(trace_path, trace_block_size=trace_block_size,
                         arrival_speedup_ratio=ratio)


@functools.lru_cache(maxsize=None)
def simulation(case) -> Simulation:
    spec_path = golden_dir(case) / (case + ".spec.json")
    trace_name = json.loads(spec_path.read_text())["traffic"]["trace_path"]
    trace_dir = MINI_GOLDEN if (MINI_GOLDEN / Path(trace_name).name).exists() else TRACES
    setup = load_spec(spec_path, trace_override=str(trace_dir / Path(trace_name).name))
    wl = _workload(setup.trace_path, setup.trace_block_size, setup.arrival_speedup_ratio)
    return simulation_from_setup(setup, wl)


@functools.lru_cache(maxsize=None)
def solo(case):
    """(requests frame, passes frame, token_stat row, token_hist row) of a solo run."""
    res = run_batch([simulation(case)])
    return res.requests[0], res.passes[0], res.token_stat[0].copy(), res.token_hist[0].copy()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


AGGREGATED_CASES = [c for c in FAST_CASES if "disagg" not in c and c not in MINI_CASES]


def with_scheduler_numbers(frame, dp_size: int, prefill_dp_size: int = 1):
    """A requests frame with its workers numbered as the reference's CSV numbers them:
    with attention DP, by the rank's scheduler id in its pool (worker x dp + rank)."""
    if dp_size > 1:
        scheduler = frame["worker"] * dp_size + frame["dp_rank"]
        frame = frame.assign(worker=scheduler, decode_worker=scheduler)
    if prefill_dp_size > 1:
        frame = frame.assign(prefill_worker=frame["prefill_worker"] * prefill_dp_size + frame["prefill_dp_rank"])
    return frame


def replay_spec_case(case: str, folder: Path, out: Path):
    """Replay ``folder/case.spec.json`` through the CLI into ``out``: (requests frame,
    summary)."""
    import pandas as pd

    from aisim_fast.cli import app as cli
    code = cli.main([str(a) for a in ["replay", "--spec", folder / f"{case}.spec.json", "--out", out, "--quiet"]])
    assert code == 0, case
    return pd.read_parquet(out / "requests.parquet"), json.loads((out / "summary.json").read_text())


def assert_matches_golden(case: str, folder: Path, requests) -> None:
    """Every request of the run equals the golden's (``folder/case.csv``), timeline too."""
    gold = read_golden(case, folder)
    cand = index_frame(requests)
    missing, bad = parity_failures(gold, cand)
    assert not missing and not bad, failure_report(case, missing, bad)
    assert not timeline_differences(gold, cand)
    assert len(cand) == len(gold)
