"""Run outputs: per-request and per-pass parquet tables plus the summary JSON.

A run folder holds

* ``requests.parquet`` -- one row per request, in request-id (uuid) order;
* ``passes.parquet``   -- one row per forward pass (left out when passes were not recorded),
  written part by part as the pass log was drained: a run split per worker has its
  rows by worker, each in time order (sort by ``start_ms`` for one timeline);
* ``summary.json``     -- the reference summary keys (``report.summarize``).

Both parquet files carry the schema metadata keys ``aisim_fast.version`` and
``aisim_fast.config.payload`` (JSON of the resolved configuration); ``summary.json`` holds the
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
import shutil
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from aisim_fast import __version__
from aisim_fast.report.metrics import STATUS_COMPLETED, summarize

REQUESTS_FILE = "requests.parquet"
PASSES_FILE = "passes.parquet"
SUMMARY_FILE = "summary.json"
KV_EVENTS_FILE = "kv_events.parquet"
ENGINE_EVENTS_FILE = "engine_events.parquet"
PRESSURE_EVENTS_FILE = "pressure_events.parquet"
OUTPUT_EVENTS_FILE = "output_events.parquet"
ROUTING_FILE = "routing.parquet"
# the optional event tables of a run: result key -> file
EVENT_FILES = {"kv_events": KV_EVENTS_FILE, "engine_events": ENGINE_EVENTS_FILE,
               "pressure_events": PRESSURE_EVENTS_FILE, "output_events": OUTPUT_EVENTS_FILE,
               "routing": ROUTING_FILE}
RUN_FILES = (REQUESTS_FILE, PASSES_FILE, SUMMARY_FILE, *EVENT_FILES.values())

META_VERSION_KEY = "aisim_fast.version"
META_CONFIG_KEY = "aisim_fast.config"

MS_PER_S = 1000.0


class OutputError(RuntimeError):
    """The output folder cannot be used (exists, is a file, ...) or writing failed."""


# ---------------------------------------------------------------------------------------
# request order and summary


def uuid_order(session, turn_index) -> np.ndarray:
    """Row permutation that puts trace rows in request-id (uuid) order.

    Under ``determinism: canonical_v1`` the reference numbers requests 1, 2, 3, ... in
    session-major order: sessions in order of first appearance in the file, each
    session's turns in file order (spec output-plan.md 3.1). That is neither file order
    nor arrival order once a trace has multi-turn sessions, and the summary means must
    be summed in this order to match the reference bit for bit (report.py docstring).
    """
    return np.lexsort((np.asarray(turn_index), np.asarray(session)))


def canonical_uuid(ordinal: int) -> str:
    """The reference's canonical_v1 uuid string of a 1-based ordinal."""
    text = f"{ordinal:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


_UUIDS = np.zeros(0, dtype=object)  # canonical_uuid(1..n), kept: a sweep asks for them per point


def canonical_uuids(n: int) -> np.ndarray:
    """``canonical_uuid(1)`` .. ``canonical_uuid(n)`` as an object array."""
    global _UUIDS
    if len(_UUIDS) < n:
        _UUIDS = np.array([canonical_uuid(i + 1) for i in range(max(n, 2 * len(_UUIDS)))], dtype=object)
    return _UUIDS[:n]


def requests_in_uuid_order(frame: pd.DataFrame, session, turn_index) -> pd.DataFrame:
    """The simulator's request frame (trace-row order) re-ordered by uuid, with a
    ``uuid`` column spelled as in the golden CSVs so rows can be joined with them.
    A frame of some of the rows (a run with a time cap keeps its terminal requests,
    indexed by trace row) keeps each row's uuid among all of them."""
    order = uuid_order(session, turn_index)
    if len(frame) == len(order):
        out = frame.iloc[order].reset_index(drop=True)
        out["uuid"] = canonical_uuids(len(out))
        return out
    kept = np.isin(order, frame.index.to_numpy())
    out = frame.loc[order[kept]].reset_index(drop=True)
    out["uuid"] = canonical_uuids(len(order))[kept]
    return out


def completed_duration_ms(requests: pd.DataFrame) -> float:
    """``duration_ms`` as ``report.summarize`` defines it (spec replay.md 12.2): the last
    terminal time of the completed, admitted requests, measured from t = 0."""
    in_sample = (np.isfinite(requests["first_admit_ms"].to_numpy(np.float64))
                 & (requests["terminal_status"].to_numpy(object) == STATUS_COMPLETED))
    if not in_sample.any():
        return 0.0
    return max(float(requests["completion_ms"].to_numpy(np.float64)[in_sample].max()), 0.0)


def summarize_aggregated_run(requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                             workers: int, gpus_per_worker: int = 1, sla: dict | None = None,
                             wall_time_ms: float | None = None, cap=None) -> dict:
    """Summary of one aggregated replay, ``requests`` in uuid order.

    Aggregated topologies provision ``workers`` decode-role workers for the whole run
    and no prefill workers (spec replay.md 12.7): decode worker-seconds are
    ``workers * duration_s`` and the prefill side reports 0 seconds and 0 GPUs.
    ``committed_prefill_tokens`` is the prompt work the kernel counted per admission.
    ``cap``: the run's ``replay.CapFacts`` when it had a time cap (spec replay.md
    12.11): worker-seconds then run to its last instant by the cap, and the arrivals
    and committed prefill are the cap's.
    """
    duration_s = completed_duration_ms(requests) / MS_PER_S
    if cap is not None:
        duration_s = cap.last_instant_ms / MS_PER_S
    return summarize(
        requests, token_stat_row, token_hist_row,
        sla=sla or None,
        worker_seconds=(0.0, workers * duration_s),
        gpus_per_worker=(0, gpus_per_worker),
        committed_prefill_tokens=_committed(requests, cap),
        wall_time_ms=wall_time_ms,
        num_requests=None if cap is None else cap.num_requests,
    )


def _committed(requests: pd.DataFrame, cap) -> int:
    return int(requests["committed_prefill_tokens"].sum()) if cap is None else cap.committed_prefill_tokens


def summarize_disaggregated_run(requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                                prefill_workers: int, decode_workers: int, end_ms: float,
                                prefill_gpus_per_worker: int = 1, decode_gpus_per_worker: int = 1,
                                sla: dict | None = None, wall_time_ms: float | None = None,
                                cap=None) -> dict:
    """Summary of one disaggregated replay, ``requests`` in uuid order.

    Each pool is provisioned for the whole virtual run, 0 to ``end_ms`` (the last clock
    advance, which a source release may put after the last token). The prefix-reuse
    ratio counts a request's largest reuse over all its admissions, decode re-admissions
    after a preemption included, while the per-request ``cached_tokens`` is the
    prefill side's (spec replay.md 5.4). ``cap``: as in ``summarize_aggregated_run``
    (``end_ms`` is then the last instant by the cap)."""
    end_s = end_ms / MS_PER_S
    reuse = np.maximum(requests["cached_tokens"].to_numpy(np.int64),
                       requests["decode_cached_tokens"].to_numpy(np.int64, na_value=0))
    return summarize(
        requests.assign(cached_tokens=reuse), token_stat_row, token_hist_row,
        sla=sla or None,
        worker_seconds=(prefill_workers * end_s, decode_workers * end_s),
        gpus_per_worker=(prefill_gpus_per_worker, decode_gpus_per_worker),
        committed_prefill_tokens=_committed(requests, cap),
        wall_time_ms=wall_time_ms,
        num_requests=None if cap is None else cap.num_requests,
    )


def summarize_replay(setup, requests: pd.DataFrame, token_stat_row, token_hist_row, *,
                     end_ms: float, gpus_per_worker: int | None = None,
                     wall_time_ms: float | None = None, cap=None) -> dict:
    """Summary of one replay of ``setup`` (a ``config.ReplaySetup``), ``requests`` in
    uuid order: the aggregated or disaggregated accounting as its topology asks.
    ``gpus_per_worker``: the aggregated pool's (default its tensor parallelism x
    attention-DP ranks, as the reference's ``aic_gpus_per_worker``). ``cap``: the run's
    ``replay.CapFacts`` (``BatchResult.capped``) when it had a time cap."""
    if setup.disaggregated:
        return summarize_disaggregated_run(
            requests, token_stat_row, token_hist_row,
            prefill_workers=setup.prefill_workers, decode_workers=setup.workers, end_ms=end_ms,
            prefill_gpus_per_worker=setup.prefill_gpus_per_worker,
            decode_gpus_per_worker=setup.gpus_per_worker, sla=setup.sla,
            wall_time_ms=wall_time_ms, cap=cap)
    return summarize_aggregated_run(
        requests, token_stat_row, token_hist_row, workers=setup.workers,
        gpus_per_worker=setup.gpus_per_worker if gpus_per_worker is None else gpus_per_worker,
        sla=setup.sla, wall_time_ms=wall_time_ms, cap=cap)


def prediction_provenance(setup) -> dict:
    """What timed each pool, as the reference's report says it (``prediction_provenance``)."""
    out = {}
    for role, rank in sorted(setup.pools):
        if rank.timing_model == "aic":
            out[role] = {"data_version": rank.aic.backend_version, "data_version_unavailable_reason": None,
                         "estimator": "op_level", "timing_source": "aic"}
        else:
            kind = "configured" if rank.timing_model == "fixed" else "built_in"
            out[role] = {"data_version": None,
                         "data_version_unavailable_reason": (f"{kind.replace('_', '-')} timing does "
                                                             "not use performance data"),
                         "estimator": rank.timing_model, "timing_source": kind}
    return out


def routing_summary(routing: pd.DataFrame) -> dict:
    """Routing figures of a kv_router run (flat, so sweeps can keep them as columns):
    decisions (both pools of a disaggregated run), decisions where several workers
    shared the lowest cost, the chosen workers' mean overlap and the mean overlap
    regret (best offered - chosen), blocks, over the overlap-aware decisions (the
    decode pool's router is overlap-blind)."""
    n = len(routing)
    aware = (routing["pool"] != "decode").to_numpy() if n else np.zeros(0, bool)
    chosen = routing["overlap_blocks"].to_numpy(np.float64)[aware]
    best = routing["best_overlap_blocks"].to_numpy(np.float64)[aware]
    return {"routing_decisions": n,
            "routing_tied_decisions": int((routing["tied"].to_numpy() > 1).sum()),
            "routing_mean_overlap_blocks": float(chosen.mean()) if len(chosen) else 0.0,
            "routing_mean_overlap_regret_blocks": float((best - chosen).mean()) if len(chosen) else 0.0}


def kv_capacity(setup) -> dict:
    """Each pool's KV blocks per worker and where the number came from."""
    return {role: {"num_gpu_blocks": rank.num_gpu_blocks, "block_size": rank.block_size,
                   "source": "estimated from model and GPU memory (AIC)"
                   if rank.num_gpu_blocks_estimated else "configured"}
            for role, rank in sorted(setup.pools)}


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


def remove_dead_staging(out: Path) -> list[Path]:
    """Remove the staging folders (``.<name>.partial-<pid>-*``) that killed runs left
    next to ``out``: only those whose process is gone (its pid is in the name)."""
    out = Path(os.path.abspath(out))
    removed = []
    if not out.parent.is_dir():
        return removed
    prefix = f".{out.name}.partial-"
    for entry in out.parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        try:
            pid = int(entry.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
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


def check_out_dir(out_dir, overwrite: bool = False, probe: bool = False) -> Path:
    """Refuse an output folder we must not write to; return it as a Path.

    Called before a run starts (so a long simulation is not wasted; ``probe`` also
    creates and removes a file where the run will write) and again by ``write_run``.
    With ``overwrite``, only a folder that holds nothing but run files is replaced: the
    whole folder is swapped out, and a mistyped ``--out`` (".", a home folder) must not
    delete unrelated files.
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
    foreign = [name for name in entries if name not in RUN_FILES]
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

    created_parents: list[Path] = []
    staging = None
    remove_dead_staging(out)  # debris of runs killed while writing
    try:
        _make_parents(out, created_parents)
        # a sibling, so the final rename stays within one file system
        staging = _fresh_sibling(out, "partial")
        staging.mkdir()  # plain mkdir: the umask applies, unlike mkdtemp's 0700
        written = {"requests": out / REQUESTS_FILE}
        _write_parquet(requests_df, staging / REQUESTS_FILE, config_json, REQUEST_TABLE_OPTIONS)
        if passes_df is not None:
            _write_parquet(passes_df, staging / PASSES_FILE, config_json)
            written["passes"] = out / PASSES_FILE
        for key, frame in (events or {}).items():
            name = EVENT_FILES[key]
            _write_parquet(frame, staging / name, config_json)
            written[key] = out / name
        (staging / SUMMARY_FILE).write_text(summary_text, encoding="ascii")
        written["summary"] = out / SUMMARY_FILE
        _move_into_place(staging, out, overwrite)
        staging = None
        return written
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created_parents)
        if isinstance(exc, OSError):
            # name the folder the user gave, not the hidden staging folder
            raise OutputError(f"cannot write output folder {out}: {exc.strerror or exc}") from exc
        raise


# the last run folder moved into place in this process: from that moment the run is
# written, and a SIGTERM that arrives afterwards no longer undoes it (cli._on_sigterm).
COMMITTED: list = [None]
# True while the rename runs: a SIGTERM then is let through (the run completes) rather
# than raised between the rename and the record of it. A flag the handler reads, not a
# signal mask: the mask is per thread, and the process's other threads (BLAS, Arrow)
# would take the signal and the handler would still run in the main thread.
COMMITTING: list = [False]


def _move_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    COMMITTING[0] = True
    try:
        _rename_into_place(staging, out, overwrite)
        COMMITTED[0] = out
    finally:
        COMMITTING[0] = False


def _rename_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    # the folder may have appeared or changed while the simulation ran
    check_out_dir(out, overwrite)
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
