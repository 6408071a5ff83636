"""Reference ``predict`` configs (YAML) read directly: ``aisim-fast replay --predict-config``.

Each ``tests/data/golden_cli/NAME.predict.yaml`` is a config the reference's
``aisimulate predict --stack engine`` lowered to ``NAME.payload.json`` (captured from its
call of the native core). Our lowering must write the same payload, key for key (the
absolute ``systems_paths`` the CLI adds aside: the captures drop it and the reference
gives the same results without it); ``test_cli_payloads`` holds the payload's runs to the
reference's per-request records, so a config that lowers equal runs as the reference runs
it. One config is run end to end through the command line against its golden rows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from aisim_fast.config.predict_config import lower_predict_config, read_predict_config
from support import goldens
from support.aic_cache import fresh_value_cache
from support.cli_runs import run_cli
from support.parity_rules import timeline_differences
from support.paths import DATA_DIR

GOLDEN = DATA_DIR / "golden_cli"
CONFIGS = sorted(p.name[:-len(".predict.yaml")] for p in GOLDEN.glob("*.predict.yaml"))


# the AIC value cache in a folder of this module's own, as on a fresh machine
_own_value_cache = pytest.fixture(autouse=True, scope="module")(fresh_value_cache)


def _without_systems_paths(payload: dict) -> dict:
    payload = json.loads(json.dumps(payload))
    engine = payload["spec"]["engine"]
    for pool in ([engine] if "rank" in engine else engine.values()):
        (pool["rank"]["timing_model"].get("config") or {}).pop("systems_paths", None)
    return payload


def test_the_configs_cover_the_families():
    """Backends, topologies, timing models and capacity forms the lowering must get right."""
    assert len(CONFIGS) >= 15
    texts = {name: yaml.safe_load((GOLDEN / f"{name}.predict.yaml").read_text()) for name in CONFIGS}
    backends = {t["engine"].get("backend", "vllm") for t in texts.values()}
    modes = {t["engine"].get("mode", "aggregated") for t in texts.values()}
    loads = {t["traffic"]["load"]["type"] for t in texts.values()}
    assert backends == {"vllm", "trtllm", "sglang"} and modes == {"aggregated", "disaggregated"}
    assert loads == {"trace_timestamps", "concurrency"}


@pytest.mark.parametrize("name", CONFIGS)
def test_lowered_as_the_reference_cli_lowers_it(name):
    doc = yaml.safe_load((GOLDEN / f"{name}.predict.yaml").read_text())
    ours = lower_predict_config(doc)
    theirs = _without_systems_paths(json.loads((GOLDEN / f"{name}.payload.json").read_text()))
    assert ours == theirs


def test_read_predict_config_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("traffic:\n  source: {type: trace, paths: [t.jsonl]}\n  load: {type: trace_timestamps}\n"
                    "engine:\n  model: Qwen/Qwen3-32B\n  hardware: h200_sxm\n  mode: afd\n")
    with pytest.raises(ValueError, match=r"c\.yaml: engine\.mode: not simulated"):
        read_predict_config(path)


def test_a_config_runs_through_the_command_line(tmp_path, capsys):
    """The user's file unchanged: its relative trace path resolves beside it."""
    name = "disagg_mixed"
    folder = tmp_path / "configs"
    (folder / "traces").mkdir(parents=True)
    shutil.copy(GOLDEN / f"{name}.predict.yaml", folder)
    shutil.copy(DATA_DIR / "traces" / "sessions_200.jsonl", folder / "traces")
    out = tmp_path / "out"
    code, _, err = run_cli(["replay", "--predict-config", folder / f"{name}.predict.yaml",
                            "--out", out, "--quiet"], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["aisim_fast.config"]["mode"] == "predict_config"
    rows = pd.read_parquet(out / "requests.parquet")
    gold = goldens.read_golden(name, GOLDEN)
    cand = goldens.index_frame(rows)
    missing, bad = goldens.parity_failures(gold, cand)
    assert not missing and not bad, goldens.failure_report(name, missing, bad)
    assert not timeline_differences(gold, cand)
    report = json.loads((GOLDEN / f"{name}.report.json").read_text())
    assert summary["completed_requests"] == report["completed_requests"] == 66
