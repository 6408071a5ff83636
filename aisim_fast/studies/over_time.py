"""Sizing over time: the fewest GPUs that meet the SLA in each time window of a trace
(replicas(t)), its peak and mean, and the GPU-hours a perfect autoscaler would spend
against a fleet held at the peak.

The trace is cut into windows of ``window_s`` simulated seconds by session start (a
session, every row sharing a ``session_id``, stays whole in the window it starts in);
each window's requests, their arrival times shifted to the window's start, are sized
on their own with ``sizing.size``. Each window therefore starts cold -- an empty KV
cache and no requests carried over from the window before -- and a request that runs
past its window's end counts only in its own window: replicas(t) is the fleet a
scaler that reacts instantly and whose new replicas start warm would need, a lower
bound for a real autoscaler. Beyond the reference (it sizes one load at a time).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from aisim_fast.config.payload import parse_payload, read_payload_file
from aisim_fast.studies.sizing import SizingAnswer, size
from aisim_fast.studies.sweeps import SweepError
from aisim_fast.trace.workload import load_mooncake

MS_PER_S = 1000.0
S_PER_HOUR = 3600.0


@dataclass(frozen=True)
class OverTime:
    windows: pd.DataFrame        # one row per window: start_s, end_s, requests, feasible, gpus, ...
    answers: list                # the SizingAnswer of each window with requests (None: empty window)
    window_s: float

    @property
    def feasible(self) -> bool:
        return bool(self.windows["feasible"].all())

    def totals(self) -> dict:
        """Peak and time-weighted mean GPUs, the GPU-hours of a perfect autoscaler and of
        a fleet held at the peak over the same span."""
        w = self.windows
        span_h = len(w) * self.window_s / S_PER_HOUR
        peak = int(w["gpus"].max()) if self.feasible else None
        autoscaled = float((w["gpus"] * self.window_s / S_PER_HOUR).sum()) if self.feasible else None
        out = {"window_s": self.window_s, "windows": int(len(w)), "span_hours": span_h,
               "peak_gpus": peak, "mean_gpus": float(w["gpus"].mean()) if self.feasible else None,
               "autoscaled_gpu_hours": autoscaled,
               "static_gpu_hours": peak * span_h if peak is not None else None,
               "infeasible_windows": [int(i) for i in w.index[~w["feasible"]]]}
        if peak:
            out["autoscaling_saves"] = 1.0 - autoscaled / (peak * span_h)
        return out


def _sessions(path: Path) -> list[tuple[float, list[dict]]]:
    """The trace's sessions in file order of their first row: (start timestamp ms, rows)."""
    sessions: dict = {}
    order = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            key = row.get("session_id", f"\0line{line_no}")
            if key not in sessions:
                sessions[key] = []
                order.append(key)
            sessions[key].append(row)
    return [(float(sessions[k][0].get("timestamp", 0.0)), sessions[k]) for k in order]


def window_traces(trace: str | Path, window_ms: float, folder: Path) -> list[tuple[int, float, Path | None, int]]:
    """Cut ``trace`` (trace-time ms windows) into per-window trace files in ``folder``:
    [(window index, start ms, file or None when empty, requests)]."""
    sessions = _sessions(Path(trace))
    if not sessions:
        raise SweepError(f"{trace}: the trace has no request to size")
    last = max(start for start, _ in sessions)
    count = int(last // window_ms) + 1
    buckets: list[list] = [[] for _ in range(count)]
    for start, rows in sessions:
        buckets[int(start // window_ms)].append((start, rows))
    out = []
    for index, bucket in enumerate(buckets):
        window_start = index * window_ms
        if not bucket:
            out.append((index, window_start, None, 0))
            continue
        path = folder / f"window-{index:05d}.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            for start, rows in bucket:
                for turn, row in enumerate(rows):
                    if turn == 0 and "timestamp" in row:
                        row = {**row, "timestamp": row["timestamp"] - window_start}
                    handle.write(json.dumps(row) + "\n")
        out.append((index, window_start, path, sum(len(rows) for _, rows in bucket)))
    return out


def size_over_time(payload: dict | str | Path, sla, *, window_s: float, base_dir=None,
                   trace: str | None = None, rate: float | None = None, say=None,
                   **size_options) -> OverTime:
    """replicas(t) of ``payload`` under ``sla`` for its trace (or ``trace``) in windows
    of ``window_s`` simulated seconds at ``rate`` (None: the payload's arrival ratio);
    ``size_options`` as ``sizing.size`` takes them."""
    if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
        raise SweepError(f"window_s: must be a number of seconds > 0, got {window_s!r}")
    if isinstance(payload, (str, Path)):
        path = Path(payload)
        payload = read_payload_file(path)
        base_dir = base_dir or path.resolve().parent
    base_dir = str(Path(base_dir or ".").resolve())
    setup = parse_payload(payload, base_dir, str(Path(trace).resolve()) if trace else None)
    if not setup.from_trace_file:
        raise SweepError("window_s: sizes a trace over time; the payload's requests are inline or synthetic")
    if setup.trace_format not in ("mooncake", "mooncake-delta"):
        raise SweepError(f"window_s: cuts Mooncake traces (mooncake, mooncake-delta) into windows; this one is "
                         f"{setup.trace_format}")
    ratio = float(rate) if rate is not None else float(setup.arrival_speedup_ratio)
    # the loader checks every row (an error names file and line) before any cutting
    load_mooncake(setup.trace_path, trace_block_size=setup.trace_block_size, arrival_speedup_ratio=ratio)
    say = say or (lambda line: None)
    rows, answers = [], []
    with tempfile.TemporaryDirectory(prefix="aisim_fast_windows_") as folder:
        windows = window_traces(setup.trace_path, window_s * MS_PER_S * ratio, Path(folder))
        for index, start_ms, path, requests in windows:
            start_s = start_ms / ratio / MS_PER_S
            row = {"window": index, "start_s": start_s, "end_s": start_s + window_s, "requests": requests}
            if path is None:
                rows.append({**row, "feasible": True, "gpus": 0, "cost_per_hour_usd": 0.0, "deployment": "{}"})
                answers.append(None)
                continue
            say(f"window {index + 1}/{len(windows)} ({start_s:,.0f}-{start_s + window_s:,.0f} s, "
                f"{requests} requests)")
            [answer] = size(payload, sla, base_dir=base_dir, trace=os.fspath(path), rates=(ratio,),
                            **size_options)
            answers.append(answer)
            rows.append({**row, **_window_answer(answer)})
    return OverTime(pd.DataFrame(rows), answers, float(window_s))


def _window_answer(answer: SizingAnswer) -> dict:
    if not answer.feasible:
        return {"feasible": False, "gpus": math.nan, "cost_per_hour_usd": math.nan, "deployment": "{}"}
    best = answer.evidence[answer.evidence["feasible"]].iloc[0]
    cost = best.get("cost_per_hour_usd", math.nan)
    return {"feasible": True, "gpus": int(answer.gpus), "cost_per_hour_usd": float(cost),
            "deployment": json.dumps({k.split(".")[-2] if k.startswith("spec.") else k.split(".", 1)[-1]: v
                                      for k, v in answer.deployment.items()}, default=str)}


def format_over_time(result: OverTime, sla_text: str) -> str:
    t = result.totals()
    lines = [f"GPUs over time (windows of {result.window_s:g} s) meeting {sla_text}:"]
    shown = result.windows[["window", "start_s", "end_s", "requests", "feasible", "gpus", "deployment"]]
    lines.append(shown.to_string(index=False, float_format=lambda v: f"{v:,.0f}"))
    if result.feasible:
        lines.append(f"peak {t['peak_gpus']} GPUs, mean {t['mean_gpus']:.2f}; a perfect autoscaler spends "
                     f"{t['autoscaled_gpu_hours']:.3f} GPU-hours against {t['static_gpu_hours']:.3f} at the "
                     f"peak ({t['autoscaling_saves']:.0%} less)")
    else:
        lines.append(f"no candidate within the budget meets the SLA in window(s) "
                     f"{', '.join(map(str, t['infeasible_windows']))}")
    return "\n".join(lines)


def plot_over_time(result: OverTime, path: Path, title: str) -> Path:
    """replicas(t) as a step line, the requests per window as bars behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = result.windows
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.twinx()
    bars.bar(w["start_s"], w["requests"], width=result.window_s, align="edge", color="0.85",
             label="requests arriving")
    bars.set_ylabel("requests per window")
    ax.set_zorder(bars.get_zorder() + 1)
    ax.patch.set_visible(False)
    edges = list(w["start_s"]) + [float(w["end_s"].iloc[-1])]
    gpus = list(w["gpus"]) + [w["gpus"].iloc[-1]]
    ax.step(edges, gpus, where="post", color="C0", linewidth=2, label="GPUs needed (replicas(t))")
    if result.feasible:
        peak = result.totals()["peak_gpus"]
        ax.axhline(peak, color="C3", linestyle="--", linewidth=1, label=f"static fleet at the peak ({peak})")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("GPUs")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
