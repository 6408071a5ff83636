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


def interruptible(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a daemon thread while this (the main) thread waits in
    short joins, so that Ctrl-C and SIGTERM are handled within a fraction of a second even
    while the work sits in native code that does not check for signals (LLVM compiling a
    kernel for tens of seconds). Returns its result or raises its exception; an
    interrupt leaves the thread to die with the process."""
    import threading

    outcome: dict = {}

    def work():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=work, name="aisim-fast-work", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        raise_pending_sigterm()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
