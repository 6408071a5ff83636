#!/usr/bin/env python3
"""Run the reference (the ``aisimulate`` wheel, in its own virtualenv) on an execution
payload with edits, and write what the tests keep of it.

    /path/to/refvenv/bin/python benchmarks/ref_payload_run.py GOLDEN.spec.json OUT \
        spec.engine.dp_size=2 spec.topology.workers.initial_workers=1 ...

Each ``dotted.path=JSON`` edit sets one field of the payload (objects are created on
the way). A relative ``traffic.trace_path`` (or ``trace_paths`` entry) is looked up next to the spec, then in
``../shared/reference/traces``. Writes ``OUT.spec.json`` (the payload as run, with an
absolute trace path), ``OUT.csv`` (the per-request CSV in the golden format, through
``../shared/reference/ref_replay.py``), ``OUT.jsonl`` (the raw per-request records:
routing history with scheduler ids and dp ranks) and ``OUT.report.json``. The
project never imports the wheel; only this script, run by hand, does."""

import json
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, str(SHARED))
    import aisimulate._runtime as runtime  # noqa: E402
    import ref_replay  # noqa: E402  (the shared golden writer)

    spec, out = Path(argv[0]), argv[1]
    payload = json.loads(spec.read_text())
    for edit in argv[2:]:
        key, _, value = edit.partition("=")
        node = payload
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = json.loads(value)
    def found(name: str) -> str:
        trace = Path(name)
        if trace.is_absolute():
            return name
        # next to the spec; a captured CLI payload's folder's parent (cli-payloads/traces);
        # the shared traces
        for place in (spec.parent / trace, spec.parent.parent / trace, SHARED / "traces" / trace):
            if place.exists():
                return str(place.resolve())
        return name
    traffic = payload.get("traffic") or {}
    if traffic.get("trace_path"):
        traffic["trace_path"] = found(traffic["trace_path"])
    if traffic.get("trace_paths"):
        traffic["trace_paths"] = [found(name) for name in traffic["trace_paths"]]
    Path(out + ".spec.json").write_text(json.dumps(payload, indent=1) + "\n")
    report = json.loads(runtime.run_replay_json(json.dumps(payload)))
    records = report.pop("per_request", []) or []
    ref_replay.write_csv(Path(out + ".csv"), records)
    with open(out + ".jsonl", "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    Path(out + ".report.json").write_text(json.dumps(report, indent=1) + "\n")
    print({k: report.get(k) for k in ("num_requests", "completed_requests", "mean_ttft_ms", "duration_ms")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
