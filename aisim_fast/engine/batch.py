"""``run_batch``: simulations to completion, with a status per simulation, reruns of what
outgrew its sizing, time caps and the per-worker split."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from aisim_fast.aic import timing as aic
from aisim_fast.config.payload import ConfigError
from aisim_fast.engine.batch_run import BatchRun, merge_leftovers
from aisim_fast.engine.build import DEFAULT_PASS_LOG_ROWS
from aisim_fast.engine.caps import CapFacts, until_cap
from aisim_fast.engine.frames import LazyFrames, pass_table, request_frame
from aisim_fast.engine.lowering import pool_extents, small_pages
from aisim_fast.engine.simulation import (STATUS_CAPACITY, STATUS_OK, STATUS_REJECTED_CONFIG, Simulation,
                                          SimulationError, check_simulation)
from aisim_fast.engine.split import worker_shards
from aisim_fast.engine.tables import BY_TRACE_ROW, NONE_WHEN_SPLIT, TABLES, UNSPLIT
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.stats import sketch
from aisim_fast.report.metrics import sketch_merge_rows

PASS_PART_ROWS = 1 << 19  # rows of a pass_parts table at least (but the last)
DEFAULT_EVENT_ROWS = 65536  # per simulation; drained whenever half full, doubled on overflow


@dataclass(frozen=True)
class BatchResult:
    """Results of a batch, indexed by simulation. ``status[s]`` is ``ok`` or a failure
    (STATUS_*) with ``error[s]`` saying why; the tables of a failed simulation raise
    SimulationError when read, the other simulations' results are intact.

    ``tables[name][s]`` is simulation s's table ``name`` (``engine.tables.TABLES``:
    requests, passes, handoffs, kv_events, engine_events, pressure_events,
    output_events, routing), built on first access; ``result.requests[s]`` and the
    like are the same sequences by attribute. A table the batch did not record is
    empty."""
    tables: Mapping[str, Sequence[pd.DataFrame]]
    token_stat: np.ndarray             # float64[s, TOKEN_STAT_WIDTH]
    token_hist: np.ndarray             # int64[s, TOKEN_HIST_WIDTH]
    kernel_calls: int
    end_ms: np.ndarray                 # float64[s] virtual clock when the simulation finished
    status: Sequence[str]              # STATUS_* per simulation
    error: Sequence[str]               # "" when ok, else what went wrong
    # per simulation: what is still held when it finished (see ``leftovers_of``)
    leftovers: Sequence[dict] = ()
    # pass_parts(s): simulation s's passes as consecutive Arrow tables, never joined -
    # the rows of ``passes[s]`` grouped by worker unit (a run split per worker: by
    # worker, each in time order) and in drain order within one; for writing big runs
    pass_parts: Callable[[int], Iterator] | None = None
    # per simulation: its CapFacts when it ran with a time cap, else None
    capped: Sequence = ()
    # started_passes[s]: simulation s's passes that started by its cap, the one that
    # straddles it too (its forward was timed, its work never commits): what the
    # reference's per-op diagnostics add up; ``passes[s]`` for an uncapped simulation
    started_passes: Sequence[pd.DataFrame] = ()

    def __getattr__(self, name: str):
        # result.requests, result.kv_events, ...: the tables by attribute
        tables = self.__dict__.get("tables")
        if tables is not None and name in tables:
            return tables[name]
        raise AttributeError(f"BatchResult has no attribute {name!r}")

    def check(self) -> "BatchResult":
        """Raise SimulationError for the first simulation that did not finish."""
        for message in self.error:
            if message:
                raise SimulationError(message)
        return self


def run_batch(sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
              record_passes: bool = True, record_handoffs: bool = False,
              record_events: bool = False, record_outputs: bool = False,
              progress=None, record_pressure: bool = False, spill_passes: bool = False) -> BatchResult:
    """Run every simulation to completion; ``status[s]`` / ``error[s]`` of the result say
    how each ended (a failed one does not affect the others). Raises only for
    programming errors.

    A simulation whose config is invalid is not run (``rejected_config``). One that
    outgrows its block arena estimate or its placement's queue sizing is rerun alone
    with room for everything, transparently. An open-loop, single-turn, round-robin
    aggregated simulation is split into one unit per worker: round-robin placement
    sends arrival i to worker i mod N whatever the state, and aggregated workers share
    nothing else, so the workers are independent simulations and run on separate
    threads. Results are merged back per simulation (token-gap statistics with Chan's
    merge). ``record_events``: every KV Stored / Removed fact of every worker in
    ``result.kv_events[s]``, every admission, preemption and finish in
    ``result.engine_events[s]``, every vLLM preemption and SGLang retraction in
    ``result.pressure_events[s]``; ``record_pressure``: the engine facts without the KV
    facts (admissions, preemptions, finishes, pressure events; SGLang too);
    ``record_outputs`` (with or without them): every output token in
    ``result.output_events[s]``. ``progress``: called as ``progress(sim_ms,
    done, total)`` (the least virtual clock of the live simulations, requests finished,
    requests) after each slice of about ``PROGRESS_SLICE_S`` wall seconds: the batch
    then advances in virtual-time slices (``BatchRun.advance`` to growing horizons,
    exactly as one call), so the driver regains control, and Ctrl-C works, within
    about a second even in a long run. ``spill_passes``: the drained pass log waits in
    a temporary file, not in memory, until ``passes`` / ``pass_parts`` read it."""
    n_sims = len(sims)
    status = [STATUS_OK] * n_sims
    error = [""] * n_sims
    units: list[Simulation] = []
    owner: list[tuple[int, int, np.ndarray | None]] = []  # (simulation, worker, rows)
    for s, sim in enumerate(sims):
        try:
            check_simulation(sim)
        except ConfigError as exc:
            status[s] = STATUS_REJECTED_CONFIG
            error[s] = f"simulation {s}: invalid config: {exc}"
            continue
        # a worker unit numbers its requests from 1, so the hashes of generated blocks
        # (the reference's synthetic tokens use the request's number) would differ
        # from the whole run's: KV events are recorded on whole runs only
        logged = record_events or record_outputs or record_pressure
        shards = None if logged else worker_shards(sim)
        if shards is None:
            units.append(sim)
            owner.append((s, -1, None))
        else:
            for w, (rows, unit) in enumerate(shards):
                units.append(unit)
                owner.append((s, w, rows))
    logged = record_events or record_outputs or record_pressure
    # a capped simulation's committed prefill and last instant come from its passes
    any_capped = any(sim.max_sim_time_ms is not None for sim in sims)
    res = _run_units_resized(units, pass_log_rows, record_passes or any_capped, [s for s, _, _ in owner],
                             record_handoffs, DEFAULT_EVENT_ROWS if logged else 0,
                             record_outputs, progress, log_kv=record_events, spill_passes=spill_passes)
    parts: list[list[int]] = [[] for _ in sims]
    for u, (s, _, _) in enumerate(owner):
        parts[s].append(u)
        if res.status[u] != STATUS_OK and status[s] == STATUS_OK:
            status[s], error[s] = res.status[u], res.error[u]
    # A worker unit that stops stops alone, at its own time and with its own requests;
    # the reference stops the whole run, with every worker's requests in flight: rerun
    # such a simulation whole for its stop (rare, and it has no results to merge).
    for s in range(n_sims):
        if len(parts[s]) > 1 and status[s] != STATUS_OK:
            whole = _run_units_resized([sims[s]], 0, False, [s], False)
            status[s], error[s] = whole.status[0], whole.error[0]
    capped = _end_at_caps(sims, parts, status, res)
    aic_configs = {rank.aic for sim in sims for _, rank in pool_extents(sim, 0) if rank.aic is not None}
    if aic_configs:
        aic.save_all()  # the values met in this batch, for the next run
        failed_timing = aic.take_failures(aic_configs)
        for s, sim in enumerate(sims):
            bad = [failed_timing[r.aic] for _, r in pool_extents(sim, 0) if r.aic in failed_timing]
            if bad and status[s] == STATUS_OK:
                status[s], error[s] = STATUS_REJECTED_CONFIG, f"simulation {s}: timing: {bad[0]}"

    with small_pages():
        stat, hist = sketch.token_stats_new(n_sims)
    for s in range(n_sims):
        if len(parts[s]) == 1:  # not split: keep the row bit for bit
            stat[s] = res.token_stat[parts[s][0]]
        elif parts[s]:
            stat[s] = sketch_merge_rows(res.token_stat[parts[s]])
    if units:
        sketch.add_hist_rows(hist, np.array([s for s, _, _ in owner], np.int64), res.token_stat,
                             res.token_hist)

    def failed(s):
        if status[s] != STATUS_OK:
            raise SimulationError(error[s])

    def merged(name):
        """Table ``name`` per simulation: a whole simulation's own, or its worker units'
        merged by the table's rule (engine.tables)."""
        rule, unit_tables = TABLES[name].merge, res.tables[name]

        def read(s):
            failed(s)
            first = parts[s][0]
            if (len(parts[s]) == 1 and owner[first][1] < 0) or rule == UNSPLIT:
                return unit_tables[first]
            if rule == NONE_WHEN_SPLIT:
                return unit_tables[first].iloc[:0]
            if rule == BY_TRACE_ROW:
                return _requests_of_units(sims[s], parts[s], owner, res)
            return _passes_of_units(parts[s], owner, unit_tables)
        return read

    def pass_parts(s):
        # raw drained chunks gathered into parts of about PASS_PART_ROWS rows: a frame
        # per drained chunk would cost more in pandas than the rows themselves
        failed(s)
        worker_col = L.PASS_LOG_COLUMNS.index("worker")
        buffered, n_rows = [], 0
        for u in parts[s]:
            run, i = res.sources[u]
            w = owner[u][1]
            for chunk in run.pass_chunks(i):
                if w >= 0:  # a worker unit of a split run: its worker in the simulation
                    chunk = chunk.copy()
                    chunk[:, worker_col] = w
                buffered.append(chunk)
                n_rows += len(chunk)
                if n_rows >= PASS_PART_ROWS:
                    yield pass_table(buffered)
                    buffered, n_rows = [], 0
        if buffered or not parts[s]:
            yield pass_table(buffered)

    end_ms = np.array([res.end_ms[parts[s]].max() if parts[s] else np.nan for s in range(n_sims)])
    for s, facts in enumerate(capped):
        if facts is not None:
            end_ms[s] = facts.last_instant_ms
    leftovers = [merge_leftovers([res.leftovers[u] for u in parts[s]]) if parts[s] else {}
                 for s in range(n_sims)]

    def by_cap(name):
        # a capped simulation keeps what happened by its cap (spec replay.md 12.11)
        read, column = merged(name), TABLES[name].cap_column

        def read_capped(s):
            frame = read(s)
            return frame if capped[s] is None else until_cap(frame, capped[s].cap_ms, column)
        return LazyFrames(n_sims, read_capped)

    def capped_pass_parts(s):
        for part in pass_parts(s):
            yield part if capped[s] is None else until_cap(part, capped[s].cap_ms, TABLES["passes"].cap_column)

    def started_by_cap(s):
        frame = merged("passes")(s)
        return frame if capped[s] is None else until_cap(frame, capped[s].cap_ms, "start_ms")

    return BatchResult(tables={name: by_cap(name) for name in TABLES}, token_stat=stat, token_hist=hist,
                       kernel_calls=res.kernel_calls, end_ms=end_ms, status=status, error=error,
                       leftovers=leftovers, pass_parts=capped_pass_parts, capped=capped,
                       started_passes=LazyFrames(n_sims, started_by_cap))


def _requests_of_units(sim: Simulation, unit_ids: list[int], owner, res: _UnitResults) -> pd.DataFrame:
    """The requests table of a simulation split into worker units: its rows back in
    trace order, each unit's worker numbered in the simulation."""
    runs = {id(res.sources[u][0]) for u in unit_ids}
    if len(runs) == 1:
        # every worker unit in one kernel state: one frame over their rows
        run = res.sources[unit_ids[0]][0]
        n = len(sim.workload.input_len)
        q_rows = np.empty(n, np.int64)
        w_base = np.empty(n, np.int64)
        for u in unit_ids:
            _, w, rows = owner[u]
            q0, w0 = run.offsets(res.sources[u][1])
            q_rows[rows] = q0 + np.arange(len(rows))
            w_base[rows] = w0 - w * sim.dp_size  # a unit's ranks are its worker's
        return request_frame(sim, run.state.rq, q_rows, w_base)
    frames = []
    for u in unit_ids:
        _, w, rows = owner[u]
        frame = res.tables["requests"][u].copy()
        frame.index = rows
        frame["worker"] = frame["worker"].where(frame["worker"].isna(), w)
        frame["decode_worker"] = frame["worker"]
        frames.append(frame)
    return pd.concat(frames).sort_index().reset_index(drop=True)


def _passes_of_units(unit_ids: list[int], owner, unit_tables) -> pd.DataFrame:
    """The passes table of a simulation split into worker units: each unit's worker
    numbered in the simulation, in (start_ms, worker) order."""
    frames = []
    for u in unit_ids:
        frame = unit_tables[u].copy()
        frame["worker"] = owner[u][1]
        frames.append(frame)
    merged = pd.concat(frames, ignore_index=True)
    return merged.sort_values(["start_ms", "worker"], kind="stable", ignore_index=True)


def _end_at_caps(sims, parts, status, res) -> list:
    """For each capped simulation that ran (unsplit, its passes recorded) to its cap:
    its CapFacts, and token statistics over the requests completed by the cap. Token
    gaps are folded as they are emitted, so a second run with the others' gaps left
    out gives them (the reference folds a request's gaps when it completes). None for
    the others."""
    facts: list = [None] * len(sims)
    reruns, where = [], []
    for s, sim in enumerate(sims):
        if sim.max_sim_time_ms is None or status[s] != STATUS_OK:
            continue
        cap_ms = float(sim.max_sim_time_ms)
        (u,) = parts[s]
        requests, passes = res.tables["requests"][u], res.tables["passes"][u]
        arrival_ms = requests["arrival_ms"].to_numpy(np.float64)
        arrived = arrival_ms <= cap_ms
        start_ms, end_ms = passes["start_ms"].to_numpy(np.float64), passes["end_ms"].to_numpy(np.float64)
        ended = end_ms <= cap_ms
        straddling = (start_ms <= cap_ms) & ~ended  # at most one per rank: its work never commits
        committed = int(requests["committed_prefill_tokens"].sum()) \
            - int(passes["sum_prefill_tokens"].to_numpy(np.int64)[straddling].sum())
        # the instants the run drained by the cap: arrivals, pass ends, KV transfers done
        last_ms = max(float(arrival_ms[arrived].max(initial=0.0)), float(end_ms[ended].max(initial=0.0)))
        if "transfer_done_ms" in requests:
            done_ms = requests["transfer_done_ms"].to_numpy(np.float64)
            last_ms = max(last_ms, float(done_ms[done_ms <= cap_ms].max(initial=0.0)))
        facts[s] = CapFacts(cap_ms, int(arrived.sum()), last_ms, committed)
        unfinished = np.flatnonzero(~(requests["completion_ms"].to_numpy(np.float64) <= cap_ms))
        # (no rerun when none of them emitted a token gap yet)
        if (requests["output_tokens"].to_numpy(np.int64)[unfinished] > 1).any():
            reruns.append(dataclasses.replace(sim, token_stats_excluded=unfinished))
            where.append(u)
    if reruns:
        again = _run_units_resized(reruns, 0, False, where, False)
        for i, u in enumerate(where):
            res.token_stat[u] = again.token_stat[i]
            res.token_hist[u] = again.token_hist[i]
    return facts


@dataclass
class _UnitResults:
    """Results of independent units (whole simulations or worker shards), by unit."""
    status: list          # STATUS_* per unit, or the kernel's "arena_full" / "capacity"
    error: list
    tables: dict          # table name (engine.tables) -> per unit
    sources: list         # per unit: (the BatchRun that ran it, its index there)
    leftovers: list
    token_stat: np.ndarray
    token_hist: np.ndarray
    end_ms: np.ndarray
    kernel_calls: int


def _run_units_resized(units: Sequence[Simulation], pass_log_rows: int, record_passes: bool,
                       sim_names: list[int], record_handoffs: bool,
                       event_rows: int = 0, log_outputs: bool = False, progress=None,
                       log_kv: bool = True, spill_passes: bool = False) -> _UnitResults:
    """``_run_units``, then the units that outgrew their block arena estimate or their
    queue sizing rerun alone with room for everything; their results replace the
    failed ones. A unit with a fixed ``queue_slots`` that overflowed keeps the
    ``capacity`` status."""
    res = _run_units(units, pass_log_rows, record_passes, sim_names, record_handoffs, event_rows,
                     log_outputs, progress, log_kv, spill_passes)
    redo: list[int] = []
    more_event_rows = False
    fixed: list[Simulation] = []
    for u, (unit, status) in enumerate(zip(units, res.status)):
        if status == "arena_full":
            fixed.append(dataclasses.replace(unit, arena_blocks=max(
                unit.rank.num_gpu_blocks, unit.prefill_rank.num_gpu_blocks if unit.disaggregated else 0)))
        elif status == STATUS_CAPACITY and unit.queue_slots is None:
            fixed.append(dataclasses.replace(unit, queue_slots=len(unit.workload.input_len) + 1))
        elif status == "events_full":
            fixed.append(unit)
            more_event_rows = True
        else:
            continue
        redo.append(u)
    if not redo:
        return res
    # a rerun can need more room still (an arena, then more events): resize again
    again = _run_units_resized(fixed, pass_log_rows, record_passes, [sim_names[u] for u in redo],
                               record_handoffs, 4 * event_rows if more_event_rows else event_rows,
                               log_outputs, progress, log_kv, spill_passes)
    where = {u: i for i, u in enumerate(redo)}
    for u, i in where.items():
        res.status[u] = again.status[i] if again.status[i] != "arena_full" else STATUS_CAPACITY
        res.error[u] = again.error[i]
        res.token_stat[u] = again.token_stat[i]
        res.token_hist[u] = again.token_hist[i]
        res.end_ms[u] = again.end_ms[i]
        res.leftovers[u] = again.leftovers[i]
        res.sources[u] = again.sources[i]

    def pick(first, second):
        return LazyFrames(len(units), lambda u: second[where[u]] if u in where else first[u])

    return dataclasses.replace(
        res, tables={name: pick(res.tables[name], again.tables[name]) for name in TABLES},
        kernel_calls=res.kernel_calls + again.kernel_calls)


def _run_units(sims: Sequence[Simulation], pass_log_rows: int, record_passes: bool,
               sim_names: list[int], record_handoffs: bool = False,
               event_rows: int = 0, log_outputs: bool = False, progress=None,
               log_kv: bool = True, spill_passes: bool = False) -> _UnitResults:
    """Run independent units in one batch, each until it ends (done or failed)."""
    if not sims:
        with small_pages():
            stat, hist = sketch.token_stats_new(0)
        return _UnitResults([], [], {name: [] for name in TABLES}, [], [], stat, hist, np.zeros(0), 0)
    run = BatchRun(sims, pass_log_rows, record_passes, record_handoffs, event_rows, log_outputs,
                   sim_names=sim_names, log_kv=log_kv, spill_passes=spill_passes)
    if progress is None:
        run.advance()
    else:
        run.advance_in_slices(progress)
    n = len(sims)
    status = [STATUS_OK if x == "done" else x for x in run.status]
    st = run.state.st
    return _UnitResults(status, list(run.error), {name: LazyFrames(n, getattr(run, name)) for name in TABLES},
                        [(run, s) for s in range(n)],
                        [run.leftovers(s) for s in range(n)], st.token_stat[:n], st.token_hist[:n],
                        st.now_ms.copy(), run.kernel_calls)
