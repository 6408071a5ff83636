"""Loading traces of every format at growing sizes: wall seconds and peak memory per
format and row count, each load in a fresh process (so peak RSS is the load's own).

    python benchmarks/bench_trace_formats.py [--rows 250000,1000000] [--rounds 2]

The traces are written first (into a temporary folder): Mooncake rows with 4 hash ids
(about 2k-token prompts) in single-turn form (``mooncake``) and as sessions of 4 turns
of 500 new tokens each (``mooncake-delta``, whose prompts grow to 2k tokens with the
history: the same token count), as agentic graphs (``agentic_mooncake`` v2: plays of
4 requests, each released 100 ms after the one before completes), the Azure CSV layout
and BurstGPT's. For each format
the table shows, per row count, the best wall seconds over the rounds, seconds per
million rows (flat = linear in rows) and the peak RSS of the loading process, also
over a bare process's (the package imported, nothing loaded; the least of the rounds). Rounds alternate the formats
so that a shared machine's swings fall on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FORMATS = ("mooncake", "mooncake-delta", "agentic_mooncake", "azure", "burstgpt")
_CHILD = r"""
import json, resource, sys, time
from aisim_fast.trace.formats import load_trace
path, fmt = sys.argv[1], sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
w = None if fmt == "none" else load_trace(path, fmt, trace_block_size=512)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": peak, "base_kib": before,
                  "rows": 0 if w is None else w.num_requests}))
"""


def write_traces(folder: Path, rows: int) -> dict:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    ts = np.sort(rng.integers(0, rows * 10, rows))
    out = {}
    plain = folder / f"mooncake_{rows}.jsonl"
    with open(plain, "w") as fh:
        for i in range(rows):
            h = 4 * i
            fh.write(f'{{"timestamp":{ts[i]},"input_length":2000,"output_length":100,'
                     f'"hash_ids":[{h},{h + 1},{h + 2},{h + 3}]}}\n')
    out["mooncake"] = plain
    delta = folder / f"delta_{rows}.jsonl"
    with open(delta, "w") as fh:
        for i in range(rows):
            s, turn = divmod(i, 4)
            extra = f'"timestamp":{ts[s * 4]},' if turn == 0 else '"delay":100,'
            fh.write(f'{{"session_id":"s{s}",{extra}"input_length":500,"output_length":25,"hash_ids":[{i}]}}\n')
    out["mooncake-delta"] = delta
    graph = folder / f"agentic_{rows}.jsonl"
    with open(graph, "w") as fh:
        fh.write('{"schema":"dynamo.agentic_mooncake","version":2,"block_size":512,"hash_id_scope":"local",'
                 '"source":{"format":"bench","digest":"d"}}\n')
        for i in range(rows):
            play, node = divmod(i, 4)
            h = 4 * i
            if node == 0:
                timing = f'"not_before_ms":{float(ts[play * 4])},"dependencies":[]'
            else:
                timing = (f'"not_before_ms":0.0,"dependencies":[{{"request_id":"p{play}-{node - 1}",'
                          f'"trigger":"completion","delay_ms":100.0,"relation":"replay_barrier"}}]')
            fh.write(f'{{"request_id":"p{play}-{node}","play_id":"p{play}","session_id":"p{play}","model":"m",'
                     f'"input_length":2000,"output_length":100,"hash_ids":[{h},{h + 1},{h + 2},{h + 3}],'
                     f'{timing}}}\n')
    out["agentic_mooncake"] = graph
    start = pd.Timestamp("2023-11-16 18:00:00")
    stamps = (start + pd.to_timedelta(ts, unit="ms")).strftime("%Y-%m-%d %H:%M:%S.%f")
    lengths = rng.integers(10, 4000, rows)
    outs = rng.integers(0, 500, rows)
    azure = folder / f"azure_{rows}.csv"
    pd.DataFrame({"TIMESTAMP": stamps, "ContextTokens": lengths, "GeneratedTokens": outs}).to_csv(azure, index=False)
    out["azure"] = azure
    burst = folder / f"burstgpt_{rows}.csv"
    pd.DataFrame({"Timestamp": ts // 1000, "Model": "ChatGPT", "Request tokens": lengths,
                  "Response tokens": outs, "Total tokens": lengths + outs,
                  "Log Type": "Conversation log"}).to_csv(burst, index=False)
    out["burstgpt"] = burst
    return out


def load_once(path: Path, fmt: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), fmt], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="250000,1000000")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="aisim_fast_formats_") as tmp:
        folder = Path(tmp)
        traces = {n: write_traces(folder, n) for n in sizes}
        best: dict = {}
        base = None
        for _ in range(args.rounds):
            # the bare process's peak, least of the rounds (what every load adds to)
            peak = load_once(traces[sizes[0]]["mooncake"], "none")["peak_kib"]
            base = peak if base is None else min(base, peak)
            for n in sizes:
                for fmt in FORMATS:
                    r = load_once(traces[n][fmt], fmt)
                    assert r["rows"] == n, (fmt, n, r)
                    key = (fmt, n)
                    old = best.get(key)
                    best[key] = r if old is None or r["seconds"] < old["seconds"] else \
                        {**old, "peak_kib": max(old["peak_kib"], r["peak_kib"])}
        print(f"baseline (interpreter + package): {base / 1024:,.0f} MiB peak RSS")
        print(f"{'format':16s} {'rows':>10s} {'seconds':>9s} {'s / 1M rows':>12s} {'peak MiB':>9s} "
              f"{'over base':>10s}")
        for fmt in FORMATS:
            for n in sizes:
                r = best[(fmt, n)]
                print(f"{fmt:16s} {n:>10,d} {r['seconds']:>9.2f} {r['seconds'] / n * 1e6:>12.2f} "
                      f"{r['peak_kib'] / 1024:>9,.0f} {(r['peak_kib'] - base) / 1024:>10,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
