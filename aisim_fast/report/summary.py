"""The summary of a replay (``summary.json``): the reference's report keys of an aggregated
or disaggregated run, routing and KV-capacity facts, the prediction's provenance."""

from __future__ import annotations

import numpy as np
import pandas as pd

from aisim_fast.report.metrics import STATUS_COMPLETED, seq_sum, summarize

MS_PER_S = 1000.0


def completed_duration_ms(requests: pd.DataFrame) -> float:
    """``duration_ms`` as ``report.summarize`` defines it (spec replay.md 12.2): the last
    terminal time of the completed, admitted requests, measured from t = 0."""
    in_sample = (np.isfinite(requests["first_admit_ms"].to_numpy(np.float64))
                 & (requests["terminal_status"].to_numpy(object) == STATUS_COMPLETED))
    if not in_sample.any():
        return 0.0
    return max(float(requests["completion_ms"].to_numpy(np.float64)[in_sample].max()), 0.0)


def summarize_aggregated_run(requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                             workers: int, gpus_per_worker: int = 1, sla: dict | None = None,
                             wall_time_ms: float | None = None, cap=None) -> dict:
    """Summary of one aggregated replay, ``requests`` in uuid order.

    Aggregated topologies provision ``workers`` decode-role workers for the whole run
    and no prefill workers (spec replay.md 12.7): decode worker-seconds are
    ``workers * duration_s`` and the prefill side reports 0 seconds and 0 GPUs.
    ``committed_prefill_tokens`` is the prompt work the kernel counted per admission.
    ``cap``: the run's ``replay.CapFacts`` when it had a time cap (spec replay.md
    12.11): worker-seconds then run to its last instant by the cap, and the arrivals
    and committed prefill are the cap's.
    """
    duration_s = completed_duration_ms(requests) / MS_PER_S
    if cap is not None:
        duration_s = cap.last_instant_ms / MS_PER_S
    return summarize(
        requests, token_stat_row, token_hist_row,
        sla=sla or None,
        worker_seconds=(0.0, workers * duration_s),
        gpus_per_worker=(0, gpus_per_worker),
        committed_prefill_tokens=_committed(requests, cap),
        wall_time_ms=wall_time_ms,
        num_requests=None if cap is None else cap.num_requests,
    )


def _committed(requests: pd.DataFrame, cap) -> int:
    return int(requests["committed_prefill_tokens"].sum()) if cap is None else cap.committed_prefill_tokens


def summarize_disaggregated_run(requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                                prefill_workers: int, decode_workers: int, end_ms: float,
                                prefill_gpus_per_worker: int = 1, decode_gpus_per_worker: int = 1,
                                sla: dict | None = None, wall_time_ms: float | None = None,
                                cap=None) -> dict:
    """Summary of one disaggregated replay, ``requests`` in uuid order.

    Each pool is provisioned for the whole virtual run, 0 to ``end_ms`` (the last clock
    advance, which a source release may put after the last token). The prefix-reuse
    ratio counts a request's largest reuse over all its admissions, decode re-admissions
    after a preemption included, while the per-request ``cached_tokens`` is the
    prefill side's (spec replay.md 5.4). ``cap``: as in ``summarize_aggregated_run``
    (``end_ms`` is then the last instant by the cap)."""
    end_s = end_ms / MS_PER_S
    reuse = np.maximum(requests["cached_tokens"].to_numpy(np.int64),
                       requests["decode_cached_tokens"].to_numpy(np.int64, na_value=0))
    return summarize(
        requests.assign(cached_tokens=reuse), token_stat_row, token_hist_row,
        sla=sla or None,
        worker_seconds=(prefill_workers * end_s, decode_workers * end_s),
        gpus_per_worker=(prefill_gpus_per_worker, decode_gpus_per_worker),
        committed_prefill_tokens=_committed(requests, cap),
        wall_time_ms=wall_time_ms,
        num_requests=None if cap is None else cap.num_requests,
    )


def summarize_replay(setup, requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                     end_ms: float, gpus_per_worker: int | None = None,
                     wall_time_ms: float | None = None, cap=None) -> dict:
    """Summary of one replay of ``setup`` (a ``config.ReplaySetup``), ``requests`` in
    uuid order: the aggregated or disaggregated accounting as its topology asks.
    ``gpus_per_worker``: the aggregated pool's (default its tensor parallelism x
    attention-DP ranks, as the reference's ``aic_gpus_per_worker``). ``cap``: the run's
    ``replay.CapFacts`` (``BatchResult.capped``) when it had a time cap."""
    if setup.disaggregated:
        return summarize_disaggregated_run(
            requests, token_stat_row, token_hist_row,
            prefill_workers=setup.prefill_workers, decode_workers=setup.workers, end_ms=end_ms,
            prefill_gpus_per_worker=setup.prefill_gpus_per_worker,
            decode_gpus_per_worker=setup.gpus_per_worker, sla=setup.sla,
            wall_time_ms=wall_time_ms, cap=cap)
    summary = summarize_aggregated_run(
        requests, token_stat_row, token_hist_row, workers=setup.workers,
        gpus_per_worker=setup.gpus_per_worker if gpus_per_worker is None else gpus_per_worker,
        sla=setup.sla, wall_time_ms=wall_time_ms, cap=cap)
    if setup.rank.sglang_host_loop:  # the host loop's stage means beside the others
        summary = dict(sorted({**summary, **host_loop_means(requests)}.items()))
    return summary


def host_loop_means(requests: pd.DataFrame) -> dict:
    """The SGLang host loop's stage means, as the reference reports them (sequential
    sums in uuid order over the requests the loop took in): the frontend (its stages'
    time; 0 without stages), the scheduler's inbox wait (received - ready), receive to
    admission (selected - received), the prefill's forward (prefill complete -
    selected), the observation of its result (first token - prefill complete) and the
    handoff to the first token (0: aggregated ranks only)."""
    received = requests["scheduler_received_ms"].to_numpy(np.float64)
    took = ~np.isnan(received)
    ready = requests["frontend_ready_ms"].to_numpy(np.float64) if "frontend_ready_ms" in requests \
        else requests["arrival_ms"].to_numpy(np.float64)
    arrival = requests["arrival_ms"].to_numpy(np.float64)
    selected = requests["selected_ms"].to_numpy(np.float64)
    complete = requests["prefill_complete_ms"].to_numpy(np.float64)
    first = requests["first_token_ms"].to_numpy(np.float64)

    def mean(values):
        values = values[took]
        return seq_sum(values) / len(values) if len(values) else None
    return {"mean_frontend_ms": mean(ready - arrival),
            "mean_handoff_to_first_token_ms": mean(np.zeros(len(requests))),
            "mean_prefill_elapsed_ms": mean(complete - selected),
            "mean_receive_to_admit_ms": mean(selected - received),
            "mean_result_observation_delay_ms": mean(first - complete),
            "mean_scheduler_inbox_wait_ms": mean(received - ready)}


def prediction_provenance(setup) -> dict:
    """What timed each pool, as the reference's report says it (``prediction_provenance``)."""
    out = {}
    for role, rank in sorted(setup.pools):
        if rank.timing_model == "aic":
            out[role] = {"data_identity": None, "data_version": rank.aic.backend_version,
                         "data_version_unavailable_reason": None, "estimator": "op_level",
                         "timing_source": "aic"}
        else:
            kind = "configured" if rank.timing_model == "fixed" else "built_in"
            out[role] = {"data_version": None,
                         "data_version_unavailable_reason": (f"{kind.replace('_', '-')} timing does "
                                                             "not use performance data"),
                         "estimator": rank.timing_model, "timing_source": kind}
    return out


# The reference's power report (schema 1.0): the GPU power of the active forward passes,
# published only where energy evidence covers at least COVERAGE_GATE of their latency.
# The op-level database this project reads has latencies only, so every op is reported
# as the reference reports an op without energy data, and power is withheld.
POWER_COVERAGE_GATE = 0.9
_POWER_HEAD = {"coverage_gate": POWER_COVERAGE_GATE, "energy_unit": "W-ms", "latency_unit": "ms",
               "power_w_unit": "W", "schema_version": "1.0", "scope": "active_forward_pass_per_gpu"}
_NO_ENERGY = "timing provider returned latency without positive energy evidence"


def power_report(setup, evidence: dict | None) -> dict | None:
    """``power_w``, ``power_coverage`` and ``power_diagnostics`` as the reference reports
    them: unsupported when a pool has no timing provider (polynomial or fixed timing),
    else withheld, with each op's latency (``evidence``: ``aic.op_latency_evidence``
    of the run's passes; None when the passes were not recorded: no report)."""
    if any(rank.aic is None for _, rank in setup.pools):
        return {"power_w": None, "power_coverage": None, "power_diagnostics": {
            **_POWER_HEAD, "phases": [], "power_coverage": None, "power_w": None,
            "publication_status": "unsupported",
            "unavailable_reason": "one or more replay roles have no timing provider"}}
    if evidence is None:
        return None
    phases = []
    for phase in evidence["phases"]:
        ops = [{"covered_latency_ms": 0.0, "latency_ms": op["latency_ms"], "name": op["name"],
                "power_coverage": 0.0, "source": op["source"], "source_kind": "missing",
                "status": "missing", "uncovered_reason": _NO_ENERGY} for op in phase["operations"]]
        sources = {op["source"] for op in ops}
        phases.append({"covered_latency_ms": 0.0, "latency_ms": phase["latency_ms"],
                       "name": phase["name"], "operations": ops, "power_coverage": 0.0,
                       "power_w": None, "publication_status": "withheld",
                       "source": sources.pop() if len(sources) == 1 else "mixed",
                       "source_kind": "missing"})
    return {"power_w": None, "power_coverage": 0.0, "power_diagnostics": {
        **_POWER_HEAD, "covered_latency_ms": 0.0, "latency_ms": evidence["latency_ms"],
        "phases": phases, "power_coverage": 0.0, "power_w": None, "publication_status": "withheld"}}


def routing_summary(routing: pd.DataFrame) -> dict:
    """Routing figures of a kv_router run (flat, so sweeps can keep them as columns):
    decisions (both pools of a disaggregated run), decisions where several workers
    shared the lowest cost, the chosen workers' mean overlap and the mean overlap
    regret (best offered - chosen), blocks, over the overlap-aware decisions (the
    decode pool's router is overlap-blind)."""
    n = len(routing)
    aware = (routing["pool"] != "decode").to_numpy() if n else np.zeros(0, bool)
    chosen = routing["overlap_blocks"].to_numpy(np.float64)[aware]
    best = routing["best_overlap_blocks"].to_numpy(np.float64)[aware]
    return {"routing_decisions": n,
            "routing_tied_decisions": int((routing["tied"].to_numpy() > 1).sum()),
            "routing_mean_overlap_blocks": float(chosen.mean()) if len(chosen) else 0.0,
            "routing_mean_overlap_regret_blocks": float((best - chosen).mean()) if len(chosen) else 0.0}


def kv_capacity(setup) -> dict:
    """Each pool's KV blocks per worker and where the number came from."""
    return {role: {"num_gpu_blocks": rank.num_gpu_blocks, "block_size": rank.block_size,
                   "source": "estimated from model and GPU memory (AIC)"
                   if rank.num_gpu_blocks_estimated else "configured"}
            for role, rank in sorted(setup.pools)}
