"""The kernel cache is keyed by the sources' content: a second install of the same
sources (another venv, a fresh clone: another path, other mtimes) loads what the first
compiled, and says nothing about compiling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import aisim_fast
import aisim_fast.kernels
from support.paths import DATA_DIR

PROBE = ("from aisim_fast.trace.workload import load_mooncake; from aisim_fast.kernels.trace import scan; "
         f"load_mooncake({str(DATA_DIR / 'traces' / 'mooncake_tiny20.jsonl')!r}); "
         "print(len(scan.scan_simple_trace.stats.cache_misses))")


def _install(root: Path, mtime: int | None) -> Path:
    package = root / "aisim_fast"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(aisim_fast.__file__).parent, package, copy_function=shutil.copy,
                    ignore=shutil.ignore_patterns("__pycache__", "kernels"))
    shutil.copytree(Path(aisim_fast.kernels.__file__).parent, package / "kernels", copy_function=shutil.copy,
                    ignore=skip)
    if mtime is not None:
        for path in package.rglob("*.py"):
            os.utime(path, (mtime, mtime))
    return root


def test_a_second_install_loads_the_first_ones_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    runs = []
    for name, mtime in (("first", None), ("second", 1_000_000_000)):
        root = _install(tmp_path / name, mtime)
        runs.append(subprocess.run([sys.executable, "-c", PROBE], cwd=root, env={**env, "PYTHONPATH": str(root)},
                                   capture_output=True, text=True, timeout=600))
    first, second = runs
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "compiling kernels for the trace loader" in first.stderr and first.stdout.strip() == "1"
    assert "compiling" not in second.stderr and second.stdout.strip() == "0"
