"""A dynamo_kv_replay.py run folder as a test case of tests/data/kv_router.

    python benchmarks/dynamo_kv_case.py RUN_DIR TRACE CASE tests/data/kv_router

writes <case>.csv (the golden CSV columns + the router's view, with the record
conversion of ../shared/reference/dynamo/dyn_replay.py), <case>.decisions.csv (every
decision in the run's order: request, turn, trace line, pool, worker, cost,
overlap), <case>.payload.json, <case>.report.json and <case>.pinned.jsonl (the
trace's rows with the run's ``worker``, or ``prefill_worker`` / ``decode_worker``: with
attention DP the rank's scheduler id, ``worker * dp_size + dp_rank``).
"""
import csv
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "reference" / "dynamo"))
from dyn_replay import CSV_FIELDS, _sort_key, load_trace_index, record_to_row  # noqa: E402

# the trace field that pins a decision of each pool (``pin_to_trace_worker``)
PIN_FIELD = {"aggregated": "worker", "prefill": "prefill_worker", "decode": "decode_worker"}


def write_case(run: Path, trace: Path, case: str, dest: Path) -> tuple[int, int]:
    """The run in ``run`` of ``trace`` as the files of ``case`` in ``dest``; returns
    (requests, decisions)."""
    recs = [json.loads(l) for l in open(run / "requests.jsonl")]
    plain, sess = load_trace_index(trace)
    used = set()
    rows = []
    for r in recs:
        row = record_to_row(r, plain, sess, used)
        if row["trace_line"] != r["trace_line"]:
            row["trace_line"] = r["trace_line"]
            if r.get("session_id") is None:
                row["request_id"] = f"request_{r['trace_line']}"
        rows.append(row)
    rows.sort(key=_sort_key)
    with open(dest / f"{case}.csv", "w", newline="", encoding="utf-8") as fh:
        wr = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        wr.writeheader()
        for row in rows:
            wr.writerow({k: ("" if v is None else (repr(v) if isinstance(v, float) else v)) for k, v in row.items()})
    by_line = {row["trace_line"]: row for row in rows}
    kwargs = json.loads((run / "payload.json").read_text())["kwargs"]
    dp_size = {pool: kwargs.get(f"{key}_engine_args", {}).get("dp_size", 1)
               for pool, key in (("aggregated", "extra"), ("prefill", "prefill"), ("decode", "decode"))}
    pins = {}
    with open(run / "decisions.csv") as fh, open(dest / f"{case}.decisions.csv", "w", newline="") as out:
        wr = csv.writer(out)
        wr.writerow(["request_id", "turn_index", "trace_line", "pool", "worker", "dp_rank", "cost",
                     "effective_cached_blocks"])
        for d in csv.DictReader(fh):
            line = int(d["trace_line"])
            row = by_line[line]
            dp_rank = int(d.get("dp_rank") or 0)
            wr.writerow([row["request_id"], row["turn_index"], line, d["pool"], d["worker"], dp_rank, d["logit"],
                         d["effective_cached_blocks"]])
            # a pin names the rank (its scheduler id) with attention DP
            pins.setdefault(line, {})[PIN_FIELD[d["pool"]]] = int(d["worker"]) * dp_size[d["pool"]] + dp_rank
    with open(trace) as fh, open(dest / f"{case}.pinned.jsonl", "w") as out:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            obj.update(pins[lineno])
            out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    shutil.copy(run / "payload.json", dest / f"{case}.payload.json")
    shutil.copy(run / "report.json", dest / f"{case}.report.json")
    return len(rows), sum(len(v) for v in pins.values())


if __name__ == "__main__":
    run_dir, trace_path, name, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    n_requests, n_decisions = write_case(run_dir, trace_path, name, out_dir)
    print(name, n_requests, "requests", n_decisions, "decisions")
