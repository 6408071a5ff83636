"""report.html of a sweep and of a sizing, rendered in headless Chromium (Debian's
chromium, installed by .ci/run): the screenshot shows the plots and the answer table."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from aisim_fast.cli.app import main
from support.paths import DATA_DIR

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
ANSWER_ROW = (230, 244, 230)   # the answer row's background (report_html._STYLE)
FRONT_BLUE = (31, 119, 180)    # matplotlib's tab:blue: the Pareto front, the sizing answer ring
GREEN = (44, 160, 44)          # tab:green: feasible points


def _screenshot(page, tmp_path):
    shot = tmp_path / f"{page.parent.name}.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400",
                    f"--screenshot={shot}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    import matplotlib.image

    return (matplotlib.image.imread(shot)[:, :, :3] * 255).round().astype(int)


def _pixels(image, colour, tolerance=6) -> int:
    return int((np.abs(image - np.array(colour)).max(axis=2) <= tolerance).sum())


def _offline(page) -> None:
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text


@needs_chromium
def test_a_sweep_report_renders_its_plots_and_answer_table(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"base: {{spec: {DATA_DIR / 'golden' / '1k_vllm_agg2.spec.json'}, "
                    f"trace: {DATA_DIR / 'traces' / 'mooncake_1k.jsonl'}}}\n"
                    "workers: [1, 2, 3, 4, 6]\narrival_speedup_ratio: [4]\n"
                    "grid: {spec.engine.rank.max_num_seqs: [16, 256]}\n"
                    "sla: {ttft_p90_ms: 300, itl_p90_ms: 40}\n")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--quiet"]) == 0
    assert main(["plot", str(tmp_path / "sw")]) == 0
    page = tmp_path / "sw" / "report.html"
    _offline(page)
    image = _screenshot(page, tmp_path)
    assert _pixels(image, ANSWER_ROW) > 2_000      # the answer table, its first row highlighted
    assert _pixels(image, FRONT_BLUE) > 100        # the Pareto fronts drawn
    assert _pixels(image, GREEN) > 100             # the feasible points ringed


@needs_chromium
def test_a_sizing_report_renders_its_plot_and_answer(tmp_path, capsys):
    assert main(["size", "--spec", str(DATA_DIR / "golden" / "1k_vllm_agg2.spec.json"), "--trace",
                 str(DATA_DIR / "traces" / "mooncake_1k.jsonl"), "--sla", "ttft_p90_ms=300,itl_p90_ms=30",
                 "--rates", "4", "--max-workers", "8", "--out", str(tmp_path / "sz"), "--quiet"]) == 0
    page = tmp_path / "sz" / "report.html"
    _offline(page)
    assert "<td>4</td>" in page.read_text() and 'id="answer"' in page.read_text()
    image = _screenshot(page, tmp_path)
    assert _pixels(image, GREEN) > 100             # feasible candidates drawn
    assert _pixels(image, FRONT_BLUE) > 50         # the answer ringed
    assert _pixels(image, (240, 240, 240)) > 500   # the answer table's header
