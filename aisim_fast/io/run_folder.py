"""Run outputs: per-request and per-pass parquet tables plus the summary JSON.

A run folder holds

* ``requests.parquet`` -- one row per request, in request-id (uuid) order;
* ``passes.parquet``   -- one row per forward pass (left out when passes were not recorded),
  written part by part as the pass log was drained: a run split per worker has its
  rows by worker, each in time order (sort by ``start_ms`` for one timeline);
* ``summary.json``     -- the reference summary keys (``report.summarize``).

Both parquet files carry the schema metadata keys ``aisim_fast.version`` and
``aisim_fast.config`` (JSON of the resolved configuration); ``summary.json`` holds the
same two entries next to the metrics.

Writing is all-or-nothing: the files go into a temporary sibling folder that is renamed
into place only once everything is written, so an error (or Ctrl-C) never leaves a
half-written run behind. With ``overwrite`` the old folder is replaced only after the
new one is complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from aisim_fast.engine.tables import EVENT_TABLES, TABLES
from aisim_fast.version import __version__

REQUESTS_FILE = TABLES["requests"].file
PASSES_FILE = TABLES["passes"].file
SUMMARY_FILE = "summary.json"
# the optional tables a run folder may hold, by table name (engine.tables)
EVENT_FILES = {name: TABLES[name].file for name in EVENT_TABLES}
RUN_FILES = (REQUESTS_FILE, PASSES_FILE, SUMMARY_FILE, *EVENT_FILES.values())

META_VERSION_KEY = "aisim_fast.version"
META_CONFIG_KEY = "aisim_fast.config"


class OutputError(RuntimeError):
    """The output folder cannot be used (exists, is a file, ...) or writing failed."""


# ---------------------------------------------------------------------------------------
# output folder


def _listing(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.iterdir())


def _probe_writable(out: Path) -> None:
    """Create and remove a file where the run's staging folder will go (next to ``out``,
    in its nearest existing ancestor): a folder we cannot write to fails now, not after
    the simulation."""
    where = Path(os.path.abspath(out)).parent
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        raise OutputError(f"cannot create {out}: {where} is a file, not a folder")
    probe = where / f".{out.name}.probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror or exc} in {where}") from None


_STAGING = re.compile(r"^\..+\.partial-(\d+)-[0-9a-f]{8}$")


def remove_dead_staging(out: Path) -> list[Path]:
    """Remove the staging folders (``.<name>.partial-<pid>-<hex>``) that killed runs left
    next to ``out`` -- of any run into that parent folder, not only into ``out`` -- when
    their process is provably gone (its pid is in the name)."""
    out = Path(os.path.abspath(out))
    removed = []
    if not out.parent.is_dir():
        return removed
    for entry in out.parent.iterdir():
        match = _STAGING.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def check_out_dir(out_dir, overwrite: bool = False, probe: bool = False,
                  owned: tuple[str, ...] = RUN_FILES) -> Path:
    """Refuse an output folder we must not write to; return it as a Path.

    Called before a run starts (so a long simulation is not wasted; ``probe`` also
    creates and removes a file where the run will write) and again by ``write_run``.
    With ``overwrite``, only a folder that holds nothing but the files of such a run
    (``owned``) is replaced: the whole folder is swapped out, and a mistyped ``--out``
    (".", a home folder) must not delete unrelated files.
    """
    out = Path(out_dir)
    if probe:
        _probe_writable(out)
    if not out.exists():
        if out.is_symlink():
            raise OutputError(f"output folder {out} is a broken symbolic link; remove it or "
                              "choose another --out")
        return out
    if not out.is_dir():
        raise OutputError(f"output path {out} exists and is not a folder; choose another --out")
    if out.is_symlink():
        raise OutputError(f"output folder {out} is a symbolic link; give the real folder as --out")
    entries = _listing(out)
    if not entries:
        return out
    if not overwrite:
        raise OutputError(f"output folder {out} exists and is not empty; pass --overwrite to "
                          "replace it or choose another --out")
    foreign = [name for name in entries if name not in owned]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(f"refusing to overwrite {out}: it holds files that are not run "
                          f"outputs ({shown}); remove them or choose another --out")
    return out


def _json_safe(value):
    """Plain JSON types; non-finite floats become null (JSON has no NaN/inf)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"cannot store {type(value).__name__} value {value!r} in JSON")


def _config_json(resolved_config: dict) -> str:
    return json.dumps(_json_safe(resolved_config), sort_keys=True, allow_nan=False)


def _with_run_metadata(table: pa.Table, config_json: str) -> pa.Table:
    metadata = dict(table.schema.metadata or {})
    metadata[META_VERSION_KEY.encode()] = __version__.encode()
    metadata[META_CONFIG_KEY.encode()] = config_json.encode()
    return table.replace_schema_metadata(metadata)


# rows per row group when a table is written from parts
ROW_GROUP_ROWS = 1 << 20


# Per-request tables are written without dictionary pages: their ids are unique and
# their times distinct, so a dictionary only costs (100k requests: 83 ms and 10.5 MB
# with, 35 ms and 9.6 MB without). The pass log's small counts do compress by it.
REQUEST_TABLE_OPTIONS = {"use_dictionary": False}


def _write_parquet(frame, path: Path, config_json: str, options: dict | None = None) -> None:
    """A DataFrame, or an iterable of DataFrames or Arrow tables with the same columns
    written as consecutive row groups of about ROW_GROUP_ROWS rows (so a table too
    big to hold twice is never joined in memory). ``options``: of the Parquet writer."""
    options = options or {}
    if isinstance(frame, pd.DataFrame):
        pq.write_table(_with_run_metadata(pa.Table.from_pandas(frame, preserve_index=False),
                                          config_json), path, **options)
        return
    writer = None
    pending: list = []
    pending_rows = 0

    def flush():
        nonlocal writer, pending, pending_rows
        tables = [part if isinstance(part, pa.Table) else pa.Table.from_pandas(part, preserve_index=False)
                  for part in pending]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if writer is None:
            table = _with_run_metadata(table, config_json)
            writer = pq.ParquetWriter(path, table.schema, **options)
        writer.write_table(table.replace_schema_metadata(writer.schema.metadata))
        pending, pending_rows = [], 0

    try:
        for part in frame:
            pending.append(part)
            pending_rows += len(part)
            if pending_rows >= ROW_GROUP_ROWS:
                flush()
        if pending or writer is None:
            if not pending:
                raise ValueError("a table written from parts needs at least one part")
            flush()
    finally:
        if writer is not None:
            writer.close()


def _make_parents(path: Path, created: list[Path]) -> None:
    """mkdir -p of ``path``'s parents, appending each folder it creates to ``created``
    (deepest last) so that a failed run can remove them again."""
    for parent in reversed(path.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass


def _fresh_sibling(out: Path, role: str) -> Path:
    """An unused hidden name next to ``out`` (same file system, so renames are atomic)."""
    while True:
        candidate = out.with_name(f".{out.name}.{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        if not os.path.lexists(candidate):
            return candidate


def write_run(out_dir, requests_df: pd.DataFrame, passes_df: pd.DataFrame | None,
              summary: dict, resolved_config: dict, overwrite: bool = False,
              events: dict[str, pd.DataFrame] | None = None) -> dict[str, Path]:
    """Write a run folder atomically; return {"requests": path, ...} of the files written.

    ``passes_df`` None leaves out ``passes.parquet`` (passes were not recorded);
    ``events`` ({"kv_events": frame, ...}, keys of ``EVENT_FILES``) adds those tables
    (``kv_events.parquet``, ``engine_events.parquet``, ``output_events.parquet``).
    Raises ``OutputError`` for a refused folder; any error leaves the file system as it
    was (no new folder, no temporary folder, an overwritten folder untouched).
    """
    out = Path(os.path.abspath(check_out_dir(out_dir, overwrite)))
    config_json = _config_json(resolved_config)
    summary_doc = dict(_json_safe(summary))
    summary_doc[META_VERSION_KEY] = __version__
    summary_doc[META_CONFIG_KEY] = json.loads(config_json)
    summary_text = json.dumps(summary_doc, indent=2, allow_nan=False) + "\n"

    written = {"requests": out / REQUESTS_FILE}
    writers = {REQUESTS_FILE: lambda path: _write_parquet(requests_df, path, config_json,
                                                          REQUEST_TABLE_OPTIONS)}
    if passes_df is not None:
        writers[PASSES_FILE] = lambda path: _write_parquet(passes_df, path, config_json)
        written["passes"] = out / PASSES_FILE
    for key, frame in (events or {}).items():
        name = EVENT_FILES[key]
        writers[name] = lambda path, frame=frame: _write_parquet(frame, path, config_json)
        written[key] = out / name
    writers[SUMMARY_FILE] = lambda path: path.write_text(summary_text, encoding="ascii")
    written["summary"] = out / SUMMARY_FILE
    write_folder(out, writers, overwrite)
    return written


def write_folder(out_dir, writers: dict, overwrite: bool = False,
                 owned: tuple[str, ...] = RUN_FILES) -> Path:
    """Write the files ``writers`` makes ({file name: callable(path)}) as one folder,
    all or nothing: into a staging sibling renamed into place at the end (``owned``:
    the file names an ``overwrite`` may replace, as ``check_out_dir``)."""
    out = Path(os.path.abspath(check_out_dir(out_dir, overwrite, owned=owned)))
    created_parents: list[Path] = []
    staging = None
    remove_dead_staging(out)  # debris of runs killed while writing
    try:
        _make_parents(out, created_parents)
        # a sibling, so the final rename stays within one file system
        staging = _fresh_sibling(out, "partial")
        staging.mkdir()  # plain mkdir: the umask applies, unlike mkdtemp's 0700
        for name, write in writers.items():
            write(staging / name)
        _move_into_place(staging, out, overwrite, owned)
        staging = None
        return out
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created_parents)
        if isinstance(exc, OSError):
            # name the folder the user gave, not the hidden staging folder
            raise OutputError(f"cannot write output folder {out}: {exc.strerror or exc}") from exc
        raise


# the last run folder moved into place in this process: from that moment the run is
# written, and a SIGTERM that arrives afterwards no longer undoes it (cli.signals.on_sigterm).
COMMITTED: list = [None]
# True while the rename runs: a SIGTERM then is let through (the run completes) rather
# than raised between the rename and the record of it. A flag the handler reads, not a
# signal mask: the mask is per thread, and the process's other threads (BLAS, Arrow)
# would take the signal and the handler would still run in the main thread.
COMMITTING: list = [False]


def _move_into_place(staging: Path, out: Path, overwrite: bool, owned: tuple[str, ...]) -> None:
    COMMITTING[0] = True
    try:
        _rename_into_place(staging, out, overwrite, owned)
        COMMITTED[0] = out
    finally:
        COMMITTING[0] = False


def _rename_into_place(staging: Path, out: Path, overwrite: bool, owned: tuple[str, ...]) -> None:
    # the folder may have appeared or changed while the simulation ran
    check_out_dir(out, overwrite, owned=owned)
    if not out.exists():
        os.rename(staging, out)
        return
    if not _listing(out):
        out.rmdir()
        os.rename(staging, out)
        return
    # overwrite: park the old run next to it, swap, then delete the parked copy
    parked = _fresh_sibling(out, "old")
    os.rename(out, parked)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(parked, out)
        raise
    shutil.rmtree(parked, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# reading back


def read_requests(out_dir) -> pd.DataFrame:
    """The per-request table of a run folder."""
    return pd.read_parquet(Path(out_dir) / REQUESTS_FILE)


def read_passes(out_dir) -> pd.DataFrame:
    """The per-pass table of a run folder (absent when the run used --no-passes)."""
    return pd.read_parquet(Path(out_dir) / PASSES_FILE)


def read_summary(out_dir) -> dict:
    """summary.json of a run folder, metadata entries included."""
    return json.loads((Path(out_dir) / SUMMARY_FILE).read_text(encoding="ascii"))


def read_metadata(path) -> dict:
    """(version, resolved config) stored in one parquet file's schema metadata."""
    metadata = pq.read_schema(path).metadata or {}
    return {
        META_VERSION_KEY: metadata[META_VERSION_KEY.encode()].decode(),
        META_CONFIG_KEY: json.loads(metadata[META_CONFIG_KEY.encode()]),
    }
