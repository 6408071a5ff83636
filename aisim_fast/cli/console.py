"""What the command line prints: the summary table, one-line errors and warnings, why
requests were rejected."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np

from aisim_fast.cli.parser import EXIT_USER_ERROR, PROG
from aisim_fast.config.payload import ConfigWarning, ReplaySetup
from aisim_fast.trace.workload import TraceWarning

MS_PER_S = 1000.0


def with_rank(parts):
    """Pass-log parts (Arrow tables) with the attention-DP ``rank`` right after
    ``worker``, as ForwardPassMetrics name them."""
    for part in parts:
        names = [c for c in part.column_names if c != "rank"]
        names.insert(names.index("worker") + 1, "rank")
        yield part.select(names)


def pressure_counts(setup: ReplaySetup, requests) -> dict:
    """The run's pressure actions by kind (the reference's ``vllm_preemptions_total`` /
    ``sglang_retractions_total``): every preemption of every request, both pools of a
    disaggregated run (one backend there)."""
    total = int(requests["preemptions"].sum())
    sglang = setup.rank.backend == "sglang"
    return {"vllm_preemptions_total": 0 if sglang else total,
            "sglang_retractions_total": total if sglang else 0}


def rejection_causes(setup: ReplaySetup, requests) -> dict:
    """Rejected requests by cause: ``max_model_len`` (prompt at or over the limit) and
    ``kv_pool`` (a prompt the pool of its first rank can never hold)."""
    status = requests["terminal_status"].to_numpy(object)
    prompt = requests["input_tokens"].to_numpy(np.int64)
    rejected = status == "rejected"
    limit = setup.rank.max_model_len
    too_long = rejected & (prompt >= limit) if limit is not None else np.zeros(len(status), bool)
    return {"max_model_len": int(too_long.sum()), "kv_pool": int((rejected & ~too_long).sum())}


def describe_rejections(setup: ReplaySetup, causes: dict) -> list[str]:
    rank = setup.prefill_rank if setup.disaggregated else setup.rank
    out = []
    if causes["max_model_len"]:
        out.append(f"{causes['max_model_len']} with a prompt of max_model_len "
                   f"({setup.rank.max_model_len}) tokens or more")
    if causes["kv_pool"]:
        out.append(f"{causes['kv_pool']} that do not fit the KV pool ({rank.num_gpu_blocks} blocks x "
                   f"{rank.block_size} tokens); raise num_gpu_blocks")
    return out


def nothing_completed(setup: ReplaySetup, requests) -> str:
    """Why a run completed no request: the rejections by cause (nothing is written, and
    the summary's latencies would only be the reference's 0.0 of an empty sample)."""
    status = requests["terminal_status"].to_numpy(object)
    rejected = status == "rejected"
    causes = describe_rejections(setup, rejection_causes(setup, requests))
    others = int((~rejected).sum())
    if others:
        causes.append(f"{others} ended otherwise ({', '.join(sorted(set(status[~rejected]) - {''}) or ['unfinished'])})")
    return f"no request completed: of {len(status)}, " + "; ".join(causes)


# ---------------------------------------------------------------------------------------
# printing


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:,.{digits}f}"


def format_summary(setup: ReplaySetup, summary: dict, requests, written: dict,
                   compile_ms: float) -> str:
    status = requests["terminal_status"].to_numpy(object)
    rejected = int((status == "rejected").sum())
    wall_s = summary["wall_time_ms"] / MS_PER_S
    simulated_rps = summary["num_requests"] / wall_s if wall_s > 0 else math.inf
    pools = (f"{setup.prefill_workers} prefill + {setup.workers} decode" if setup.disaggregated
             else f"{setup.workers}")
    dp = ""  # attention-DP ranks per worker, when some pool has several
    if setup.disaggregated and max(setup.prefill_dp_size, setup.dp_size) > 1:
        dp = f", attention DP {setup.prefill_dp_size} / {setup.dp_size} ranks per prefill / decode worker"
    elif not setup.disaggregated and setup.dp_size > 1:
        dp = f", attention DP {setup.dp_size} ranks per worker"
    lines = [
        f"replay: {Path(setup.trace_path).name if setup.from_trace_file else 'inline requests' if setup.requests is not None else 'a synthetic ' + setup.synthetic.load_type + ' load'} "
        f"on {pools} {setup.rank.backend} "
        f"worker(s)" + dp + (f", closed loop {setup.concurrency}" if setup.concurrency else ""),
        f"  requests            {summary['num_requests']} arrived, "
        f"{summary['completed_requests']} completed, {rejected} rejected"
        + ("" if setup.max_sim_time_ms is None else
           f", {summary['num_requests'] - len(requests)} unfinished at the "
           f"{_fmt(setup.max_sim_time_ms)} ms cap"),
        *(["  rejected            " + "; ".join(describe_rejections(
            setup, summary.get("rejected_by_cause") or rejection_causes(setup, requests)))]
          if rejected else []),
        f"  duration            {_fmt(summary['duration_ms'])} ms",
        f"  throughput          {_fmt(summary['request_throughput_rps'])} req/s, "
        f"{_fmt(summary['output_throughput_tok_s'], 1)} output tok/s, "
        f"{_fmt(summary['total_throughput_tok_s'], 1)} total tok/s",
        f"  {'latency (ms)':<18}{'mean':>12}{'p50':>12}{'p99':>12}",
    ]
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_latency_ms"),
                       ("ITL", "itl_ms")):
        lines.append(f"  {label:<18}{_fmt(summary['mean_' + key]):>12}"
                     f"{_fmt(summary['median_' + key]):>12}{_fmt(summary['p99_' + key]):>12}")
    if "total_trajectories" in summary:  # an agentic run (report.agentic)
        lines.append(f"  {'trajectory E2E':<18}{_fmt(summary['mean_trajectory_e2e_latency_ms']):>12}"
                     f"{_fmt(summary['median_trajectory_e2e_latency_ms']):>12}"
                     f"{_fmt(summary['p99_trajectory_e2e_latency_ms']):>12}")
        lines.append(f"  trajectories        {summary['completed_trajectories']} of {summary['total_trajectories']} "
                     "plays completed")
    lines += [
        *(_sla_lines(summary) if "sla_verdict" in summary else []),
        f"  prefix reuse        {100.0 * summary['prefix_cache_reused_ratio']:.2f} % of input tokens",
        *([f"  KV pressure         {summary['vllm_preemptions_total']} preemptions"]
          if summary.get("vllm_preemptions_total") else []),
        *([f"  KV pressure         {summary['sglang_retractions_total']} retractions"]
          if summary.get("sglang_retractions_total") else []),
        f"  wall time           {_fmt(summary['wall_time_ms'], 1)} ms "
        f"(kernels + driver; JIT compile / cache load {_fmt(compile_ms / MS_PER_S, 1)} s not counted)",
        f"  simulated speed     {_fmt(simulated_rps, 0)} requests per wall second",
        "wrote:",
    ]
    lines += [f"  {path}" for path in written.values()]
    return "\n".join(lines)


def _sla_lines(summary: dict) -> list[str]:
    verdict = summary["sla_verdict"]
    terms = ",".join(f"{k}={v:g}" if not isinstance(v, bool) else f"{k}={str(v).lower()}"
                     for k, v in verdict["terms"].items())
    lines = [f"  SLA                 {'met' if verdict['ok'] else 'missed'}: {terms}"
             + ("" if verdict["ok"] else f" ({verdict['reason']})")]
    if "goodput_completed_requests" in summary:
        lines.append(f"  goodput             {summary['goodput_completed_requests']} good requests, "
                     f"{_fmt(summary['goodput_request_throughput_rps'])} req/s, "
                     f"{_fmt(summary['goodput_output_throughput_tok_s'], 1)} output tok/s")
    return lines


# ---------------------------------------------------------------------------------------
# entry point


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def show_warning(message, category, filename, lineno, file=None, line=None):
    """Trace and config warnings as one line each (``aisim-fast: warning: FILE:LINE: ...``,
    ``aisim-fast: warning: FIELD: ...``)."""
    if issubclass(category, (TraceWarning, ConfigWarning)):
        print(f"{PROG}: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
