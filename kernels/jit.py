"""How the kernels are compiled: the cache folder, the compile lock, the first-run
notice, "compile for these arguments", and ``@kernel`` for functions only kernels call.

Compiled kernels are cached on disk. Numba invalidates a cached function only
when the file that defines it changes, not when a function it inlines from
another file does, so a stale cache could silently run old code after an edit.
The cache therefore lives in a folder named after a digest of every kernel
source (subfolders included): any edit selects a fresh folder. ``NUMBA_CACHE_DIR``,
when set, wins. The folder is given to Numba by a cache locator that claims the
kernels' source files and nothing else (``_KernelCacheLocator``): importing the
package changes no Numba setting, and other code's caching is left as it was. Inside
the folder a cached kernel is stamped with the digest, not with its file's mtime, so a
second install of the same sources (another venv, a fresh clone) loads it.

The first run compiles for a while, so it says so first: ``compile_notice(parts)``
prints one line on stderr naming the kernel sets that are not in the cache yet
(``COMPILE_PARTS``), and ``mark_compiled(part)`` records a set once it has run, as
a marker file in the cache folder.
"""

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path

import numba
from numba.core import caching as _caching
from numba.core.registry import CPUDispatcher

_HERE = Path(__file__).resolve().parent
_DIGEST_DIR: list[str] = []  # _digest_dir, once per process


def _digest_dir() -> str:
    """The kernel cache folder of these sources (created; a temp folder when the home
    is not writable)."""
    if _DIGEST_DIR:
        return _DIGEST_DIR[0]
    digest = hashlib.sha256()
    for path in sorted(_HERE.rglob("*.py")):
        digest.update(str(path.relative_to(_HERE)).encode())
        digest.update(path.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = str(base / "aisim_fast" / f"numba-{numba.__version__}-{digest.hexdigest()[:16]}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        # an unwritable home (some CI sandboxes): a per-user temp folder still caches
        import tempfile
        folder = os.path.join(tempfile.gettempdir(), f"aisim_fast-{os.getuid()}", Path(folder).name)
        os.makedirs(folder, exist_ok=True)
    _DIGEST_DIR.append(folder)
    return folder


def cache_root() -> str:
    """Where the kernels are cached: ``NUMBA_CACHE_DIR`` when set, else the digest folder."""
    return numba.config.CACHE_DIR or _digest_dir()


class _KernelCacheLocator(_caching._SourceFileBackedLocatorMixin, _caching._CacheLocator):
    """Numba's cache files of a kernel source file, in the digest folder (one subfolder
    per kernel folder); any other file, or a set ``NUMBA_CACHE_DIR``, is Numba's own."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        room = Path(py_file).resolve().parent.relative_to(_HERE)
        self._cache_path = str(Path(_digest_dir()) / "kernels" / room)

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        # Numba's stamp is the file's mtime and size: a second install of the same
        # sources (another venv, a fresh clone) has other mtimes and would recompile
        # over the cache. The folder is named by the sources' digest, so inside it the
        # digest is the stamp: the cache is keyed by content, not by path or time.
        return Path(_digest_dir()).name

    @classmethod
    def from_function(cls, py_func, py_file):
        if numba.config.CACHE_DIR or not Path(py_file).resolve().is_relative_to(_HERE):
            return None
        return super().from_function(py_func, py_file)


# (Numba 0.68 names the class CacheImpl, earlier releases _CacheImpl)
_CACHE_IMPL = getattr(_caching, "CacheImpl", None) or getattr(_caching, "_CacheImpl")
if _KernelCacheLocator not in _CACHE_IMPL._locator_classes:
    _CACHE_IMPL._locator_classes.insert(0, _KernelCacheLocator)


# Kernel sets compiled on first use: name -> (what it is, cold CPU-seconds measured
# on the development machine, see benchmarks/bench_compile.py). A replay set with
# optional features (kernels.features) is its own set, named by ``kernel_part``.
COMPILE_PARTS = {
    "trace": ("the trace loader", 5),
    "aggregated": ("aggregated replay", 40),
    "disaggregated": ("disaggregated replay", 75),
    "sglang": ("SGLang replay", 70),
    "sglang_disaggregated": ("disaggregated SGLang replay", 80),
    "events": ("the event tables", 5),
    "rank": ("the rank protocol", 100),
}
# what each optional feature adds to a replay set's name and notice, and its cost
FEATURE_PARTS = {
    "kv_router": ("the KV router", 5),
    "attention_dp": ("attention DP", 5),
    "trtllm": ("TRT-LLM", 3),
    "aic": ("op-level timing", 2),
    "tokenization": ("a tokenization pool", 2),
    "sglang_host_loop": ("the SGLang host loop", 3),
    "sglang_frontend": ("SGLang frontend stages", 3),
    "speculation": ("speculative decoding", 3),
    "agentic": ("agentic dependency graphs", 2),
}
_ANNOUNCED: set[str] = set()


def kernel_part(topology: str, features) -> str:
    """The name of a replay kernel set: its topology (a ``COMPILE_PARTS`` key), then
    ``+feature`` for each optional feature its batches compile in."""
    return topology + "".join(f"+{name}" for name, on in zip(features._fields, features)
                              if on is not None)


def _describe(part: str) -> tuple[str, int]:
    base, *extra = part.split("+")
    what, seconds = COMPILE_PARTS[base]
    if extra:
        what += " with " + " and ".join(FEATURE_PARTS[name][0] for name in extra)
        seconds += sum(FEATURE_PARTS[name][1] for name in extra)
    return what, seconds


def _marker(part: str) -> Path:
    # in the digest folder the cache is keyed by content (_KernelCacheLocator): any
    # install of these sources shares it. Numba's own locator (NUMBA_CACHE_DIR set)
    # keys its files by the sources' location too, so there the marker is per location.
    if not numba.config.CACHE_DIR:
        return Path(cache_root()) / f"compiled-{part}"
    where = hashlib.sha256(str(_HERE.resolve()).encode()).hexdigest()[:12]
    return Path(cache_root()) / f"compiled-{part}-{where}"


def compile_notice(parts) -> None:
    """One line on stderr before compiling the kernel sets ``parts`` that this cache
    does not hold yet (each set is announced at most once per process)."""
    missing = [p for p in parts if p not in _ANNOUNCED and not _marker(p).exists()]
    _ANNOUNCED.update(parts)
    if missing:
        what = ", ".join(_describe(p)[0] for p in missing)
        seconds = sum(_describe(p)[1] for p in missing)
        print(f"aisim-fast: compiling kernels for {what} (first run only, about {seconds} s)",
              file=sys.stderr, flush=True)


_LOCK_DEPTH = threading.local()  # cache_lock nesting of the current thread


@contextlib.contextmanager
def cache_lock():
    """Hold the kernel cache folder's lock (exclusive, across processes) while a kernel
    compiles or loads. Numba names a function's cached versions by their number in its
    index: two processes compiling different versions of one function at once (two
    kernel sets share the event-loop closures) both write version 1, and a later run
    loads the wrong code for one of them. An unlockable folder goes unlocked.

    Re-entrant within a thread: an flock belongs to an open file, so a nested call
    that opened the file again would wait for its own caller forever."""
    depth = getattr(_LOCK_DEPTH, "n", 0)
    if depth:
        _LOCK_DEPTH.n = depth + 1
        try:
            yield
        finally:
            _LOCK_DEPTH.n = depth
        return
    _LOCK_DEPTH.n = 1
    try:
        with _cache_flock():
            yield
    finally:
        _LOCK_DEPTH.n = 0


@contextlib.contextmanager
def _cache_flock():
    try:
        fh = open(Path(cache_root()) / "compile.lock", "a")
    except OSError:
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:
            pass
        try:
            yield
        finally:
            try:
                fcntl.flock(fh, fcntl.LOCK_UN)
            except OSError:
                pass


def compile_for(kernel, sig: tuple) -> None:
    """Compile (or load from the cache) ``kernel`` for the argument types ``sig`` under
    the cache lock, unless this process has that version already: the one way a
    kernel set is compiled ahead of its first call."""
    if sig not in kernel.overloads:
        with cache_lock():
            kernel.compile(sig)


def mark_compiled(part: str) -> None:
    """Record that the kernel set ``part`` is compiled and cached."""
    marker = _marker(part)
    if not marker.exists():
        try:
            marker.touch()
        except OSError:
            pass  # an unwritable cache: the notice shows again next time, nothing worse


class KernelOnlyDispatcher(CPUDispatcher):
    """A kernel that only other kernels call: compiled without the CPython and C
    wrappers a call from Python needs (about a quarter of a cold compile: every wrapper
    is lowered and optimized by LLVM for each function), and refusing a call from Python
    with an error rather than entering a wrapper that is not there."""

    def add_overload(self, cres):
        # no entry in the C dispatcher's fast path: it would call the missing wrapper
        self.overloads[tuple(cres.signature.args)] = cres

    def _compile_for_args(self, *args, **kws):
        raise TypeError(f"{self.py_func.__module__}.{self.py_func.__qualname__} is a kernel-only "
                        "function (no CPython wrapper): call it from a kernel, or declare it "
                        "with @njit if Python calls it")


def kernel(**options):
    """``@njit`` for a function that only kernels call (``KernelOnlyDispatcher``):
    ``@kernel(cache=True, _nrt=False)``; the options are ``njit``'s. A function Python
    calls (a batch entry, what the driver or a test calls directly) stays ``@njit``."""
    cache = options.pop("cache", False)
    options.update(nopython=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)

    def wrap(function):
        if numba.config.DISABLE_JIT:
            return function
        dispatcher = KernelOnlyDispatcher(py_func=function, locals={}, targetoptions=options)
        if cache:
            dispatcher.enable_caching()
        return dispatcher
    return wrap
