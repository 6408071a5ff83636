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


def _colour_values(ok: pd.DataFrame, color_by: str | None):
    """(values to colour the points by, their label) of a numeric column; None when
    there is no such column."""
    if color_by is None or color_by not in ok:
        return None, None
    values = pd.to_numeric(ok[color_by], errors="coerce")
    if values.isna().all():  # a category: its codes, in order of first appearance
        values = pd.Series(pd.factorize(ok[color_by].astype(str))[0], index=ok.index, dtype=float)
    return values.to_numpy(np.float64), color_by.split(".")[-1]


def plot_sweep(points: pd.DataFrame, out: Path, *, title: str = "sweep", sla: dict | None = None,
               color_by: str | None = None) -> list[Path]:
    """The two Pareto plots of a sweep: every finished point (coloured by ``color_by``,
    SLA-feasible ones ringed), the front joined over the feasible points only when the
    sweep had an SLA (``sla``: its terms, drawn where an axis is one of them)."""
    plt = _pyplot()
    ok = points[points["status"] == "ok"]
    if not len(ok):
        raise PlotError("no point of the sweep finished: nothing to plot")
    written = []
    feasible = ok["sla_ok"].fillna(False).astype(bool).to_numpy() if "sla_ok" in ok else None
    colours, colour_label = _colour_values(ok, color_by)
    sla_text = ",".join(f"{k}={v:g}" if not isinstance(v, bool) else f"{k}={str(v).lower()}"
                        for k, v in (sla or {}).items())
    for x_col, x_label, maximize, name, bound in (
            (PER_USER, "output tokens/s per user (mean)", True, "pareto_per_user.png", None),
            (TTFT_P90, "TTFT p90 (ms)", False, "pareto_ttft.png", (sla or {}).get("ttft_p90_ms"))):
        x = ok[x_col].to_numpy(np.float64)
        y = ok[PER_GPU].to_numpy(np.float64)
        fig, ax = plt.subplots(figsize=(7.5, 5))
        if colours is not None:
            drawn = ax.scatter(x, y, s=16, c=colours, cmap="viridis", label="points")
            fig.colorbar(drawn, ax=ax, label=colour_label)
        else:
            ax.scatter(x, y, s=16, color="0.55", label="points")
        on_front = np.ones(len(x), bool) if feasible is None else feasible
        if feasible is not None:
            ax.scatter(x[feasible], y[feasible], s=60, facecolors="none", edgecolors="tab:green",
                       linewidths=1.2, label="meets the SLA")
        if on_front.any():
            idx = np.flatnonzero(on_front)
            front = idx[pareto_front(x[idx], y[idx], maximize)]
            ax.plot(x[front], y[front], "-o", color="tab:blue", ms=4,
                    label="Pareto front" + (" (feasible points)" if feasible is not None else ""))
        if bound is not None:
            ax.axvline(bound, color="tab:red", linestyle="--", linewidth=1, label=f"SLA ttft_p90_ms={bound:g}")
        ax.set_xlabel(x_label)
        ax.set_ylabel("output tokens/s per GPU")
        if not maximize:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        met = "" if feasible is None else f", {int(feasible.sum())} meet the SLA"
        ax.set_title(f"{title}: {len(ok)} points{met}" + (f"\nSLA {sla_text}" if sla_text else ""),
                     fontsize=10)
        written.append(_save(fig, out / name))
        plt.close(fig)
    return written


def plot_sizing(evidence: pd.DataFrame, out: Path, *, title: str, sla: dict) -> Path:
    """Every sizing candidate: its cost (GPUs, or USD per hour) against its p90 TTFT,
    feasible ones green, the TTFT bound when the SLA has one; a panel per rate."""
    plt = _pyplot()
    ran = evidence[evidence["status"] == "ok"]
    if not len(ran):
        raise PlotError("no candidate of the sizing ran: nothing to plot")
    rates = sorted(ran["rate"].unique()) if "rate" in ran else [None]
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    dollars = "cost_per_hour_usd" in ran and ran["cost_per_hour_usd"].notna().all() \
        and not (ran["cost"] == ran["gpus"]).all()
    for ax, rate in zip(axes[0], rates):
        part = ran if rate is None else ran[ran["rate"] == rate]
        x = part["cost_per_hour_usd" if dollars else "gpus"].to_numpy(np.float64)
        y = part[TTFT_P90].to_numpy(np.float64)
        good = part["feasible"].astype(bool).to_numpy()
        ax.scatter(x[~good], y[~good], s=22, color="0.6", label="misses the SLA")
        ax.scatter(x[good], y[good], s=28, color="tab:green", label="meets the SLA")
        if good.any():
            best = np.flatnonzero(good)[np.argmin(x[good])]
            ax.scatter([x[best]], [y[best]], s=160, facecolors="none", edgecolors="tab:blue",
                       linewidths=1.5, label="answer")
        bound = sla.get("ttft_p90_ms")
        if bound is not None:
            ax.axhline(bound, color="tab:red", linestyle="--", linewidth=1, label=f"ttft_p90_ms={bound:g}")
        ax.set_yscale("log")
        ax.set_xlabel("USD per hour" if dollars else "GPUs")
        ax.set_ylabel("TTFT p90 (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"rate x{rate:g}" if rate is not None else "candidates", fontsize=10)
    fig.suptitle(title, fontsize=11)
    return _save(fig, out)


def _cdf(ax, values: np.ndarray, label: str) -> None:
    v = np.sort(values[np.isfinite(values)])
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot_replay(requests: pd.DataFrame, passes: pd.DataFrame | None, out: Path, *, title: str = "replay",
                prefill_workers: int = 0) -> list[Path]:
    plt = _pyplot()
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, col, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        _cdf(ax, requests[col].to_numpy(np.float64), label)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    written.append(_save(fig, out / "latency_cdf.png"))
    plt.close(fig)
    if passes is not None and len(passes):
        t_s = passes["end_ms"].to_numpy(np.float64) / 1000.0
        bins = np.arange(0.0, np.floor(t_s.max()) + 2.0)
        # a disaggregated run's passes number the prefill workers first: one column each
        pools = ([("prefill", passes[passes["worker"] < prefill_workers]),
                  ("decode", passes[passes["worker"] >= prefill_workers])] if prefill_workers
                 else [("workers", passes)])
        fig, axes = plt.subplots(3, len(pools), figsize=(9 * len(pools), 8), sharex=True, squeeze=False)
        for column, (pool, part) in enumerate(pools):
            which = np.digitize(part["end_ms"].to_numpy(np.float64) / 1000.0, bins) - 1
            tokens = np.bincount(which, part["num_output_tokens"].to_numpy(np.float64), len(bins))
            axes[0][column].plot(bins, tokens)
            axes[0][column].set_ylabel("output tokens/s")
            axes[0][column].set_title(f"{pool} ({part['worker'].nunique()} workers)")
            # queue depth and KV use: each worker's latest pass in the bin, summed over workers
            for ax, cols, label in ((axes[1][column], ("num_running", "num_waiting"), "requests"),
                                    (axes[2][column], ("active_blocks",), "KV blocks in use")):
                for col in cols:
                    frame = pd.DataFrame({"bin": which, "worker": part["worker"].to_numpy(),
                                          "v": part[col].to_numpy()})
                    last = frame.groupby(["bin", "worker"])["v"].last().groupby("bin").sum()
                    ax.step(bins[last.index], last.to_numpy(), where="post", label=col)
                ax.set_ylabel(label)
                ax.legend()
            axes[2][column].set_xlabel("virtual time (s)")
        for ax in axes.flat:
            ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=11)
        written.append(_save(fig, out / "timeline.png"))
        plt.close(fig)
    return written


def plot_folder(folder: str | Path, color_by: str | None = None) -> list[Path]:
    """Plot a sweep, sizing or replay folder into ``folder/plots`` (a sweep or a sizing
    also gets ``folder/report.html``); returns the files."""
    folder = Path(folder)
    out = folder / PLOTS_DIR
    if (folder / "points.parquet").is_file():
        points = pd.read_parquet(folder / "points.parquet")
        manifest = _manifest(folder)
        sla = (manifest.get("sweep") or {}).get("sla") or {}
        columns = (manifest.get("sweep") or {}).get("columns") or []
        if color_by is not None and color_by not in points:
            raise PlotError(f"--color-by: {color_by!r} is not a column of {folder / 'points.parquet'}; "
                            f"the varied ones: {', '.join(columns) or '(none)'}")
        out.mkdir(exist_ok=True)
        written = plot_sweep(points, out, title=folder.resolve().name, sla=sla,
                             color_by=color_by or next(iter(columns), None))
        return written + [sweep_report(folder, points, sla, written)]
    if (folder / "answer.json").is_file() and (folder / "sizing.parquet").is_file():
        import json

        answer = json.loads((folder / "answer.json").read_text(encoding="utf-8"))
        out.mkdir(exist_ok=True)
        written = [plot_sizing(pd.read_parquet(folder / "sizing.parquet"), out / "sizing.png",
                               title=f"{folder.resolve().name}: candidates", sla=answer.get("sla", {}))]
        return written + [sizing_report(folder, answer, written[0])]
    if (folder / "requests.parquet").is_file():
        passes_file = folder / "passes.parquet"
        passes = pd.read_parquet(passes_file) if passes_file.is_file() else None
        config = _summary_config(folder)
        out.mkdir(exist_ok=True)
        return plot_replay(pd.read_parquet(folder / "requests.parquet"), passes, out,
                           title=folder.resolve().name, prefill_workers=int(config.get("prefill_workers") or 0))
    raise PlotError(f"{folder}: no points.parquet (a sweep), answer.json (a sizing) or requests.parquet "
                    "(a replay) to plot")


def _manifest(folder: Path) -> dict:
    import json

    path = folder / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _summary_config(folder: Path) -> dict:
    import json

    path = folder / "summary.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8")).get("aisim_fast.config") or {}


def sweep_report(folder: Path, points: pd.DataFrame, sla: dict, images: list[Path]) -> Path:
    """``folder/report.html``: the Pareto plots and the best points (SLA-feasible ones by
    GPUs then throughput per GPU, or every finished one by throughput per GPU)."""
    from aisim_fast.studies.report_html import REPORT_FILE, write_report

    ok = points[points["status"] == "ok"]
    if "sla_ok" in ok:
        best = ok[ok["sla_ok"].fillna(False).astype(bool)].sort_values(["gpus", PER_GPU], ascending=[True, False])
        heading = f"Answer: the points that meet the SLA ({len(best)} of {len(points)}), fewest GPUs first"
    else:
        best = ok.sort_values(PER_GPU, ascending=False)
        heading = f"Answer: every finished point ({len(best)} of {len(points)}), best throughput per GPU first"
    shown = ["point", *[c for c in points.columns if c.startswith(("spec.", "traffic.")) or c in
                        ("trace", "model", "system", "tp")], "gpus", PER_GPU, TTFT_P90, "p90_itl_ms",
             *[c for c in ("cost_per_hour_usd", "sla_failed") if c in points]]
    table = best[[c for c in shown if c in best]].head(25).rename(columns=lambda c: c.split(".")[-1]
                                                                   if c.startswith("spec.") else c)
    terms = ", ".join(f"{k}={v}" for k, v in sla.items()) or "none"
    failed = points[points["status"] != "ok"]
    return write_report(folder / "report.html", f"Sweep {folder.resolve().name}",
                        f"{len(points)} points, {len(failed)} failed; SLA: {terms}",
                        [(heading, [(table, 0 if len(table) else None)]),
                         ("Pareto fronts", list(images))])


def sizing_report(folder: Path, answer: dict, image: Path, name: str | None = None) -> Path:
    """``folder/report.html`` of a sizing run: the answer per rate (or per window) and
    the candidates plot (and replicas(t) of a sizing over time)."""
    from aisim_fast.studies.report_html import write_report

    rows = []
    for entry in answer.get("answers", []):
        rows.append({"rate": entry["rate"], "fits": entry["feasible"], "GPUs": entry.get("gpus"),
                     "deployment": ", ".join(f"{k}={v}" for k, v in (entry.get("deployment") or {}).items())
                     or (entry.get("closest") or {}).get("reason", ""),
                     "USD per hour": entry.get("cost_per_hour_usd"),
                     "candidates run": entry.get("candidates_evaluated")})
    sections = []
    if rows:
        sections.append(("Answer", [pd.DataFrame(rows)]))
    if "over_time" in answer:
        t = answer["over_time"]
        summary = (f"peak {t['peak_gpus']} GPUs, mean {t['mean_gpus']:.2f}; a perfect autoscaler spends "
                   f"{t['autoscaled_gpu_hours']:.3f} GPU-hours against {t['static_gpu_hours']:.3f} at the peak"
                   if t.get("peak_gpus") is not None else
                   f"no candidate meets the SLA in window(s) {', '.join(map(str, t['infeasible_windows']))}")
        sections.append(("Answer: GPUs over time", [summary, pd.DataFrame(answer.get("windows", []))]))
    replicas = Path(folder) / "replicas.png"
    if replicas.is_file():
        sections.append(("GPUs over time", [replicas]))
    sections.append(("Candidates", [image]))
    terms = ", ".join(f"{k}={v}" for k, v in (answer.get("sla") or {}).items())
    return write_report(Path(folder) / "report.html", f"Sizing {name or Path(folder).resolve().name}",
                        f"SLA: {terms}", sections)
