"""Arrays that grow at their end in amortized O(appended): views of buffers with room.

A simulation fed one request at a time (a rank driven Submit by Submit) appends a few
rows to tables that hold every earlier request; rebuilding those tables per append
costs what they hold, so a long run goes quadratic. ``append_into`` writes the new
parts past the old end of a buffer kept by the caller and returns a view of exactly
the used length.
"""

from __future__ import annotations

import numpy as np


def append_into(buffers: dict, name: str, kept: np.ndarray, new_parts) -> np.ndarray:
    """``kept`` followed by ``new_parts`` (a list of arrays), as a view of the buffer
    ``buffers[name]``: written in place after ``kept`` when ``kept`` is the latest view
    this function returned of that buffer and the rest fits, else into a new buffer
    with room for as much again (so appending to an older, shorter view copies and
    never overwrites what a later view holds)."""
    n_new = sum(len(part) for part in new_parts)
    n = len(kept) + n_new
    buf = buffers.get(name)
    used = buffers.get((name, "used"), -1)
    if buf is None or len(buf) < n or len(kept) != used or not _is_prefix_of(kept, buf):
        buf = np.empty(max(n + len(kept), 16), kept.dtype)
        buf[:len(kept)] = kept
        buffers[name] = buf
    buffers[(name, "used")] = n
    at = len(kept)
    for part in new_parts:
        buf[at:at + len(part)] = part
        at += len(part)
    return buf[:n]


def _is_prefix_of(view: np.ndarray, buf: np.ndarray) -> bool:
    if len(view) == 0:
        return True
    return (view.base is buf and view.dtype == buf.dtype and view.strides == buf.strides
            and view.__array_interface__["data"][0] == buf.__array_interface__["data"][0])
