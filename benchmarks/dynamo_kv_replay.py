#!/usr/bin/env python3
"""Offline trace replay through Dynamo 1.6.1's KV router: an aggregated pool (``--workers N``) or a
prefill pool and a decode pool (``--prefill-workers`` / ``--decode-workers``).

Not part of the project or its tests: it makes the reference runs of
tests/data/kv_router (see its README), in a virtualenv with ai-dynamo 1.6.1 installed
as ../shared/reference/dynamo/README.md says:

    DYNVENV/bin/python benchmarks/dynamo_kv_replay.py --trace T --out DIR [flags]
    python benchmarks/dynamo_kv_case.py DIR T CASE tests/data/kv_router

Calls dynamo.replay.run_trace_replay with router_mode "kv_router", a KvRouterConfig built from JSON,
and either extra_engine_args / num_workers (aggregated) or prefill_engine_args / decode_engine_args
(engine dicts carrying worker_type "prefill" / "decode") / num_prefill_workers / num_decode_workers.
Writes into DIR:

  payload.json     the exact call (kwargs, router_config JSON, normalized engine args, versions)
  report.json      {"summary": native summary, "coverage": ..., "meta": {...}}
  requests.jsonl   native per-request records, sorted by (arrival, trace line); each record gets one
                   extra key "trace_line" (1-based line of the trace file, matched on arrival/isl/osl)
  decisions.csv    one row per router decision, in decision (log) order:
                   seq, request_uuid, trace_line, pool (aggregated|prefill|decode), worker (index in its pool),
                   dp_rank (its attention-DP rank), logit (= the chosen rank's cost), effective_cached_blocks
  router.log       the router's "Selected worker" log lines (ANSI stripped)

Pool of a disaggregated decision: the log line carries no pool field (worker_type=replay for both).  For vLLM
(source-first handoff) the prefill decision of a request always precedes its decode decision, so the
first line of a uuid is its prefill decision, the second its decode decision.  The script checks this
against prefill_worker_idx / decode_worker_idx of the per-request record and the routing_history
(exits non-zero on any mismatch).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEL = re.compile(r'Selected worker .*?request_id="(?P<rid>[^"]+)" worker_id=(?P<w>\d+) '
                 r'(?:.*?dp_rank=(?P<dp>\d+) )?.*?'
                 r'logit=(?P<logit>[-+\d.eE]+|NaN|inf|-inf) effective_cached_blocks=(?P<ecb>[-+\d.eE]+)')


def trace_index(path, closed_loop=False):
    """Trace lines by the key a record is matched on: (session, turn) for session rows;
    else (arrival relative to the first timestamp, isl, osl), or in a closed loop, where
    a record's arrival is its dispatch, the session Dynamo names the row as
    (``request_<line>``, turn 0)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                rows.append((lineno, json.loads(line)))
    t0 = min(float(r.get("timestamp", 0)) for _, r in rows if r.get("timestamp") is not None)
    idx, turns = {}, {}
    for lineno, r in rows:
        sid = r.get("session_id")
        if sid is not None:  # session rows: keyed by (session_id, turn index in file order)
            k = turns.get(str(sid), 0)
            turns[str(sid)] = k + 1
            idx[("session", str(sid), k)] = [lineno]
            continue
        if closed_loop:
            key = ("session", f"request_{lineno}", 0)
        else:
            key = (float(r.get("timestamp", 0)) - t0, int(r["input_length"]), int(r["output_length"]))
        idx.setdefault(key, []).append(lineno)
    return idx


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=None, help="an aggregated pool of this many workers")
    p.add_argument("--dp-size", type=int, default=1, help="attention-DP ranks of each worker (both pools)")
    p.add_argument("--prefill-dp-size", type=int, default=None, help="the prefill pool's, if other")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--overlap-score-credit", type=float, default=1.0)
    p.add_argument("--prefill-load-scale", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prefill-load-model", choices=["none", "aic"], default="none")
    p.add_argument("--router-json", default=None, help="extra KvRouterConfig fields (JSON object)")
    p.add_argument("--engine-json", default=None, help="extra engine fields for both pools (JSON object)")
    p.add_argument("--num-gpu-blocks", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--trace-block-size", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--kv-event-lag-ms", type=float, default=None)
    a = p.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = {"backend": "vllm", "block_size": a.block_size, "num_gpu_blocks": a.num_gpu_blocks,
              "max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
              "enable_chunked_prefill": True, "preemption_mode": "lifo",
              "timing_model": {"type": "polynomial"}}
    if a.engine_json:
        engine.update(json.loads(a.engine_json))
    aggregated = a.workers is not None
    prefill_dp = a.dp_size if a.prefill_dp_size is None else a.prefill_dp_size
    prefill_args = {"engine": dict(engine, worker_type="prefill"), "dp_size": prefill_dp}
    decode_args = {"engine": dict(engine, worker_type="decode"), "dp_size": a.dp_size}
    engine_args = {"engine": engine, "dp_size": a.dp_size}
    router_json = {"overlap_score_credit": a.overlap_score_credit,
                   "prefill_load_scale": a.prefill_load_scale,
                   "router_temperature": a.temperature,
                   "router_prefill_load_model": a.prefill_load_model}
    if a.router_json:
        router_json.update(json.loads(a.router_json))

    log_tmp = tempfile.NamedTemporaryFile(prefix="dynlog", suffix=".log", delete=False, dir=str(out))
    saved = os.dup(2)
    os.dup2(log_tmp.fileno(), 2)
    try:
        from dynamo._core import _normalize_mocker_config
        from dynamo.llm import KvRouterConfig
        from dynamo.replay import run_trace_replay
        if aggregated:
            normalized = {"normalized_engine_args": _normalize_mocker_config(engine_args)}
            kwargs = dict(extra_engine_args=engine_args, num_workers=a.workers)
        else:
            normalized = {"normalized_prefill_engine_args": _normalize_mocker_config(prefill_args),
                          "normalized_decode_engine_args": _normalize_mocker_config(decode_args)}
            kwargs = dict(prefill_engine_args=prefill_args, decode_engine_args=decode_args,
                          num_prefill_workers=a.prefill_workers, num_decode_workers=a.decode_workers)
        kwargs.update(replay_concurrency=a.concurrency, router_mode="kv_router", trace_format="mooncake",
                      trace_block_size=a.trace_block_size, capture_per_request=True,
                      kv_event_lag_ms=a.kv_event_lag_ms)
        # the call first: it is there even when the run stops (a dead end raises)
        import importlib.metadata as md
        payload = {"api": "dynamo.replay.run_trace_replay", "trace_files": [a.trace], "kwargs": kwargs,
                   "router_config_json": router_json,
                   **normalized,
                   "versions": {n: md.version(n) for n in ("ai-dynamo", "ai-dynamo-runtime")}}
        (out / "payload.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        w0 = time.perf_counter()
        report = run_trace_replay([a.trace], router_config=KvRouterConfig.from_json(json.dumps(router_json)),
                                  **kwargs)
        w1 = time.perf_counter()
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log_tmp.close()
    raw = ANSI.sub("", Path(log_tmp.name).read_text(errors="replace"))
    os.unlink(log_tmp.name)
    sel_lines = [l for l in raw.splitlines() if "Selected worker" in l]
    other = [l for l in raw.splitlines() if l.strip() and "Selected worker" not in l
             and "VllmKvManager initialized" not in l]
    (out / "router.log").write_text("\n".join(sel_lines) + "\n")


    # per-request records
    closed_loop = a.concurrency is not None
    tidx = trace_index(a.trace, closed_loop)
    recs = list(report.per_request or [])
    used = set()
    # records of one instant in the order the router decided them (the order the rows
    # were dispatched in)
    decided = {}
    for line in sel_lines:
        m = SEL.search(line)
        if m:
            decided.setdefault(m["rid"], len(decided))
    for r in sorted(recs, key=lambda r: (r["arrival_time_ms"], decided.get(r["uuid"], len(decided)))):
        if r.get("session_id") is not None and r.get("turn_index") is not None:
            key = ("session", str(r["session_id"]), int(r["turn_index"]))
        else:
            key = (float(r["arrival_time_ms"]), int(r["input_length"]), int(r["requested_output_length"]))
        cands = [c for c in tidx.get(key, []) if c not in used]
        r["trace_line"] = cands[0] if cands else None
        if cands:
            used.add(cands[0])
    recs.sort(key=lambda r: (r["arrival_time_ms"], r["trace_line"] if r["trace_line"] is not None else 1e18))
    with open(out / "requests.jsonl", "w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    by_uuid = {r["uuid"]: r for r in recs}

    # decisions
    seen = {}
    rows, problems = [], []
    for i, line in enumerate(sel_lines):
        m = SEL.search(line)
        if not m:
            problems.append(f"unparsed line {i}: {line[:200]}")
            continue
        rid = m["rid"]
        k = seen.get(rid, 0)
        seen[rid] = k + 1
        pools = ("aggregated",) if aggregated else ("prefill", "decode")
        pool = pools[k] if k < len(pools) else f"extra{k}"
        w = int(m["w"])
        dp_rank = int(m["dp"] or 0)
        dp = prefill_dp if pool == "prefill" else a.dp_size
        rec = by_uuid.get(rid)
        if rec is None:
            problems.append(f"decision for unknown uuid {rid}")
        else:
            # the records name the rank by its scheduler id (worker x dp_size + dp_rank)
            want = rec.get("prefill_worker_idx") if pool == "prefill" else rec.get("decode_worker_idx")
            record_pool = "agg" if pool == "aggregated" else pool  # the records' name for it
            hist = [h for h in (rec.get("routing_history") or []) if h.get("pool") == record_pool]
            if want != w * dp + dp_rank or not hist or hist[0].get("logical_worker_id") != w \
                    or hist[0].get("dp_rank", 0) != dp_rank:
                problems.append(f"{rid} {pool}: log worker {w} rank {dp_rank} vs record {want} / "
                                f"history {hist[:1]}")
        rows.append({"seq": len(rows), "request_uuid": rid, "trace_line": rec.get("trace_line") if rec else None,
                     "pool": pool, "worker": w, "dp_rank": dp_rank, "logit": m["logit"],
                     "effective_cached_blocks": m["ecb"]})
    with open(out / "decisions.csv", "w", newline="", encoding="utf-8") as fh:
        wr = csv.DictWriter(fh, fieldnames=["seq", "request_uuid", "trace_line", "pool", "worker", "dp_rank",
                                            "logit", "effective_cached_blocks"])
        wr.writeheader()
        wr.writerows(rows)
    per_request = 1 if aggregated else 2
    missing = [u for u in by_uuid if seen.get(u, 0) != per_request]
    if missing:
        problems.append(f"{len(missing)} requests without exactly {per_request} decisions")

    summary = dict(report.summary)
    meta = {"native_wall_s": w1 - w0, "records": len(recs), "decisions": len(rows),
            "decisions_aggregated": sum(r["pool"] == "aggregated" for r in rows),
            "decisions_prefill": sum(r["pool"] == "prefill" for r in rows),
            "decisions_decode": sum(r["pool"] == "decode" for r in rows),
            "records_without_trace_line": sum(r["trace_line"] is None for r in recs),
            "pool_match_problems": problems[:50], "other_log_lines": other[:50]}
    (out / "report.json").write_text(json.dumps({"summary": summary, "coverage": report.coverage, "meta": meta},
                                                indent=1, default=str) + "\n")
    keys = ("num_requests", "completed_requests", "mean_ttft_ms", "p99_ttft_ms", "prefix_cache_reused_ratio")
    print(json.dumps({"out": str(out), **{k: summary.get(k) for k in keys},
                      **{k: meta[k] for k in ("records", "decisions", "decisions_aggregated", "decisions_prefill",
                                              "decisions_decode",
                                              "records_without_trace_line")},
                      "problems": len(problems), "other_log_lines": len(other)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
