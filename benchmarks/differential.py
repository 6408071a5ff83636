"""Differential comparison with the reference on random configurations (outside CI).

For each case: a random slice of a bundled Mooncake trace (optionally made
multi-turn), a random vLLM / TRT-LLM configuration (tight pools, small
``max_num_seqs``, no chunked prefill, closed loop, disaggregated P/D), run by the
reference (``../shared/reference/ref_replay.py`` in its own virtualenv, which also
dumps the exact payload it ran) and by aisim_fast on that same payload. Per-request
rows are compared on every column the reference writes (``parity_rules.row_differences``:
times within 1e-6, counts and workers exact, empty only against null). Every divergent case is
kept as a golden (payload, trace, reference CSV, both outcomes) under ``--keep``.

    python benchmarks/differential.py --ref-python /tmp/refvenv/bin/python --cases 300 \\
        --keep tests/data/differential

With ``--kv-artifacts`` every case is one aggregated worker (the only shape the
reference's per-token artifacts cover; vLLM / TRT-LLM, and SGLang with
``--sglang-fraction``) and its KV event stream and output token ids are compared too,
exactly (``tests/support/kv_artifacts.py``).

With ``--dp-fraction F`` that share of the aggregated cases runs with attention DP
(``spec.engine.dp_size`` 2 or 3, drawn from a generator of its own so the other
draws of a seed stay as they were): the reference reruns the dumped payload with it
(``benchmarks/ref_payload_run.py``), and its per-request worker, the rank's scheduler
id, is compared with ``worker * dp_size + dp_rank``. Half the vLLM ones also take a
``prefill_schedule_interval`` of 2, 3, 4 or 8 (the cadence). Disaggregated cases draw
(prefill, decode) ``dp_size`` from (1, 2), (2, 1), (2, 2), (2, 3), and half the vLLM
ones the cadence in both pools.

With ``--cap-fraction F`` that share of the cases runs with a time cap
(``spec.max_sim_time_ms``) drawn uniformly over the trace's span, from a generator
of its own, now and then exactly at one of its arrivals: the reference reruns the
payload with it, and besides the rows of the requests terminal by the cap, the
summary is compared with the reference's report on every key (arrivals by the cap,
worker-seconds to its last instant, committed prefill, token statistics).

With ``--hostloop-fraction F`` that share of the aggregated SGLang cases (one rank per
worker) runs with SGLang's host loop, half of them with frontend stages ahead of it
(one to three stages of one to three workers, service times from 0 to 120 ms, a drawn
``concurrency_scale`` now and then).

With ``--speculation-fraction F`` that share of the cases without attention DP or
SGLang's host loop speculates (vLLM, TRT-LLM, SGLang): every pool's rank gets ``aic_nextn`` 1..5, its conditional
acceptance rates drawn (uniform, 0 or 1 now and then, sometimes fewer than the drafts or
left to the defaults) and now and then an ``aic_mtp_seed``.

With ``--cli-fraction F`` that share of the cases runs a payload as the reference's
own CLI writes it (a template of ``tests/data/golden_cli``: op-level timing of
Qwen3-32B at tp 1 and 2, on h200 and b200, homogeneous and heterogeneous
disaggregation, polynomial timing with a memory fraction) on the case's trace, with a
drawn memory fraction, CUDA-graph reserve, ``num_gpu_blocks_is_explicit: false`` (the
blocks sized from memory on both sides), ``max_num_seqs`` and worker count.

With ``--predict-fraction F`` that share of the cases is a random reference ``predict``
config (YAML: backend, topology and hardware, timing model, KV capacity by blocks or
memory fraction with a CUDA-graph reserve, scheduler sizes, load, time cap, SLA, a
tokenization pool): the
reference's CLI lowers and runs it (``cli-payloads/capture.py``), aisim_fast's
``--predict-config`` lowering must write the same payload, and its run must match the
reference's rerun of that payload request for request.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from aisim_fast.config.payload import parse_payload  # noqa: E402
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup  # noqa: E402
from aisim_fast.io.request_order import requests_in_uuid_order
from aisim_fast.report.summary import summarize_replay  # noqa: E402
from support.kv_artifacts import kv_event_rows, reference_kv_events, reference_tokens, token_rows  # noqa: E402
from support.parity_rules import as_key_part, row_differences, same_stop, workers_as_scheduler_ids  # noqa: E402

REF_DIR = ROOT.parent / "shared" / "reference"
TRACE = REF_DIR / "traces" / "mooncake_1k.jsonl"


def summary_differences(setup, sim, res, report_path: Path) -> list[tuple]:
    """Keys of the run's summary that differ from the reference's report (1e-9 rel)."""
    import math

    from support.cli_runs import NOT_COMPARED

    requests = requests_in_uuid_order(res.requests[0], sim.workload.session, sim.workload.turn_index)
    summary = summarize_replay(setup, requests, res.token_stat[0], res.token_hist[0],
                               end_ms=float(res.end_ms[0]), cap=res.capped[0])
    bad = []
    report = json.loads(report_path.read_text())
    for key, want in report.items():
        if key in NOT_COMPARED:
            continue
        got = summary.get(key)
        # a standard deviation of equal values is rounding noise (1e-15 of the mean),
        # which summation order changes: compared at the mean's scale
        scale = abs(report.get("mean_" + key[4:]) or 0.0) if key.startswith("std_") else 0.0
        same = (math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9 * scale)
                if isinstance(want, (int, float)) and not isinstance(want, bool) and got is not None
                else got == want)
        if not same:
            bad.append((f"summary {key}", got, want))
    return bad


def random_trace(rng: random.Random, path: Path, rows_range: tuple[int, int] = (8, 60)) -> None:
    """A slice of ``rows_range`` rows of the bundled trace, at its rate or slowed, its
    output lengths clipped; a quarter of the time made multi-turn (six sessions)."""
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    start = rng.randrange(0, len(rows) - rows_range[1])
    n = rng.randint(*rows_range)
    picked = rows[start:start + n]
    t0 = picked[0]["timestamp"]
    scale = rng.choice([1.0, 1.0, 0.2, 0.05])
    sessions = rng.random() < 0.25
    with path.open("w") as fh:
        for i, row in enumerate(picked):
            row = dict(row, timestamp=int((row["timestamp"] - t0) * scale))
            row["output_length"] = max(1, min(row["output_length"], rng.choice([8, 32, 128, 400])))
            if sessions:
                row["session_id"] = f"s{i % 6}"
                if i >= 6:
                    row.pop("timestamp")
                    row["delay"] = rng.choice([0, 50, 500])
            fh.write(json.dumps(row) + "\n")


def random_traffic_edits(rng: random.Random, trace: Path) -> tuple[str, list[str]]:
    """(kind, ``dotted.path=JSON`` edits) replacing a case's traffic: its trace read as
    ``mooncake-delta`` (later turns' rows then carry new input only), written as Dynamo
    request records in two files, random tool-calling agents (``applied_compute_agentic``
    under a closed loop), or a synthetic
    load (concurrency, constant rate, seeded poisson, a fraction of the KV pool), as
    single requests or sessions (prefix groups, think times), stopped by a count or
    per unit of load."""
    pick = rng.random()
    if pick < 0.25:
        return "delta", ['traffic.trace_format="mooncake-delta"']
    if pick < 0.4:
        # the trace's rows as Dynamo request records (shuffled, in two files, one gzip)
        rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
        records = []
        t0 = 1_700_000_000_000
        for i, row in enumerate(rows):
            received = t0 + int(row.get("timestamp", 0) if "session_id" not in row else i * 37)
            records.append({"schema": "dynamo.request.trace.v1", "event_type": "request_end",
                            "event_time_unix_ms": received + 500,
                            "request": {"request_id": f"q{i}", "output_tokens": row["output_length"],
                                        "request_received_ms": received, "total_time_ms": 500.0,
                                        "replay": {"trace_block_size": 512, "input_length": row["input_length"],
                                                   "input_sequence_hashes": row["hash_ids"]}}})
        rng.shuffle(records)
        half = len(records) // 2
        first, second = trace.with_name("dynamo_a.jsonl"), trace.with_name("dynamo_b.jsonl.gz")
        first.write_text("".join(json.dumps(r) + "\n" for r in records[:half]))
        import gzip
        second.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records[half:]).encode()))
        return "dynamo", [f'traffic.trace_format="dynamo"', f'traffic.trace_paths=["{first}", "{second}"]',
                          f'traffic.trace_path="{first}"', "traffic.trace_block_size=512"]
    if pick < 0.55:
        # tool-calling agents under a closed loop
        path = trace.with_name("applied.jsonl")
        with path.open("w") as fh:
            for _ in range(rng.randint(3, 25)):
                n = rng.choice([0, 1, 2, 4])
                fh.write(json.dumps({"num_turns": n, "input_prompt_length": rng.choice([100, 700, 3000]),
                                     "assistant_response_length": [rng.randint(1, 150) for _ in range(n)],
                                     "tool_call_output_length": [rng.randint(0, 900) for _ in range(n)],
                                     "tool_call_latency": [round(rng.uniform(0, 1.5), 3) for _ in range(n)],
                                     "final_assistant_response_length": rng.randint(0, 200)}) + "\n")
        return "applied", ['traffic.trace_format="applied_compute_agentic"', f'traffic.trace_path="{path}"',
                           f'traffic.trace_paths=["{path}"]', f"traffic.trace_block_size={rng.choice([16, 64, 512])}",
                           'traffic.load_type="concurrency"', f"traffic.replay_concurrency={rng.choice([1, 3, 8])}",
                           "spec.max_in_flight=null"]
    traffic: dict = {"source_type": "synthetic", "isl": rng.choice([40, 300, 1500]),
                     "osl": rng.choice([1, 12, 150]), "trace_block_size": 512}
    if rng.random() < 0.5:
        traffic.update(source_type="synthetic-session", turns_per_session=rng.choice([2, 3, 5]),
                       inter_turn_delay_ms=rng.choice([0.0, 5.0, 300.0]))
        if rng.random() < 0.7:
            traffic.update(shared_prefix_ratio=rng.choice([0.3, 0.5, 1.0]), num_prefix_groups=rng.choice([1, 3, 9]))
    elif rng.random() < 0.4:
        traffic["cached_prefix_tokens"] = rng.randrange(0, traffic["isl"] + 1)
    load = rng.choice(["concurrency", "constant_rate", "poisson", "kv_capacity_fraction"])
    traffic["load_type"] = load
    if load == "concurrency":
        traffic["concurrency"] = rng.choice([1, 4, 16])
    elif load == "kv_capacity_fraction":
        traffic["kv_load_ratio"] = rng.choice([0.05, 0.3, 0.9, 2.0])
    elif load == "constant_rate":
        traffic["arrival_interval_ms"] = rng.choice([5.0, 50.0, 400.0])
    else:
        traffic.update(request_rate=rng.choice([2.0, 20.0, 200.0]), arrival_seed=rng.randrange(0, 100))
    if rng.random() < 0.3:
        traffic["num_request_ratio"] = rng.choice([0.5, 1.5, 2.5])
    else:
        traffic["request_count"] = rng.choice([5, 20, 60])
    return traffic["source_type"] + "/" + load, ["traffic=" + json.dumps(traffic), "spec.max_in_flight=null"]


def random_agentic_trace(rng: random.Random, path: Path) -> list[str]:
    """A random agentic trace at ``path`` and the traffic edits that replay it: plays of
    1-12 requests, each after one or two earlier ones of its play (completion triggers,
    spawns on dispatch now and then, delays 0-300 ms), roots and some dependents with a
    ``not_before_ms``, prompts growing on a play's shared prefix (some hash ids shared
    across plays), now and then authored output ids, a prompt too long for any pool (a
    rejection fails its play) and a zero-token output; request ids drawn so node order is
    not file order. A third are legacy rows (``wait_for``, ``tool_wait_ms``), a fifth of the
    rest Weka corpora (``random_weka_corpus``), a quarter of the others Dynamo request
    records with ``agent_context`` (``random_dynamo_agentic``).
    Lanes (1-3 or none) and a speed-up drawn; with lanes, now and then a seeded
    ``agentic_snapshot``."""
    legacy = rng.random() < 0.3
    block = rng.choice([16, 64, 512])
    if not legacy and rng.random() < 0.2:
        path = path.with_suffix(".jsonl")
        relative = random_weka_corpus(rng, path, block)
        traffic = {"source_type": "trace", "load_type": "trace_timestamps", "trace_path": str(path),
                   "trace_paths": [str(path)], "trace_format": "weka",
                   "arrival_speedup_ratio": rng.choice([1.0, 1.0, 2.0, 0.5]), "execution_model": "m"}
        if relative and rng.random() < 0.5:
            traffic["weka_nested_timestamp_basis"] = "relative"
        return _with_lanes(rng, traffic, rng.choice([None, None, 1, 2, 3]))
    if not legacy and rng.random() < 0.25:
        events = random_dynamo_agentic(rng, block)
        with path.open("w") as fh:
            for event in events:
                fh.write(json.dumps(event) + "\n")
        traffic = {"source_type": "trace", "load_type": "trace_timestamps", "trace_path": str(path),
                   "trace_paths": [str(path)], "trace_format": "dynamo",
                   "arrival_speedup_ratio": rng.choice([1.0, 1.0, 2.0, 0.5]), "execution_model": "m"}
        if rng.random() < 0.5:
            traffic["trace_block_size"] = block
        return _with_lanes(rng, traffic, rng.choice([None, None, 1, 2, 3]))
    rows = []
    for play in range(rng.randint(1, 6)):
        pid = f"p{rng.randrange(100):02d}x{play}"
        base = [rng.randrange(1 << 40) for _ in range(40)]
        n = rng.randint(1, 12)
        names = [f"{pid}-{rng.choice('abcdefgh')}{k}" for k in range(n)]
        for k in range(n):
            il = rng.choice([30, 200, 700, 1500, 3000])
            if rng.random() < 0.04:
                il = 300_000  # beyond any pool: rejected
            need = -(-il // block)
            shared = min(need, len(base), rng.randint(0, need))
            hashes = base[:shared] + [rng.randrange(1 << 40) for _ in range(need - shared)]
            if rng.random() < 0.1 and len(rows) > 0:
                other = rng.choice(rows)["hash_ids"]
                hashes = (other + hashes)[:need]
            ol = rng.choice([0, 1, 5, 30, 120]) if rng.random() < 0.1 else rng.choice([1, 5, 30, 120])
            row = {"request_id": names[k], "input_length": il, "output_length": ol, "hash_ids": hashes}
            parents = rng.sample(range(k), min(k, rng.choice([1, 1, 1, 2]))) if k else []
            if rng.random() < 0.1 and k:
                parents = []  # a second root
            delay = rng.choice([0.0, 0.0, 5.0, 50.0, 300.0])
            start = float(rng.choice([0, 0, 100, 777, 2500]) + rng.randrange(3))
            if legacy:
                row.update(session_id=pid, timestamp=start)
                if parents:
                    row["wait_for"] = [names[j] for j in parents]
                    row["tool_wait_ms"] = delay
            else:
                deps = []
                for j in parents:
                    spawn = rng.random() < 0.25
                    trigger = "dispatch" if spawn and rng.random() < 0.6 else "completion"
                    relation = "spawn" if spawn else ("join" if len(parents) > 1 else
                                                      rng.choice(["sequence", "sequence", "replay_barrier"]))
                    deps.append({"request_id": names[j], "trigger": trigger, "delay_ms": rng.choice([0.0, 5.0, delay]),
                                 "relation": relation})
                row.update(play_id=pid, session_id=f"{pid}-s{rng.randrange(2)}", model="m",
                           not_before_ms=start if not deps or rng.random() < 0.2 else 0.0, dependencies=deps)
            if rng.random() < 0.1 and ol:
                row["output_token_ids"] = [rng.randrange(1000) for _ in range(ol)]
            rows.append(row)
    rng.shuffle(rows)
    with path.open("w") as fh:
        if not legacy:
            fh.write(json.dumps({"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": block,
                                 "hash_id_scope": "local", "source": {"format": "differential", "digest": "d"}})
                     + "\n")
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    lanes = rng.choice([None, None, 1, 2, 3])
    traffic = {"source_type": "trace", "load_type": "trace_timestamps", "trace_path": str(path),
               "trace_paths": [str(path)], "trace_format": "agentic_mooncake", "trace_block_size": block,
               "arrival_speedup_ratio": rng.choice([1.0, 1.0, 2.0, 0.5]), "execution_model": "m"}
    return _with_lanes(rng, traffic, lanes)


def _with_lanes(rng: random.Random, traffic: dict, lanes: int | None) -> list[str]:
    """The traffic edits of an agentic trace run on ``lanes`` (None: plays all at once),
    now and then each lane replaying a seeded cut of one play."""
    if lanes:
        traffic["agentic_lanes"] = lanes
        if rng.random() < 0.3:
            traffic["agentic_snapshot"] = {"seed": rng.randrange(1 << 32)}
    return ["traffic=" + json.dumps(traffic), "spec.max_in_flight=null"]


def random_weka_corpus(rng: random.Random, path: Path, block: int) -> bool:
    """A random Weka corpus at ``path`` (one JSONL object per play, 1-3 plays): turns
    that extend the conversation's prompt, forks that share only a prefix, now and then
    a hashless request, a partial block, a zero output, and subagents (blocking with or
    without ``duration_ms``, background) whose requests start at or after their marker,
    or, for a relative corpus, count from it. Returns whether the inner times are
    relative."""
    relative = rng.random() < 0.3
    with path.open("w") as fh:
        for play in range(rng.randint(1, 3)):
            t = 0.0
            prompt = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 6))]
            entries = []

            def request(at: float, base: list) -> dict:
                n = len(base)
                r = {"t": round(at, 3), "type": rng.choice("ns"), "model": "m",
                     "in": max(1, n * block - (rng.randrange(block) if rng.random() < 0.3 else 0)),
                     "out": 0 if rng.random() < 0.05 else rng.choice([1, 5, 30, 120]),
                     "hash_ids": [] if rng.random() < 0.05 else list(base),
                     "api_time": rng.choice([None, 0.1, 0.5, 1.5, 3.0])}
                if rng.random() < 0.05:
                    r["in"] = 300_000  # beyond any pool: rejected, its play fails
                return r
            for k in range(rng.randint(1, 8)):
                if k and rng.random() < 0.25:  # a subagent after at least one parent request
                    inner, it = [], t + rng.choice([0.0, 0.05, 0.3])
                    sub = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 3))]
                    for _ in range(rng.randint(0 if rng.random() < 0.2 else 1, 3)):
                        r = request(it - t if relative else it, sub)
                        inner.append(r)
                        sub = sub + [rng.randrange(1 << 40)]
                        it += (r["api_time"] or 0.0) + rng.choice([0.0, 0.2])
                    blocking = bool(inner) and rng.random() < 0.6
                    e = {"t": round(t, 3), "type": "subagent", "agent_id": f"a{k}", "subagent_type": "Explore",
                         "status": "completed" if blocking else "async_launched", "requests": inner}
                    if blocking and rng.random() < 0.5:
                        e["duration_ms"] = int((it - t) * 1000) + rng.choice([0, 100, 5000])
                    entries.append(e)
                    continue
                if k and rng.random() < 0.2:  # a fork: only a prefix of the conversation
                    base = prompt[:rng.randint(1, len(prompt))] + [rng.randrange(1 << 40)]
                else:
                    prompt = prompt + [rng.randrange(1 << 40) for _ in range(rng.randint(1, 3))]
                    base = prompt
                r = request(t, base)
                entries.append(r)
                t += (r["api_time"] or 0.0) + rng.choice([0.0, 0.0, 0.1, 1.0, 30.0])
            fh.write(json.dumps({"id": f"play{play}", "models": ["m"], "block_size": block,
                                 "hash_id_scope": "local", "requests": entries}) + "\n")
    return relative


def random_dynamo_agentic(rng: random.Random, block: int) -> list[dict]:
    """Dynamo request records of 1-5 agent plays, every one with ``agent_context``: a
    root session of 1-6 requests, each after the one before (gaps 0-400 ms), and 0-2
    child sessions (``parent_session_id``) started during it, half of them named by a
    blocking or background tool event (``tool.claude``: source, sometimes a consumer),
    the rest linked by their times; now and then an explicit
    ``replay.dependencies`` edge to an earlier request, a request without a model, a
    prompt no pool holds (its play fails), and rarely a request that starts before the
    one before it ended (the reference refuses that trace). Records are shuffled across
    the file (order comes from their times)."""
    epoch = 1_700_000_000_000
    events, requests = [], []   # requests: (start, end, request id) of those written

    def request(rid, session, start, dur, parent=None, deps=None):
        il = rng.choice([30, 200, 700, 1500, 3000])
        if rng.random() < 0.04:
            il = 300_000
        need = -(-il // block)
        shared = session_prefix.setdefault(session, [rng.randrange(1 << 40) for _ in range(40)])
        k = min(need, len(shared), rng.randint(0, need))
        hashes = shared[:k] + [rng.randrange(1 << 40) for _ in range(need - k)]
        rec = {"request_id": rid, "output_tokens": rng.choice([1, 5, 30, 120]), "request_received_ms": epoch + start,
               "total_time_ms": float(dur), "replay": {"trace_block_size": block, "input_length": il,
                                                       "input_sequence_hashes": hashes}}
        if rng.random() < 0.9:
            rec["model"] = "m"
        if deps:
            rec["replay"]["dependencies"] = deps
        ctx = {"session_id": session}
        if parent:
            ctx["parent_session_id"] = parent
        events.append({"schema": "dynamo.request.trace.v1", "event_type": "request_end",
                       "event_time_unix_ms": epoch + start + dur, "agent_context": ctx, "request": rec})
        requests.append((start, start + dur, rid))

    session_prefix: dict = {}
    for play in range(rng.randint(1, 5)):
        root = f"s{play}{rng.choice('abcxyz')}"
        t = rng.choice([0, 0, 150, 1000, 4000]) + rng.randrange(5)
        mine = []
        for k in range(rng.randint(1, 6)):
            dur = rng.choice([40, 100, 400])
            deps = None
            if requests and rng.random() < 0.15:
                cands = [r for r in requests if r[1] <= t]
                if cands:
                    src = rng.choice(cands)
                    deps = [{"request_id": src[2], "relation": rng.choice(["join", "sequence", "replay_barrier"]),
                             "trigger": "completion"}]
            rid = f"{root}-r{k}{rng.choice('pq')}"
            request(rid, root, t, dur, deps=deps)
            mine.append((t, t + dur, rid))
            t += dur + rng.choice([0, 0, 20, 150, 400]) - (60 if rng.random() < 0.02 else 0)
        for c in range(rng.choice([0, 0, 1, 1, 2])):
            child = f"{root}-c{c}"
            src = rng.choice(mine)
            ct = src[0] + rng.randrange(0, 200)
            kids = []
            for k in range(rng.randint(1, 3)):
                dur = rng.choice([30, 90])
                request(f"{child}-r{k}", child, ct, dur, parent=root)
                kids.append((ct, ct + dur))
                ct += dur + rng.choice([0, 30])
            if rng.random() < 0.5:
                starters = [m for m in mine if m[0] <= kids[0][0]]
                consumers = [m for m in mine if m[0] >= kids[-1][1]]
                claude = {"source_request_id": rng.choice(starters)[2],
                          "execution_mode": rng.choice(["blocking", "background"]), "child_session_id": child}
                if consumers and rng.random() < 0.7:
                    claude["consumer_request_id"] = rng.choice(consumers)[2]
                events.append({"schema": "dynamo.request.trace.v1", "event_type": "tool_end",
                               "event_time_unix_ms": epoch + kids[-1][1], "agent_context": {"session_id": root},
                               "tool": {"tool_call_id": f"call-{child}", "tool_class": "agent",
                                        "started_at_unix_ms": epoch + kids[0][0],
                                        "ended_at_unix_ms": epoch + kids[-1][1], "claude": claude}})
    rng.shuffle(events)
    return events


def agentic_differences(sim, requests, report_path: Path) -> list[tuple]:
    """The agentic report keys (report.agentic) that differ from the reference's report."""
    from aisim_fast.report.agentic import report_keys
    ref = json.loads(report_path.read_text())
    ours = report_keys(sim.workload.agentic, requests, "m")
    bad = []
    for key, value in ours.items():
        theirs = ref.get(key, "missing")
        if isinstance(value, float) and isinstance(theirs, float):
            if abs(value - theirs) > 1e-9 * max(1.0, abs(theirs)):
                bad.append((key, theirs, value))
        elif value != theirs:
            bad.append((key, theirs, value))
    return bad


def instance_differences(records_path: Path, requests) -> list[tuple]:
    """A snapshot replay's rows against the reference's raw records, matched by agentic
    instance id: a play cut on several lanes repeats its source request ids, which the
    per-request CSV (keyed by request id) folds into one row."""
    ours = {rid: row for rid, row in zip(requests["agentic_request_id"], requests.itertuples())}
    bad = []
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    if len(records) != len(ours):
        return [("rows", f"reference {len(records)}, aisim_fast {len(ours)}")]
    for rec in records:
        key = (rec.get("agentic") or {}).get("request_id")
        row = ours.get(key)
        if row is None:
            bad.append(("missing", key))
            continue
        for theirs, mine, column in ((rec["arrival_time_ms"], row.arrival_ms, "arrival_ms"),
                                     (rec["first_token_ms"], row.first_token_ms, "first_token_ms"),
                                     (rec["terminal_time_ms"], row.completion_ms, "completion_ms"),
                                     (rec["reused_input_tokens"], row.cached_tokens, "cached_tokens")):
            theirs = math.nan if theirs is None else float(theirs)
            mine = math.nan if mine is None or mine != mine else float(mine)
            if not (theirs == mine or (math.isnan(theirs) and math.isnan(mine))
                    or abs(theirs - mine) <= 1e-6 * max(1.0, abs(theirs))):
                bad.append((column, key, theirs, mine))
    return bad


def random_sglang_config(rng: random.Random, disagg_fraction: float = 0.0) -> list[str]:
    """An SGLang rank: page size 1 or 16, a pool in tokens from tight to roomy, fifo or
    lpm, chunk and prefill budgets, clipped output reserve, conservativeness, sometimes
    a prefill_decode_interval; aggregated, or (``disagg_fraction``) prefill and decode
    pools with the DestinationFirst handoff, a tight decode pool and sometimes a
    transfer model."""
    ps = rng.choice([1, 1, 16])
    pool_tokens = rng.choice([2000, 3000, 6000, 20000, 1 << 20])
    chunk = ps * rng.choice([13, 64, 512])
    if rng.random() < disagg_fraction:
        placement = ["--prefill-workers", str(rng.randint(1, 2)), "--decode-workers", str(rng.randint(1, 3)),
                     "--prefill-num-gpu-blocks", str(max(pool_tokens, 6000) // ps),
                     "--decode-num-gpu-blocks", str(pool_tokens // ps)]
        if rng.random() < 0.5:
            placement += ["--kv-transfer-bandwidth", "25", "--kv-transfer-bytes-per-token", "163840"]
    else:
        placement = ["--num-gpu-blocks", str(pool_tokens // ps), "--workers", str(rng.randint(1, 3))]
    args = ["--backend", "sglang", "--block-size", str(ps), *placement,
            "--max-num-seqs", str(rng.choice([4, 16, 256])),
            "--sglang-schedule-policy", rng.choice(["fifo", "lpm"]),
            "--sglang-chunked-prefill-size", str(chunk),
            "--sglang-max-prefill-tokens", str(chunk + rng.choice([0, 300, 8192])),
            "--sglang-clip-max-new-tokens", str(rng.choice([20, 4096])),
            "--sglang-schedule-conservativeness", str(rng.choice([1.0, 0.5, 0.1]))]
    if rng.random() < 0.2:
        args.append("--no-prefix-caching")
    if rng.random() < 0.3:
        args += ["--concurrency", str(rng.choice([1, 8, 32]))]
    if rng.random() < 0.3:
        args += ["--timing", "fixed", "--fixed-prefill-ms", "5", "--fixed-decode-ms", "2"]
    if rng.random() < 0.25:
        args += ["--engine-json", json.dumps({"prefill_decode_interval": rng.randint(1, 4)})]
    return args


def random_host_loop_edits(rng: random.Random) -> list[str]:
    """Payload edits turning an aggregated SGLang rank's host loop on, and half the time
    frontend stages ahead of it: one to three stages of one to three workers, service
    times from free to slower than a pass, and a concurrency_scale now and then."""
    edits = ["spec.engine.rank.sglang.host_loop=true"]
    if rng.random() < 0.5:
        stages = []
        for _ in range(rng.randint(1, 3)):
            workers = rng.randint(1, 3)
            stage = {"workers": workers, "service_ms": rng.choice([0.0, 1.5, 20.0, 120.0])}
            if rng.random() < 0.5:
                stage["concurrency_scale"] = [round(rng.uniform(1.0, 2.5), 2) for _ in range(workers)]
            stages.append(stage)
        edits.append("spec.engine.rank.frontend=" + json.dumps({"stages": stages}))
    return edits


def random_speculation_edits(rng: random.Random, pools: list[str]) -> list[str]:
    """Payload edits making every pool's rank speculate (``pools``: the rank paths): a
    draft count, conditional rates (uniform, exactly 0 or 1 now and then; sometimes
    fewer than the drafts, zero-padded, or absent: the defaults) and a seed now and then."""
    nextn = rng.randint(1, 5)
    rates = None
    if rng.random() < 0.85:
        count = nextn if rng.random() < 0.8 else rng.randint(1, nextn)
        rates = ",".join(str(rng.choice([0.0, 1.0])) if rng.random() < 0.2 else f"{rng.uniform(0, 1):.3f}"
                         for _ in range(count))
    seed = rng.randint(0, 2 ** 63) if rng.random() < 0.3 else None
    edits = []
    for pool in pools:
        edits.append(f"{pool}.aic_nextn={nextn}")
        if rates is not None:
            edits.append(f"{pool}.aic_nextn_accept_rates=" + json.dumps(rates))
        if seed is not None:
            edits.append(f"{pool}.aic_mtp_seed={seed}")
    return edits


def random_config(rng: random.Random, disagg_fraction: float = 0.3, sglang_fraction: float = 0.0) -> list[str]:
    if sglang_fraction > 0 and rng.random() < sglang_fraction:
        return random_sglang_config(rng, disagg_fraction)
    backend = rng.choice(["vllm", "vllm", "trtllm"])
    bs = rng.choice([16, 32, 64])
    args = ["--backend", backend, "--block-size", str(bs),
            "--max-num-seqs", str(rng.choice([1, 2, 4, 16, 256])),
            "--max-num-batched-tokens", str(rng.choice([256, 2048, 8192])),
            "--preemption-mode", rng.choice(["lifo", "fifo"])]
    tight = rng.choice([64, 200, 600, 4096, 16384])
    if rng.random() < 0.3:
        args.append("--no-chunked-prefill")
        args[args.index("--max-num-batched-tokens") + 1] = "16384"
    if rng.random() < 0.2:
        args.append("--no-prefix-caching")
    if rng.random() < 0.25:
        args += ["--concurrency", str(rng.choice([1, 3, 8]))]
    if rng.random() < disagg_fraction:
        args += ["--prefill-workers", str(rng.randint(1, 2)), "--decode-workers", str(rng.randint(1, 3)),
                 "--prefill-num-gpu-blocks", str(max(tight, 2048)), "--decode-num-gpu-blocks", str(tight)]
        if rng.random() < 0.5:
            args += ["--kv-transfer-bandwidth", "25", "--kv-transfer-bytes-per-token", "163840"]
    else:
        args += ["--workers", str(rng.randint(1, 3)), "--num-gpu-blocks", str(tight)]
    if rng.random() < 0.3:
        args += ["--timing", "fixed", "--fixed-prefill-ms", "5", "--fixed-decode-ms", "2"]
    return args


CLI_TEMPLATES = sorted((ROOT / "tests" / "data" / "golden_cli").glob("*.payload.json"))


def random_cli_payload(rng: random.Random) -> tuple[Path, list[str]]:
    """A CLI payload template and ``dotted.path=JSON`` edits of its memory sizing,
    ``max_num_seqs`` and workers (every pool of a disaggregated one)."""
    template = rng.choice(CLI_TEMPLATES)
    payload = json.loads(template.read_text())
    engine = payload["spec"]["engine"]
    pools = [f"spec.engine.{role}" for role in ("prefill", "decode") if role in engine] or ["spec.engine"]
    edits = []
    for pool in pools:
        block = engine if pool == "spec.engine" else engine[pool.rsplit(".", 1)[1]]
        timing = block["rank"].get("timing_model") or {}
        edits.append(f"{pool}.rank.max_num_seqs={rng.choice([4, 16, 64, 256])}")
        if timing.get("provider") == "aic":
            config = f"{pool}.rank.timing_model.config"
            edits += [f"{pool}.num_gpu_blocks_is_explicit=false",
                      f"{config}.gpu_memory_utilization={round(rng.uniform(0.5, 0.95), 3)}",
                      f"{config}.cuda_graph_reserved_bytes={rng.choice([0, 10**9, 4 * 10**9, 2 * 10**10, 5 * 10**10])}"]
    topology = payload["spec"]["topology"]
    for role in ("prefill", "decode") if topology["kind"] == "disaggregated" else ("workers",):
        edits.append(f"spec.topology.{role}.initial_workers={rng.choice([1, 2, 3])}")
    return template, edits


def random_predict_config(rng: random.Random, trace: str) -> dict:
    """A reference ``predict`` config (the YAML its CLI reads) over the family
    ``--predict-config`` lowers: vLLM / TRT-LLM / SGLang, aggregated or disaggregated
    (heterogeneous hardware now and then), op-level, polynomial or fixed timing, fixed
    blocks or a memory fraction with a CUDA-graph reserve, scheduler sizes, trace
    timestamps (sped up) or concurrency, a delta trace, a synthetic load (concurrency,
    constant rate or seeded poisson, a shared prefix, a per-load-unit stop), synthetic
    sessions (prefix groups, think times), a virtual-time cap, an SLA, a tokenization pool."""
    backend = rng.choice(["vllm", "vllm", "trtllm", "sglang"])
    mode = "disaggregated" if rng.random() < 0.35 else "aggregated"

    def worker(role: str) -> dict:
        out: dict = {"parallelism": {"replicas": rng.choice([1, 1, 2, 3])}}
        if rng.random() < 0.3:
            out["parallelism"]["tensor"] = 2
        scheduler = {}
        if rng.random() < 0.5:
            scheduler["max_batched_tokens"] = rng.choice([1024, 2048, 4096, 8192])
        if rng.random() < 0.5:
            scheduler["max_sequences"] = rng.choice([2, 8, 32, 256])
        if scheduler:
            out["scheduler"] = scheduler
        timing = rng.choice(["default", "polynomial", "fixed"])
        if timing == "fixed":
            out["timing"] = {"type": "fixed", "prefill_ms": rng.choice([2.0, 10.0, 25.0]),
                             "decode_ms": rng.choice([1.0, 4.0, 9.0])}
        elif timing == "polynomial":
            out["timing"] = {"type": "polynomial"}
        kv: dict = {}
        if backend != "sglang" and rng.random() < 0.4:
            kv["block_size"] = rng.choice([16, 32, 64])
        if backend == "sglang" or rng.random() < 0.5:
            blocks = rng.choice([300, 2000, 20000]) * (64 if backend == "sglang" else 1)
            kv["capacity"] = {"type": "fixed", "blocks": blocks}
        else:
            capacity = {"type": "default"}
            if rng.random() < 0.7:
                capacity["memory_fraction"] = round(rng.uniform(0.3, 0.95), 3)
            if rng.random() < 0.5:
                capacity["cuda_graph_reserved_bytes"] = rng.choice([10**9, 4 * 10**9, 3 * 10**10])
            kv["capacity"] = capacity
        if kv:
            out["kv_cache"] = kv
        if mode == "disaggregated" and rng.random() < 0.3:
            out["hardware"] = rng.choice(["h100_sxm", "h200_sxm"])
        return out

    engine: dict = {"mode": mode, "model": "Qwen/Qwen3-32B", "hardware": "h200_sxm", "backend": backend}
    if mode == "aggregated":
        engine["workers"] = {"aggregated": worker("aggregated")}
    else:
        engine["workers"] = {"prefill": worker("prefill"), "decode": worker("decode")}
        engine["kv_transfer"] = {"bandwidth_gb_per_second": rng.choice([5.0, 25.0, 100.0]),
                                 "timing_mode": rng.choice(["full_prompt", "destination_missing"])}
    if rng.random() < 0.2:
        engine["context_length"] = rng.choice([16384, 40960])
    if backend != "sglang" and rng.random() < 0.2:
        engine["enable_chunked_prefill"] = rng.choice([True, False])
    load = {"type": "concurrency", "concurrency": rng.choice([1, 4, 16])} if rng.random() < 0.3 \
        else {"type": "trace_timestamps", **({"speedup": rng.choice([0.5, 2.0])} if rng.random() < 0.3 else {})}
    # a delta trace (the reference's CLI takes it on aggregated engines only)
    trace_format = "mooncake-delta" if mode == "aggregated" and rng.random() < 0.2 else "mooncake"
    traffic: dict = {"source": {"type": "trace", "paths": [trace], "format": trace_format, "block_size": 512},
                     "load": load}
    if rng.random() < 0.15:
        # synthetic sessions: histories, prefix groups, think times
        source = {"type": "synthetic-session", "new_input_tokens_per_turn": rng.choice([64, 300, 1000]),
                  "output_tokens_per_turn": rng.choice([1, 16, 120]),
                  "session": {"turns": rng.choice([2, 3, 5]), "inter_turn_delay_ms": rng.choice([0.0, 7.0, 250.0])}}
        if rng.random() < 0.6:
            source["session"].update(shared_prefix_ratio=rng.choice([0.25, 0.5, 1.0]),
                                     prefix_groups=rng.choice([1, 2, 7]))
        kind = rng.choice(["concurrency", "constant_rate", "poisson"])
        if kind == "concurrency":
            load = {"type": kind, "concurrency": rng.choice([1, 4, 16])}
        else:
            load = {"type": kind, "sessions_per_second": rng.choice([1.0, 5.0, 20.0])}
            if kind == "poisson" and rng.random() < 0.8:
                load["seed"] = rng.randrange(0, 1000)
        stop = {"sessions_per_load_unit": rng.choice([1.5, 3])} if rng.random() < 0.3 \
            else {"sessions": rng.choice([5, 20, 60])}
        traffic = {"source": source, "load": load, "stop": stop}
    elif rng.random() < 0.25:
        # a synthetic load: fixed lengths with a shared prefix, under concurrency, a
        # constant rate or seeded poisson arrivals
        isl = rng.choice([64, 512, 3000])
        source = {"type": "synthetic", "input_tokens": isl, "output_tokens": rng.choice([1, 16, 200])}
        if rng.random() < 0.5:
            source["cached_prefix_tokens"] = rng.randrange(0, isl + 1)
        kind = rng.choice(["concurrency", "constant_rate", "poisson"])
        if kind == "concurrency":
            load = {"type": kind, "concurrency": rng.choice([1, 4, 32])}
        else:
            load = {"type": kind, "requests_per_second": rng.choice([2.0, 20.0, 75.0])}
            if kind == "poisson" and rng.random() < 0.8:
                load["seed"] = rng.randrange(0, 1000)
        stop = {"requests_per_load_unit": rng.choice([2, 2.5, 10])} if rng.random() < 0.3 \
            else {"requests": rng.choice([10, 60, 200])}
        traffic = {"source": source, "load": load, "stop": stop}
    if rng.random() < 0.15:
        traffic.setdefault("stop", {})["max_virtual_time_seconds"] = rng.choice([0.5, 2.0, 10.0])
    if rng.random() < 0.3:
        # a tokenization pool ahead of each (prefill) worker (base ms, us per prompt token)
        engine["tokenization"] = {"workers": rng.choice([1, 2, 4]), "base_ms": rng.choice([0.0, 2.0, 20.0]),
                                  "per_input_token_us": rng.choice([1.0, 10.0, 50.0])}
    config = {"traffic": traffic, "engine": engine}
    if rng.random() < 0.2:
        config["evaluation"] = {"sla": {"ttft_ms": 500.0, "itl_ms": 30.0}}
    return config


def predict_case(ref_python: str, rng: random.Random, case: Path, trace: Path,
                 timeout_s: float) -> tuple[str, bool, str, str]:
    """One predict-config case: the reference's CLI lowers and runs the config
    (``cli-payloads/capture.py``), its payload is rerun for the golden CSV; our
    lowering must write that payload and our run must match the CSV.
    Returns (kind, ok, tally key, outcome)."""
    import yaml

    from aisim_fast.config.predict_config import lower_predict_config

    config = random_predict_config(rng, str(trace))
    engine = config["engine"]
    kind = f"predict/{engine['backend']}/{engine['mode'][:5]}"
    (case / "config.predict.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        subprocess.run([ref_python, str(REF_DIR / "cli-payloads" / "capture.py"), "config.predict.yaml", "ref"],
                       cwd=case, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return kind, False, "reference timed out", "reference timed out"
    captured = case / "ref" / "captured_payload_0.json"
    try:
        ours = lower_predict_config(config)
    except Exception as exc:  # a key aisim_fast refuses (or the reference refused too)
        stderr = (case / "ref" / "predict_stderr.txt").read_text() if (case / "ref").exists() else ""
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        # the CLI's "aisimulate: error: CONFIG: words", a traceback's "...Error: words", or
        # a validation error's "  Value error, words [type=value_error, ...]" (pydantic;
        # its last line is a link)
        pydantic = [ln.split("Value error, ", 1)[1].split(" [type=", 1)[0] for ln in lines if "Value error, " in ln]
        words = lines[-1].split("aisimulate: error: ", 1)[-1].split(".yaml: ", 1)[-1] if lines else ""
        words = pydantic[0].strip() if pydantic else words.rsplit("Error: ", 1)[-1].strip()
        if not captured.exists() and words and (words in str(exc) or same_stop(words, str(exc))):
            return kind, True, "both refused", f"refused: {exc}"
        return kind, False, "aisim_fast refused the config", f"refused: {exc}; reference: {words[-150:]}"
    if not captured.exists():
        return kind, False, "reference refused the config", \
            (case / "ref" / "predict_stderr.txt").read_text().strip()[-200:]
    theirs = json.loads(captured.read_text())
    engine_pools = theirs["spec"]["engine"]
    for pool in ([engine_pools] if "rank" in engine_pools else engine_pools.values()):
        (pool["rank"]["timing_model"].get("config") or {}).pop("systems_paths", None)
    (case / "spec.json").write_text(json.dumps(theirs, indent=1))
    if ours != theirs:
        return kind, False, "lowering differs", "our payload differs from the reference CLI's"
    ref = subprocess.run([ref_python, str(ROOT / "benchmarks" / "ref_payload_run.py"), str(case / "spec.json"),
                          str(case / "rr")], capture_output=True, text=True, timeout=timeout_s)
    ref_failed = ref.returncode != 0 or not (case / "rr.csv").exists()
    try:
        setup = parse_payload(ours, case, trace_override=str(trace))
    except Exception as exc:
        lines = [ln for ln in ref.stderr.strip().splitlines() if ln.strip()]
        words = lines[-1].rsplit("ValueError: ", 1)[-1] if lines else ""
        ok = ref_failed and bool(words) and same_stop(words, str(exc))
        return kind, ok, "both refused" if ok else "aisim_fast refused the payload", f"refused: {exc}"
    sim = simulation_from_setup(setup)
    res = run_batch([sim])
    if res.status[0] != "ok" or ref_failed:
        ok = res.status[0] != "ok" and ref_failed and same_stop(ref.stderr, res.error[0])
        return kind, ok, "both stopped" if ok else "stop disagreement", \
            f"aisim_fast {res.status[0]} ({res.error[0]}); reference {'failed' if ref_failed else 'ok'}"
    gold = read_csv(case / "rr.csv")
    bad = compare(gold, res.requests[0])
    if len(gold) != len(res.requests[0]):
        bad.insert(0, ("rows", f"reference {len(gold)}, aisim_fast {len(res.requests[0])}"))
    if "tokenization" in ours and not bad:
        # the golden CSV has no tokenized_ms: the reference's raw records do
        ours_tok = {(str(r["request_id"]), int(r["turn_index"])): r["tokenized_ms"]
                    for r in res.requests[0].to_dict("records")}
        for line in (case / "rr.jsonl").read_text().splitlines():
            rec = json.loads(line)
            got = ours_tok.get((rec["session_id"], int(rec["turn_index"])))
            if got is None or abs(got - rec["tokenized_ms"]) > 1e-9:
                bad.append(("tokenized_ms", rec["session_id"], rec["tokenized_ms"], got))
        kind += "/tok"
    return kind, not bad, "match" if not bad else "divergent", \
        "match" if not bad else f"{len(bad)} differences, first {bad[:3]}"


def read_csv(path: Path) -> dict:
    with path.open(newline="", encoding="utf-8") as fh:
        return {(r["request_id"].strip(), as_key_part(r.get("turn_index"))): r for r in csv.DictReader(fh)}


def compare(gold: dict, frame, dp_size: int = 1, prefill_dp_size: int = 1) -> list:
    """Every column the reference writes, with the corner tests' rules
    (``parity_rules.row_differences``); with attention DP the reference's worker is
    the rank's scheduler id (in its pool)."""
    frame = workers_as_scheduler_ids(frame, dp_size, prefill_dp_size)
    cand = {(str(r["request_id"]).strip(), as_key_part(r["turn_index"])): r for r in frame.to_dict("records")}
    bad = [("missing", k) for k in gold if k not in cand]
    for key, row in gold.items():
        if key in cand:
            bad.extend((col, key, g, c) for col, g, c in row_differences(row, cand[key]))
    return bad


def _ours_alone_here(spec: Path, trace: Path) -> str:
    """aisim_fast's outcome on a payload the reference did not finish in time (it
    should stop with a named error, not spin): ``ok``, or its status."""
    if not spec.exists():
        return "not run (no payload)"
    try:
        setup = parse_payload(json.loads(spec.read_text()), spec.parent,
                              trace_override=None if trace is None else str(trace))
        res = run_batch([simulation_from_setup(setup)], record_passes=False)
    except Exception as exc:  # a field aisim_fast refuses
        return f"refused ({str(exc)[:60]})"
    return res.status[0]


def ours_alone(spec: Path, trace: Path, timeout_s: float) -> str:
    """``_ours_alone_here`` in a forked child given as long as the reference had, plus
    three minutes for a first compile of the case's kernel features: a case the
    reference spins on can make aisim_fast spin as faithfully, and the sweep goes on to
    the next case either way."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(_ours_alone_here(spec, trace)), daemon=True)
    child.start()
    child.join(timeout_s + 180.0)
    if child.is_alive():
        child.kill()
        child.join()
        return f"also unfinished after {timeout_s + 180.0:.0f} s"
    try:
        return out.get(timeout=5.0)
    except Exception:  # queue.Empty: the child died without an answer
        return f"child exited {child.exitcode}"


def reference_timed_out(tally: Counter, i: int, kind: str, timeout_s: float, spec: Path,
                        trace: Path) -> None:
    """Count and print a case the reference did not finish, with aisim_fast's outcome."""
    ours = ours_alone(spec, trace, timeout_s)
    tally[f"reference timed out, aisim_fast {ours}"] += 1
    print(f"{i:4d} {kind:12s} ref timed out after {timeout_s:.0f} s; aisim_fast {ours}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref-python", required=True)
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", default=None,
                   help="comma-separated case numbers to run (of --cases), e.g. to rerun a "
                        "seed's divergent cases with the same flags")
    p.add_argument("--keep", type=Path, default=None, help="folder for divergent cases")
    p.add_argument("--disagg-fraction", type=float, default=0.3,
                   help="share of disaggregated configurations (0.3 keeps earlier seeds' draws)")
    p.add_argument("--ref-timeout", type=float, default=120.0, help="seconds per reference run")
    p.add_argument("--sglang-fraction", type=float, default=0.0,
                   help="share of aggregated SGLang configurations (0 keeps earlier seeds' draws)")
    p.add_argument("--cap-fraction", type=float, default=0.0,
                   help="share of the cases run with a time cap (spec.max_sim_time_ms), their "
                        "summary compared with the reference's report too")
    p.add_argument("--dp-fraction", type=float, default=0.0,
                   help="share of aggregated cases run with attention DP (dp_size 2 or 3)")
    p.add_argument("--cli-fraction", type=float, default=0.0,
                   help="share of the cases run as a payload the reference's CLI writes "
                        "(tests/data/golden_cli), memory sizing and pools drawn")
    p.add_argument("--predict-fraction", type=float, default=0.0,
                   help="share of the cases run as a reference predict config (YAML): the "
                        "reference's CLI lowers and runs it, aisim_fast's lowering must write "
                        "the same payload and its run match request for request")
    p.add_argument("--hostloop-fraction", type=float, default=0.0,
                   help="share of the aggregated SGLang cases run with the host loop "
                        "(sglang.host_loop), half of them with frontend stages")
    p.add_argument("--traffic-fraction", type=float, default=0.0,
                   help="share of cases whose traffic is replaced: the trace read as mooncake-delta, or a "
                        "synthetic load or session load (every load type, kv_capacity_fraction included)")
    p.add_argument("--agentic-fraction", type=float, default=0.0,
                   help="share of the cases without a time cap whose traffic is a random agentic trace "
                        "(agentic_mooncake v2 or legacy rows, agentic Dynamo records; lanes and speed-up "
                        "drawn); their agentic "
                        "report keys are compared too")
    p.add_argument("--speculation-fraction", type=float, default=0.0,
                   help="share of the cases without attention DP or host loop whose ranks speculate "
                        "(aic_nextn, acceptance rates and seed drawn)")
    p.add_argument("--kv-keys-fraction", type=float, default=0.0,
                   help="share of the cases whose payload spells out KV keys that change no request: "
                        "kv_cache_bytes_per_token on every rank (no tier), kv_eviction_policy lru "
                        "(aggregated)")
    p.add_argument("--kv-artifacts", action="store_true",
                   help="one aggregated worker per case (vLLM / TRT-LLM, SGLang with "
                        "--sglang-fraction); compare KV events and output token ids with the "
                        "reference's artifacts too")
    args = p.parse_args()
    tally = Counter()
    kinds = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        only = None if args.only is None else {int(n) for n in args.only.split(",")}
        for i in range(args.cases):
            if only is not None and i not in only:
                continue
            rng = random.Random(args.seed * 100003 + i)
            case = Path(tmp) / f"case{i:04d}"
            case.mkdir()
            trace = case / "trace.jsonl"
            random_trace(rng, trace)
            if args.predict_fraction > 0 and not args.kv_artifacts:
                predict_rng = random.Random(args.seed * 100003 + i + 0x9D1C7)
                if predict_rng.random() < args.predict_fraction:
                    kind, ok, key, outcome = predict_case(args.ref_python, predict_rng, case, trace,
                                                          args.ref_timeout)
                    kinds[kind] += 1
                    tally[key] += 1
                    if not ok and args.keep is not None:
                        shutil.copytree(case, args.keep / f"seed{args.seed}_case{i:04d}", dirs_exist_ok=True)
                    print(f"{i:4d} {kind:12s} {'ok ' if ok else 'DIFF'} {outcome[:150]}", flush=True)
                    continue
            cfg = random_config(rng, 0.0 if args.kv_artifacts else args.disagg_fraction, args.sglang_fraction)
            if args.kv_artifacts:
                cfg[cfg.index("--workers") + 1] = "1"
                cfg += ["--artifacts", str(case / "ref.artifacts.json")]
            kind = ("disagg" if "--prefill-workers" in cfg else "agg") + "/" + cfg[1]
            dp_size = 1
            prefill_dp = 1  # disaggregated cases: the prefill pool's
            cadence = 1  # vLLM's prefill_schedule_interval, drawn for half the vLLM DP cases
            if args.dp_fraction > 0 and not args.kv_artifacts:
                dp_rng = random.Random(args.seed * 100003 + i + 0x5EED)
                if dp_rng.random() < args.dp_fraction:
                    if "--workers" in cfg:
                        dp_size = dp_rng.choice([2, 3])
                        kind += f"/dp{dp_size}"
                        if cfg[1] == "vllm" and dp_rng.random() < 0.5:
                            cadence = dp_rng.choice([2, 3, 4, 8])
                            kind += f"/i{cadence}"
                    else:
                        dp_size, prefill_dp = dp_rng.choice([(2, 1), (1, 2), (2, 2), (3, 2)])
                        kind += f"/dp{prefill_dp}x{dp_size}"
                        if cfg[1] == "vllm" and dp_rng.random() < 0.5:
                            cadence = dp_rng.choice([2, 3, 4, 8])
                            kind += f"/i{cadence}"
            cap_ms = None
            if args.cap_fraction > 0 and not args.kv_artifacts:
                cap_rng = random.Random(args.seed * 100003 + i + 0xCA9)
                if cap_rng.random() < args.cap_fraction:
                    arrivals = [json.loads(line).get("timestamp") for line in trace.read_text().splitlines()]
                    arrivals = [t for t in arrivals if t is not None]
                    span = max(arrivals) + 2000.0
                    cap_ms = float(cap_rng.choice(arrivals)) if cap_rng.random() < 0.2 \
                        else round(cap_rng.uniform(0.0, span), 3)
                    kind += "/cap"
            host_edits = []
            if args.hostloop_fraction > 0 and cfg[1] == "sglang" and "--workers" in cfg and dp_size == 1:
                host_rng = random.Random(args.seed * 100003 + i + 0x4057)
                if host_rng.random() < args.hostloop_fraction:
                    host_edits = random_host_loop_edits(host_rng)
                    kind += "/frontend" if len(host_edits) > 1 else "/hostloop"
            if args.speculation_fraction > 0 and max(dp_size, prefill_dp) == 1 and not host_edits:
                spec_rng = random.Random(args.seed * 100003 + i + 0x59EC)
                if spec_rng.random() < args.speculation_fraction:
                    pools = (["spec.engine.rank"] if "--workers" in cfg
                             else ["spec.engine.prefill.rank", "spec.engine.decode.rank"])
                    host_edits = host_edits + random_speculation_edits(spec_rng, pools)
                    kind += "/spec"
            own_trace = False  # the traffic edits name their own trace files
            if args.traffic_fraction > 0 and cap_ms is None:
                traffic_rng = random.Random(args.seed * 100003 + i + 0x7AF)
                if traffic_rng.random() < args.traffic_fraction:
                    traffic_kind, traffic_edits = random_traffic_edits(traffic_rng, trace)
                    own_trace = traffic_kind in ("dynamo", "applied")
                    host_edits = host_edits + traffic_edits
                    kind += "/" + traffic_kind
            agentic = False
            if args.agentic_fraction > 0 and cap_ms is None and not own_trace and not args.kv_artifacts:
                agentic_rng = random.Random(args.seed * 100003 + i + 0xA6E)
                if agentic_rng.random() < args.agentic_fraction:
                    host_edits = [e for e in host_edits if not e.startswith("traffic")] \
                        + random_agentic_trace(agentic_rng, case / "agentic.jsonl")
                    own_trace = agentic = True
                    kind += "/agentic" + ("-dynamo" if '"trace_format": "dynamo"' in host_edits[-2] else
                                          "-weka" if '"trace_format": "weka"' in host_edits[-2] else "")
            cli_edits = None
            if args.cli_fraction > 0 and not args.kv_artifacts:
                cli_rng = random.Random(args.seed * 100003 + i + 0xC11)
                if cli_rng.random() < args.cli_fraction:
                    template, cli_edits = random_cli_payload(cli_rng)
                    payload = json.loads(template.read_text())
                    payload["traffic"]["trace_path"] = str(trace)
                    payload["traffic"]["trace_paths"] = [str(trace)]
                    (case / "spec.json").write_text(json.dumps(payload, indent=1))
                    kind = "cli/" + template.name.removesuffix(".payload.json") + ("/cap" if cap_ms else "")
                    dp_size = prefill_dp = 1
            if args.kv_keys_fraction > 0 and cli_edits is None:
                kv_rng = random.Random(args.seed * 100003 + i + 0xB7E5)
                if kv_rng.random() < args.kv_keys_fraction:
                    per_token = kv_rng.choice([4096, 163840, 262144, 1 << 20])
                    ranks = (["spec.engine.rank"] if "--workers" in cfg
                             else ["spec.engine.prefill.rank", "spec.engine.decode.rank"])
                    host_edits = host_edits + [f"{r}.kv_cache_bytes_per_token={per_token}" for r in ranks]
                    if "--workers" in cfg and kv_rng.random() < 0.5:
                        host_edits.append('spec.engine.kv_eviction_policy="lru"')
                    kind += "/kvkeys"
            kinds[kind] += 1
            if cli_edits is None:
                try:
                    ref = subprocess.run([args.ref_python, str(REF_DIR / "ref_replay.py"), "--trace", str(trace),
                                          *cfg, "--csv", str(case / "ref.csv"), "--report",
                                          str(case / "ref.report.json"), "--dump-spec", str(case / "spec.json")],
                                         capture_output=True, text=True, timeout=args.ref_timeout)
                except subprocess.TimeoutExpired:
                    # the reference spins on some SGLang livelocks (a lone request that can
                    # neither grow nor be retracted) instead of aborting
                    reference_timed_out(tally, i, kind, args.ref_timeout, case / "spec.json", trace)
                    continue
                ref_failed = ref.returncode != 0 or not (case / "ref.csv").exists()
                if not (case / "spec.json").exists():
                    tally["reference refused the config"] += 1
                    continue
            # a CLI payload is run by the reference through the edit step only
            edits = list(cli_edits or []) + ([] if cap_ms is None else [f"spec.max_sim_time_ms={cap_ms}"]) \
                + host_edits
            if max(dp_size, prefill_dp) > 1:
                if "--workers" in cfg:
                    edits += [f"spec.engine.dp_size={dp_size}",
                              f"spec.engine.rank.prefill_schedule_interval={cadence}"]
                else:
                    edits += [f"spec.engine.decode.dp_size={dp_size}", f"spec.engine.prefill.dp_size={prefill_dp}",
                              f"spec.engine.decode.rank.prefill_schedule_interval={cadence}",
                              f"spec.engine.prefill.rank.prefill_schedule_interval={cadence}"]
            if edits:
                (case / "ref.csv").unlink(missing_ok=True)
                try:
                    ref = subprocess.run([args.ref_python, str(ROOT / "benchmarks" / "ref_payload_run.py"),
                                          str(case / "spec.json"), str(case / "dp"), *edits],
                                         capture_output=True, text=True, timeout=args.ref_timeout)
                except subprocess.TimeoutExpired:
                    reference_timed_out(tally, i, kind, args.ref_timeout, case / "dp.spec.json",
                                        None if own_trace else trace)
                    continue
                ref_failed = ref.returncode != 0 or not (case / "dp.csv").exists()
                if (case / "dp.spec.json").exists():
                    # the DP payload is what both sides run, whether the reference
                    # finished it or stopped (a dead end is compared too)
                    (case / "dp.spec.json").replace(case / "spec.json")
                if not ref_failed:
                    (case / "dp.csv").replace(case / "ref.csv")
                    (case / "dp.report.json").replace(case / "ref.report.json")
            payload = json.loads((case / "spec.json").read_text())
            try:
                setup = parse_payload(payload, case, trace_override=None if own_trace else str(trace))
                # a trace's own records can refuse it too (an agentic Dynamo trace)
                sim = simulation_from_setup(setup)
            except Exception as exc:  # a field aisim_fast refuses (named in the message)
                # a payload the reference stops on with the same words (a CLI payload whose
                # memory leaves no KV budget) is an agreement
                lines = [ln for ln in (ref.stderr if ref else "").strip().splitlines() if ln.strip()]
                words = lines[-1].rsplit("ValueError: ", 1)[-1].rsplit("AISimulate replay failed: ", 1)[-1] \
                    if lines else ""
                ok = ref_failed and bool(words) and same_stop(words, str(exc))
                tally["both refused" if ok else "aisim_fast refused the payload"] += 1
                outcome = f"refused: {exc}"
            else:
                if args.kv_artifacts:
                    sim = dataclasses.replace(sim, rank=dataclasses.replace(sim.rank, emit_kv_events=True))
                res = run_batch([sim], record_events=args.kv_artifacts, record_outputs=args.kv_artifacts)
                if res.status[0] != "ok" or ref_failed:
                    ok = res.status[0] != "ok" and ref_failed and same_stop(ref.stderr, res.error[0])
                    outcome = f"aisim_fast {res.status[0]} ({res.error[0]}); reference " \
                              f"{'failed: ' + ref.stderr.strip()[-300:] if ref_failed else 'ok'}"
                    tally["both stopped" if ok else "stop disagreement"] += 1
                else:
                    gold = read_csv(case / "ref.csv")
                    if sim.workload.agentic is not None and sim.workload.agentic.snapshot is not None \
                            and len(gold) < len(res.requests[0]) and (case / "dp.jsonl").exists():
                        bad = instance_differences(case / "dp.jsonl", res.requests[0])
                    else:
                        bad = compare(gold, res.requests[0], sim.dp_size, sim.prefill_dp_size)
                        if len(gold) != len(res.requests[0]):  # kept as a divergence, not a crash
                            bad.insert(0, ("rows", f"reference {len(gold)}, aisim_fast {len(res.requests[0])}"))
                    if cap_ms is not None and not bad:
                        bad += summary_differences(setup, sim, res, case / "ref.report.json")
                    if agentic and not bad:
                        bad += agentic_differences(sim, res.requests[0], case / "ref.report.json")
                    if args.kv_artifacts and not bad:
                        artifacts = json.loads((case / "ref.artifacts.json").read_text())
                        if kv_event_rows(res.kv_events[0]) != reference_kv_events(artifacts):
                            bad.append(("kv_events", len(res.kv_events[0]), len(artifacts["kv_events"])))
                        if token_rows(res.output_events[0], sim.workload) != \
                                reference_tokens(artifacts, sim.workload):
                            bad.append(("output token ids",))
                    ok = not bad
                    outcome = "match" if ok else f"{len(bad)} differences, first {bad[:3]}"
                    tally["match" if ok else "divergent"] += 1
            if not ok and args.keep is not None:
                dest = args.keep / f"seed{args.seed}_case{i:04d}"
                shutil.copytree(case, dest, dirs_exist_ok=True)
                if ref_failed:  # the corner tests expect aisim_fast to stop with these words
                    lines = [ln for ln in ref.stderr.strip().splitlines() if ln.strip()]
                    message = lines[-1] if lines else "failed"
                    for prefix in ("RuntimeError: ", "AISimulate replay failed: ", "engine error: "):
                        message = message.removeprefix(prefix)
                    (dest / "ref.error.txt").write_text(message + "\n")
                (dest / "outcome.txt").write_text(f"{kind} {' '.join(cfg)}\n{outcome}\n")
            print(f"{i:4d} {kind:12s} {'ok ' if ok else 'DIFF'} {outcome[:150]}", flush=True)
    print("tally:", dict(tally), "by kind:", dict(kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
