"""PNG plots of a run folder (``aisim-fast plot DIR``), with matplotlib's Agg backend.

* A sweep folder (``points.parquet``): the Pareto front of output throughput per GPU
  against throughput per user (mean output tokens/s a request sees), and against TTFT
  p90; every finished point drawn, the front joined, SLA-feasible points marked when
  the sweep had an SLA.
* A replay folder (``requests.parquet``, ``passes.parquet`` if recorded): TTFT and
  TPOT CDFs; and over virtual time, output tokens/s, queued requests and KV blocks in
  use, summed over workers, in one-second bins.

Files go to ``DIR/plots/`` (each written to a temporary name, then renamed).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

PLOTS_DIR = "plots"
PER_GPU = "output_throughput_per_gpu_tok_s"
PER_USER = "mean_output_token_throughput_per_user"
TTFT_P90 = "p90_ttft_ms"


class PlotError(ValueError):
    """A folder that holds nothing to plot."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def pareto_front(x: np.ndarray, y: np.ndarray, maximize_x: bool = True) -> np.ndarray:
    """Indices of the points no other point beats in both ``y`` (higher) and ``x``
    (higher, or lower with ``maximize_x`` False), ordered by x."""
    sx = x if maximize_x else -x
    order = np.lexsort((-y, -sx))  # best x first, then best y
    front, best_y = [], -np.inf
    for i in order:
        if y[i] > best_y:
            front.append(i)
            best_y = y[i]
    return np.array(sorted(front, key=lambda i: x[i]), dtype=np.int64)


def plot_sweep(points: pd.DataFrame, out: Path) -> list[Path]:
    plt = _pyplot()
    ok = points[points["status"] == "ok"]
    if not len(ok):
        raise PlotError("no point of the sweep finished: nothing to plot")
    written = []
    feasible = ok["sla_ok"].fillna(False).astype(bool).to_numpy() if "sla_ok" in ok else None
    for x_col, x_label, maximize, name in (
            (PER_USER, "output tokens/s per user (mean)", True, "pareto_per_user.png"),
            (TTFT_P90, "TTFT p90 (ms)", False, "pareto_ttft.png")):
        x = ok[x_col].to_numpy(np.float64)
        y = ok[PER_GPU].to_numpy(np.float64)
        fig, ax = plt.subplots(figsize=(7, 5))
        ax.scatter(x, y, s=14, color="0.6", label="points")
        if feasible is not None:
            ax.scatter(x[feasible], y[feasible], s=22, color="tab:green", label="meets the SLA")
        front = pareto_front(x, y, maximize)
        ax.plot(x[front], y[front], "-o", color="tab:blue", ms=4, label="Pareto front")
        ax.set_xlabel(x_label)
        ax.set_ylabel("output tokens/s per GPU")
        if not maximize:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{len(ok)} points")
        written.append(_save(fig, out / name))
        plt.close(fig)
    return written


def _cdf(ax, values: np.ndarray, label: str) -> None:
    v = np.sort(values[np.isfinite(values)])
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot_replay(requests: pd.DataFrame, passes: pd.DataFrame | None, out: Path) -> list[Path]:
    plt = _pyplot()
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, col, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        _cdf(ax, requests[col].to_numpy(np.float64), label)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    written.append(_save(fig, out / "latency_cdf.png"))
    plt.close(fig)
    if passes is not None and len(passes):
        t_s = passes["end_ms"].to_numpy(np.float64) / 1000.0
        bins = np.arange(0.0, np.floor(t_s.max()) + 2.0)
        which = np.digitize(t_s, bins) - 1
        tokens = np.bincount(which, passes["num_output_tokens"].to_numpy(np.float64), len(bins))
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        axes[0].plot(bins, tokens)
        axes[0].set_ylabel("output tokens/s")
        # queue depth and KV use: each worker's latest pass in the bin, summed over workers
        for ax, cols, label in ((axes[1], ("num_running", "num_waiting"), "requests"),
                                (axes[2], ("active_blocks",), "KV blocks in use")):
            for col in cols:
                frame = pd.DataFrame({"bin": which, "worker": passes["worker"], "v": passes[col]})
                last = frame.groupby(["bin", "worker"])["v"].last().groupby("bin").sum()
                ax.step(bins[last.index], last.to_numpy(), where="post", label=col)
            ax.set_ylabel(label)
            ax.legend()
        axes[2].set_xlabel("virtual time (s)")
        for ax in axes:
            ax.grid(alpha=0.3)
        written.append(_save(fig, out / "timeline.png"))
        plt.close(fig)
    return written


def plot_folder(folder: str | Path) -> list[Path]:
    """Plot a sweep or replay folder into ``folder/plots``; returns the files."""
    folder = Path(folder)
    out = folder / PLOTS_DIR
    if (folder / "points.parquet").is_file():
        points = pd.read_parquet(folder / "points.parquet")
        out.mkdir(exist_ok=True)
        return plot_sweep(points, out)
    if (folder / "requests.parquet").is_file():
        passes_file = folder / "passes.parquet"
        passes = pd.read_parquet(passes_file) if passes_file.is_file() else None
        out.mkdir(exist_ok=True)
        return plot_replay(pd.read_parquet(folder / "requests.parquet"), passes, out)
    raise PlotError(f"{folder}: no points.parquet (a sweep) or requests.parquet (a replay) to plot")
