"""Runs of Dynamo's KV router (``tests/data/kv_router``, ``benchmarks/dynamo_differential.py``):
a run's call as an aisim_fast payload, and how a replay pinned to the run's placements
is compared with the run.

A run folder (``benchmarks/dynamo_kv_replay.py`` then ``benchmarks/dynamo_kv_case.py``)
holds per case ``<case>.payload.json`` (the exact call), ``<case>.csv`` (per-request
records in the golden CSV's columns), ``<case>.decisions.csv`` (every routing decision
in the router's order) and ``<case>.pinned.jsonl`` (the trace, each row carrying the
workers the run chose).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .parity_rules import EXACT_INT_COLUMNS, EXACT_TIME_COLUMNS, as_number, workers_as_scheduler_ids

# compared exactly: a pinned replay runs the run's engines on the run's placements
TIMELINE_COLUMNS = EXACT_TIME_COLUMNS + EXACT_INT_COLUMNS + ("ttft_ms", "tpot_ms", "e2e_ms")


def payload_of_call(call: dict, trace, *, pin: bool, seed: int = 0, **knobs) -> dict:
    """The aisim_fast payload of a Dynamo replay call (``<case>.payload.json``) on
    ``trace``: the same topology, engine, router knobs and load; ``knobs`` override
    router settings (``pin``: place each row on its recorded worker)."""
    kwargs = call["kwargs"]
    router = call["router_config_json"]
    config = {"overlap_score_credit": router["overlap_score_credit"],
              "prefill_load_scale": router["prefill_load_scale"],
              "router_temperature": router["router_temperature"],
              "pin_to_trace_worker": pin, "seed": seed, **knobs}
    if "prefill_engine_args" in kwargs:
        def pool(role):
            args = kwargs[f"{role}_engine_args"]
            engine = dict(args["engine"])
            del engine["worker_type"]
            return {"rank": engine, "dp_size": args.get("dp_size", 1)}
        topology = {"kind": "disaggregated",
                    "prefill": {"initial_workers": kwargs["num_prefill_workers"]},
                    "decode": {"initial_workers": kwargs["num_decode_workers"]}}
        engine = {"prefill": pool("prefill"), "decode": pool("decode")}
    else:
        topology = {"kind": "aggregated", "workers": {"initial_workers": kwargs["num_workers"]}}
        engine = {"rank": dict(kwargs["extra_engine_args"]["engine"]),
                  "dp_size": kwargs["extra_engine_args"].get("dp_size", 1)}
    traffic = {"trace_path": str(trace), "trace_block_size": kwargs["trace_block_size"]}
    if kwargs.get("replay_concurrency") is not None:
        traffic.update(load_type="concurrency", replay_concurrency=kwargs["replay_concurrency"])
    return {"spec": {"topology": topology, "engine": engine,
                     "adapters": {"placement": {"provider": "kv_router", "config": config}}},
            "traffic": traffic}


def case_payload(data: Path, case: str, *, pin: bool, seed: int = 0, trace=None, **knobs) -> dict:
    """``payload_of_call`` of the case ``case`` in ``data``, on its pinned trace."""
    call = json.loads((data / f"{case}.payload.json").read_text())
    return payload_of_call(call, trace or data / f"{case}.pinned.jsonl", pin=pin, seed=seed, **knobs)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def dp_sizes(call: dict) -> tuple[int, int]:
    """(dp_size of the aggregated or decode pool, of the prefill pool) of a run's call."""
    kwargs = call["kwargs"]
    if "prefill_engine_args" in kwargs:
        return (kwargs["decode_engine_args"].get("dp_size", 1), kwargs["prefill_engine_args"].get("dp_size", 1))
    return kwargs["extra_engine_args"].get("dp_size", 1), 1


def request_differences(gold: list[dict], requests, dp_size: int = 1, prefill_dp_size: int = 1) -> list[tuple]:
    """[(request, turn, column, run's cell, replay's cell)] over the timeline columns,
    exact; a request missing from either side is one entry. With attention DP the
    run's workers are ranks (scheduler ids, ``worker * dp_size + dp_rank``)."""
    requests = workers_as_scheduler_ids(requests, dp_size, prefill_dp_size)
    cand = {(r["request_id"], int(r["turn_index"])): r for r in requests.to_dict("records")}
    diffs = [(key[0], key[1], "missing from the run", None, None)
             for key in cand.keys() - {(row["request_id"], int(row["turn_index"])) for row in gold}]
    for row in gold:
        key = (row["request_id"], int(row["turn_index"]))
        mine = cand.get(key)
        if mine is None:
            diffs.append((*key, "missing from the replay", None, None))
            continue
        for col in TIMELINE_COLUMNS:
            g, c = as_number(row.get(col)), as_number(mine.get(col))
            if not (g is None and c is None) and g != c:
                diffs.append((*key, col, g, c))
    return diffs


def decision_differences(decisions: list[dict], routing) -> list[tuple]:
    """[(decision index, field, run's value, replay's value)]: the routing log against
    the run's decisions in the run's order (request, pool, worker, DP rank, cost,
    overlap)."""
    logged = routing.to_dict("records")
    diffs = []
    if len(logged) != len(decisions):
        diffs.append((None, "decisions", len(decisions), len(logged)))
    for i, (d, r) in enumerate(zip(decisions, logged)):
        want = {"request": (d["request_id"], int(d["turn_index"])), "pool": d.get("pool", "aggregated"),
                "worker": int(d["worker"]), "dp_rank": int(d.get("dp_rank") or 0), "cost": float(d["cost"]),
                "overlap_blocks": float(d["effective_cached_blocks"])}
        got = {"request": (r["request_id"], int(r["turn_index"])), "pool": r["pool"], "worker": r["worker"],
               "dp_rank": r["dp_rank"], "cost": r["cost"], "overlap_blocks": r["overlap_blocks"]}
        diffs.extend((i, k, want[k], got[k]) for k in want if want[k] != got[k])
    return diffs


def router_view_differences(gold: list[dict], routing) -> list[tuple]:
    """[(request, turn, field, run's value, replay's value)]: each request's overlap-aware
    decision (aggregated or prefill) against the run's record of it: the chosen
    worker's overlap and the best any worker offered; decode decisions are
    overlap-blind (0)."""
    aware = {(r["request_id"], int(r["turn_index"])): r for r in routing.to_dict("records")
             if r["pool"] != "decode"}
    diffs = []
    for row in gold:
        key = (row["request_id"], int(row["turn_index"]))
        r = aware.get(key)
        if r is None:
            diffs.append((*key, "no overlap-aware decision", None, None))
            continue
        for field, column in (("overlap_blocks", "router_selected_overlap_blocks"),
                              ("best_overlap_blocks", "router_best_available_overlap_blocks")):
            if r[field] != int(row[column]):
                diffs.append((*key, field, int(row[column]), r[field]))
    decode = routing[routing["pool"] == "decode"]
    blind = (decode["overlap_blocks"] == 0) & (decode["best_overlap_blocks"] == 0)
    diffs.extend((r["request_id"], r["turn_index"], "decode overlap", 0, r["overlap_blocks"])
                 for r in decode[~blind].to_dict("records"))
    return diffs
