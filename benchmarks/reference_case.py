"""Make a reference case folder for the corner tests (outside CI, needs the reference).

    python benchmarks/reference_case.py tests/data/disagg_corners/NAME --trace T.jsonl \\
        --ref-python /tmp/refvenv/bin/python -- <ref_replay.py flags>

Runs ``../shared/reference/ref_replay.py`` on the trace with the flags and writes into
the folder: ``trace.jsonl``, ``spec.json`` (the payload exactly as the reference ran
it), ``ref.csv`` and ``ref.report.json``, or ``ref.error.txt`` (the reference's
message) when the reference aborts, and ``flags.txt``. The trace path inside
``spec.json`` is made relative so the folder can move.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REF = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "ref_replay.py"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--ref-python", default="/tmp/refvenv/bin/python")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    flags = argv[cut + 1:]
    out = args.folder
    out.mkdir(parents=True, exist_ok=True)
    if args.trace.resolve() != (out / "trace.jsonl").resolve():
        shutil.copyfile(args.trace, out / "trace.jsonl")
    for name in ("ref.csv", "ref.report.json", "ref.error.txt"):
        (out / name).unlink(missing_ok=True)
    run = subprocess.run([args.ref_python, str(REF), "--trace", str(out / "trace.jsonl"), *flags,
                          "--csv", str(out / "ref.csv"), "--report", str(out / "ref.report.json"),
                          "--dump-spec", str(out / "spec.json")], capture_output=True, text=True)
    if not (out / "spec.json").exists():
        print(run.stderr, file=sys.stderr)
        return 1
    spec = json.loads((out / "spec.json").read_text())
    spec["traffic"]["trace_path"] = "trace.jsonl"
    (out / "spec.json").write_text(json.dumps(spec, indent=1) + "\n")
    (out / "flags.txt").write_text(" ".join(flags) + "\n")
    if run.returncode != 0 or not (out / "ref.csv").exists():
        lines = [ln for ln in run.stderr.strip().splitlines() if ln.strip()]
        message = lines[-1] if lines else "failed"
        for prefix in ("RuntimeError: ", "AISimulate replay failed: ", "engine error: "):
            message = message.removeprefix(prefix)  # the reference's own words remain
        (out / "ref.error.txt").write_text(message + "\n")
        print("reference aborted:", message)
    else:
        print("reference ok:", sum(1 for _ in open(out / "ref.csv")) - 1, "rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
