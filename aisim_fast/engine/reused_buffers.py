"""The kernel state's largest arrays, kept for the next run of the same process.

A run's biggest arrays are written before they are read: the request rows, the
per-entry lease and key arrays of the requests, SGLang's radix page slots, the vLLM /
TRT-LLM block arenas and prefix tables.
Fresh from the allocator, each of their pages is faulted in and zeroed by the
operating system on first touch: in a warm 10k-request SGLang replay that is about a
tenth of the run (260 MB of pages), more when two threads fault at once. A process
that runs again (a sweep's batches, a notebook's repeated calls, the rank protocol's
sessions) takes them from here instead, with their pages already mapped.

``empty(name, shape, dtype)`` is ``np.empty`` for arrays under ``MIN_KEPT_BYTES``;
above it, a view of the buffer kept under ``name`` when that buffer is idle and big
enough, else of a new buffer (kept when the old one was idle). A kept buffer is idle
when nothing but this module refers to it: every view of a numpy array, however
derived, refers to the buffer that owns the memory, so a buffer whose views are all
gone is free, and one that a result or a live run still sees is never lent twice.
The contents are whatever the last run left: callers write before they read, as
with ``np.empty``.

``release()`` drops the kept buffers (their memory goes back when no run holds
them); at most one buffer per name is kept, so a process keeps about one run's
scratch.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_KEPT_BYTES = 1 << 20

_kept: dict[str, np.ndarray] = {}  # name -> 1-D uint8 buffer
_lock = threading.Lock()


def _idle(name: str) -> bool:
    # references: the dict's, and getrefcount's argument
    return sys.getrefcount(_kept[name]) == 2


def empty(name: str, shape, dtype) -> np.ndarray:
    """An uninitialized array of ``shape`` and ``dtype``, in the buffer kept as
    ``name`` when it is idle and large enough (see the module)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n_bytes < MIN_KEPT_BYTES:
        return np.empty(shape, dtype)
    with _lock:
        if name in _kept and _idle(name) and _kept[name].nbytes >= n_bytes:
            buf = _kept[name]
        else:
            buf = np.empty(n_bytes, np.uint8)
            if name not in _kept or _idle(name):
                _kept[name] = buf
        return buf[:n_bytes].view(dtype).reshape(shape)


def kept_bytes() -> int:
    """Bytes of the buffers kept now (lent or idle)."""
    with _lock:
        return sum(buf.nbytes for buf in _kept.values())


def release() -> None:
    """Keep no buffer: the memory of each goes back once no run holds a view of it."""
    with _lock:
        _kept.clear()
