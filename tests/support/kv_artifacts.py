"""The reference's per-token artifacts (``ref_replay.py --artifacts``: KV events, output
tokens) in the shape aisim_fast's tables compare with, shared by
``tests/golden/test_kv_events.py`` and ``benchmarks/differential.py --kv-artifacts``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

DATA = Path(__file__).resolve().parents[1] / "data"
# the single-worker reference runs with per-token artifacts: tiny20 and tests/data/kv_events/*
ARTIFACT_CASES = ["tiny20"] + sorted(p.name for p in (DATA / "kv_events").iterdir() if p.is_dir())


def artifact_case(name: str, emit_kv_events: bool = False):
    """(ReplaySetup of the reference run ``name``, its artifacts); ``emit_kv_events``
    turns the rank's KV events on in the payload."""
    from aisim_fast.config.payload import parse_payload

    if name == "tiny20":
        spec = json.loads((DATA / "golden" / "tiny20_vllm_agg1.spec.json").read_text())
        where = dict(trace_override=str(DATA / "traces" / spec["traffic"]["trace_path"]))
        artifacts = DATA / "golden" / "tiny20_vllm_agg1.artifacts.json"
    else:
        folder = DATA / "kv_events" / name
        spec = json.loads((folder / "spec.json").read_text())
        where = dict(base_dir=folder)
        artifacts = folder / "ref.artifacts.json"
        if not artifacts.exists():  # the larger runs are kept compressed
            artifacts = folder / "ref.artifacts.json.gz"
    if emit_kv_events:
        spec["spec"]["engine"]["rank"]["emit_kv_events"] = True
    text = gzip.decompress(artifacts.read_bytes()) if artifacts.suffix == ".gz" else artifacts.read_text()
    return parse_payload(spec, **where), json.loads(text)


def row_of_uuid(workload):
    """Canonical request UUID ordinal n is the n-th row in plan order (session-major)."""
    order = np.argsort(workload.session, kind="stable")
    return lambda uuid: int(order[int(uuid.replace("-", ""), 16) - 1])


def reference_kv_events(artifacts) -> list:
    """One tuple per block: (event_id, at_ms, kind, position, block_hash, parent_hash,
    tokens_hash), parent and tokens hash None where the reference has none."""
    rows = []
    for item in artifacts["kv_events"]:
        event = item["event"]
        data = event["data"]
        if event["dp_rank"] != 0:
            raise ValueError("one attention-DP rank per worker")
        if "stored" in data:
            if data["stored"].get("start_position") is not None:
                raise ValueError("native schedulers give no start_position")
            for k, block in enumerate(data["stored"]["blocks"]):
                rows.append((event["event_id"], item["observed_at_ms"], "stored", k,
                             block["block_hash"], data["stored"]["parent_hash"], block["tokens_hash"]))
        else:
            for k, h in enumerate(data["removed"]["block_hashes"]):
                rows.append((event["event_id"], item["observed_at_ms"], "removed", k, h, None, None))
    return rows


def kv_event_rows(frame: pd.DataFrame) -> list:
    """A ``kv_events`` table of one worker as ``reference_kv_events`` tuples."""
    def value(x):
        return None if x is pd.NA else int(x)

    return [(int(e), float(t), k, int(pos), int(h), value(ph), value(th))
            for e, t, k, pos, h, ph, th in zip(frame["event_id"], frame["at_ms"], frame["kind"],
                                               frame["position"], frame["block_hash"],
                                               frame["parent_hash"], frame["tokens_hash"])]


def reference_tokens(artifacts, workload) -> dict:
    """{trace row: [(token id, time), ...]} of every emitted token."""
    row_of = row_of_uuid(workload)
    out = {}
    for o in artifacts["outputs"]:
        if o["token_id"] is not None:
            out.setdefault(row_of(o["request_id"]), []).append((o["token_id"], o["observed_at_ms"]))
    return out


def token_rows(frame: pd.DataFrame, workload) -> dict:
    """An ``output_events`` table as ``reference_tokens`` gives the reference's."""
    row = {(n, t): r for r, (n, t) in enumerate(zip(workload.request_name, workload.turn_index))}
    out = {}
    for n, t, token, at in zip(frame["request_id"], frame["turn_index"], frame["token_id"], frame["time_ms"]):
        out.setdefault(row[(n, t)], []).append((int(token), float(at)))
    return out
