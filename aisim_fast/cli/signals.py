"""SIGTERM during a run: remembered, then raised as an interrupt where it is safe (never
inside a folder's commit)."""

from __future__ import annotations

from aisim_fast.io import run_folder


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that a run being written cleans up."""


# a SIGTERM that came while llvmlite ran Python code from a native callback (loading
# or compiling a kernel): raised there, the exception would be printed and lost, so it
# is raised at the next check (raise_pending_sigterm) instead
PENDING_SIGTERM = [False]


def on_sigterm(signum, frame):
    if run_folder.COMMITTED[0] is not None or run_folder.COMMITTING[0]:
        return  # the run folder is (being) written: finish, print the summary, exit 0
    f = frame
    while f is not None:
        if "llvmlite" in f.f_code.co_filename:
            PENDING_SIGTERM[0] = True
            return
        f = f.f_back
    raise Terminated()


def raise_pending_sigterm() -> None:
    if PENDING_SIGTERM[0]:
        PENDING_SIGTERM[0] = False
        raise Terminated()
