"""Differential comparison of the kv_router placement with Dynamo's KV router on random
configurations (outside CI; the reference wheel places round robin only).

For each case: a random slice of the bundled Mooncake trace (``differential.random_trace``,
20-300 rows: sometimes slowed, sometimes multi-turn), a random pool (aggregated, 2-6 workers, or a
prefill pool and a decode pool), engine (vLLM / TRT-LLM, block 16 / 32 / 64, tight to
roomy KV pools, small ``max_num_seqs``, small batches, no chunked prefill, lifo / fifo,
now and then no prefix caching), router knobs (overlap credit, prefill load scale) and,
now and then, a closed loop. Dynamo 1.6.1 runs it (``dynamo_kv_replay.py`` in its own
virtualenv, see ``../shared/reference/dynamo/README.md``); aisim_fast replays the case
pinned to the run's placements (``tests/support/dynamo_runs.py``, as the tests do): every
request's timeline and every decision (order, pool, worker, cost, overlap) must be
equal. Dynamo breaks exact cost ties at random, so only pinned replays can be compared
request by request. Divergent cases are kept under ``--keep`` as cases of
``tests/data/kv_router`` (plus ``outcome.txt``).

    python benchmarks/dynamo_differential.py --dyn-python DYNVENV/bin/python --cases 100 \\
        --seed 1 --keep /tmp/kv_divergent
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from differential import random_trace  # noqa: E402
from dynamo_kv_case import write_case  # noqa: E402

from aisim_fast.config.payload import parse_payload  # noqa: E402
from aisim_fast.engine.batch import run_batch
from aisim_fast.engine.simulation import simulation_from_setup  # noqa: E402
from support.dynamo_runs import (  # noqa: E402
    case_payload,
    decision_differences,
    dp_sizes,
    payload_of_call,
    read_rows,
    request_differences,
    router_view_differences,
)


def random_case(rng: random.Random, dp_fraction: float = 0.0) -> tuple[str, list[str]]:
    """(kind, dynamo_kv_replay.py flags) of one random configuration; ``dp_fraction`` of
    them with attention DP (2 or 3 ranks a worker, both pools)."""
    backend = rng.choice(["vllm", "vllm", "trtllm"])
    bs = rng.choice([16, 32, 64])
    engine = {"backend": backend, "block_size": bs,
              "max_num_seqs": rng.choice([2, 4, 16, 256]),
              "max_num_batched_tokens": rng.choice([512, 2048, 8192]),
              "enable_chunked_prefill": True,
              "preemption_mode": rng.choice(["lifo", "fifo"])}
    if rng.random() < 0.25:
        engine["enable_chunked_prefill"] = False
        engine["max_num_batched_tokens"] = 16384
    if rng.random() < 0.1:
        engine["enable_prefix_caching"] = False
    blocks = rng.choice([200, 300, 600, 1500, 16384]) * 64 // bs  # in tokens: 13k to 1M
    flags = ["--block-size", str(bs),
             "--overlap-score-credit", str(rng.choice([0.0, 0.5, 1.0, 1.0, 2.0])),
             "--prefill-load-scale", str(rng.choice([0.5, 1.0, 1.0, 2.0]))]
    if rng.random() < 0.3:
        kind = "disagg"
        flags += ["--prefill-workers", str(rng.randint(1, 3)), "--decode-workers", str(rng.randint(1, 3)),
                  "--num-gpu-blocks", str(blocks)]
    else:
        kind = "agg"
        flags += ["--workers", str(rng.randint(2, 6)), "--num-gpu-blocks", str(blocks)]
    if rng.random() < 0.2:
        flags += ["--concurrency", str(rng.choice([1, 4, 16]))]
        kind += "/closed"
    if dp_fraction > 0:
        dp_rng = random.Random(rng.random())  # drawn last: a seed's other draws stay as they were
        if dp_rng.random() < dp_fraction:
            dp = dp_rng.choice([2, 3])
            flags += ["--dp-size", str(dp)]
            kind += f"/dp{dp}"
    flags += ["--engine-json", json.dumps(engine)]
    return f"{kind}/{backend}", flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dyn-python", required=True, help="python of a virtualenv with ai-dynamo 1.6.1")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", type=Path, default=None, help="folder for divergent cases")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per Dynamo run")
    p.add_argument("--dp-fraction", type=float, default=0.0,
                   help="share of the cases with attention DP (0 keeps earlier seeds' draws)")
    args = p.parse_args()
    tally, kinds = Counter(), Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.cases):
            rng = random.Random(args.seed * 100003 + i)
            work = Path(tmp) / f"case{i:04d}"
            work.mkdir()
            trace = work / "trace.jsonl"
            random_trace(rng, trace, rows_range=(20, 300))
            kind, flags = random_case(rng, args.dp_fraction)
            kinds[kind] += 1
            name = f"dyn_seed{args.seed}_case{i:04d}"
            try:
                dyn = subprocess.run([args.dyn_python, str(ROOT / "benchmarks" / "dynamo_kv_replay.py"),
                                      "--trace", str(trace), "--out", str(work / "run"), *flags],
                                     capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                tally["Dynamo timed out"] += 1
                print(f"{i:4d} {kind:20s} Dynamo timed out after {args.timeout:.0f} s", flush=True)
                continue
            report = work / "run" / "report.json"
            report = json.loads(report.read_text()) if report.exists() else {"summary": {}, "meta": {}}
            summary = report["summary"]
            if dyn.returncode != 0 or summary.get("completed_requests") != summary.get("num_requests") \
                    or report["meta"].get("records_without_trace_line"):
                # a run that stopped or left requests unfinished, or whose log or records
                # could not be matched to its trace: nothing to pin a replay to. A stop
                # (a dead end) is compared with an unpinned replay's: Dynamo's
                # placements are its own draws, so this only tells whether the config
                # stops here too
                message = (dyn.stderr.strip().splitlines() or [""])[-1]
                outcome = f"Dynamo did not finish: {message[-200:]}"
                if (work / "run" / "payload.json").exists() and dyn.returncode != 0:
                    call = json.loads((work / "run" / "payload.json").read_text())
                    unpinned = parse_payload(payload_of_call(call, trace, pin=False))
                    res = run_batch([simulation_from_setup(unpinned)])
                    stopped = res.status[0] != "ok"
                    tally["both stopped" if stopped else "Dynamo stopped, aisim_fast (unpinned) finished"] += 1
                    outcome += f"; aisim_fast unpinned: {res.status[0]} {res.error[0] or ''}"[:200]
                else:
                    tally["Dynamo did not finish"] += 1
                print(f"{i:4d} {kind:20s} {outcome}", flush=True)
                continue
            case_dir = work / "case"
            case_dir.mkdir()
            write_case(work / "run", trace, name, case_dir)
            try:
                setup = parse_payload(case_payload(case_dir, name, pin=True))
            except Exception as exc:  # a field aisim_fast refuses (named in the message)
                bad = [("refused", str(exc))]
            else:
                res = run_batch([simulation_from_setup(setup)])
                if res.status[0] != "ok":
                    bad = [("stopped", res.status[0], res.error[0])]
                else:
                    gold = read_rows(case_dir / f"{name}.csv")
                    call = json.loads((case_dir / f"{name}.payload.json").read_text())
                    bad = request_differences(gold, res.requests[0], *dp_sizes(call))
                    bad += decision_differences(read_rows(case_dir / f"{name}.decisions.csv"), res.routing[0])
                    bad += router_view_differences(gold, res.routing[0])
            ok = not bad
            tally["match" if ok else "divergent"] += 1
            outcome = "match" if ok else f"{len(bad)} differences, first {bad[:3]}"
            if not ok and args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for f in case_dir.iterdir():
                    shutil.copy(f, args.keep / f.name)
                (args.keep / f"{name}.outcome.txt").write_text(f"{kind} {' '.join(flags)}\n{outcome}\n")
            print(f"{i:4d} {kind:20s} {'ok ' if ok else 'DIFF'} {outcome[:160]}", flush=True)
    print("tally:", dict(tally), "by kind:", dict(kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
