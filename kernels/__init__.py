"""Numba kernels of aisim_fast (installed as ``aisim_fast.kernels``).

Compiled kernels are cached on disk. Numba invalidates a cached function only
when the file that defines it changes, not when a function it inlines from
another file does, so a stale cache could silently run old code after an edit.
The cache therefore lives in a folder named after a digest of every kernel
source: any edit selects a fresh folder. ``NUMBA_CACHE_DIR``, when set, wins.
"""

import hashlib
import os
from pathlib import Path

import numba

_HERE = Path(__file__).resolve().parent


def _cache_dir() -> str:
    digest = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "aisim_fast" / f"numba-{numba.__version__}-{digest.hexdigest()[:16]}")


if not os.environ.get("NUMBA_CACHE_DIR"):
    _dir = _cache_dir()
    try:
        os.makedirs(_dir, exist_ok=True)
    except OSError:
        # an unwritable home (some CI sandboxes): a per-user temp folder still caches
        import tempfile
        _dir = os.path.join(tempfile.gettempdir(), f"aisim_fast-{os.getuid()}", Path(_dir).name)
        os.makedirs(_dir, exist_ok=True)
    numba.config.CACHE_DIR = _dir
