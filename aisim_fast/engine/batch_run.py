"""A batch held in kernel state and advanced step by step (``BatchRun``)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd

from aisim_fast.engine.build import DEFAULT_PASS_LOG_ROWS, build_state
from aisim_fast.engine.event_frames import (worker_and_rank, any_attention_dp, compile_event_kernels,
                                            drained_event_rows, engine_event_frame, event_rows,
                                            kv_event_frame, output_event_frame, pressure_event_frame)
from aisim_fast.engine.frames import handoff_frame, pass_frame, request_frame, routing_frame
from aisim_fast.engine.grow import KernelState, add_rows_many, append_workload_rows
from aisim_fast.engine.simulation import Simulation, SimulationError, check_simulation
from aisim_fast.engine.templates import sim_template, table_key
from aisim_fast.kernels.jit import compile_notice
from aisim_fast.kernels.loop.event_loop import replay_batch
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.stats import sketch
from aisim_fast.report.metrics import sketch_merge_rows
from aisim_fast.trace.workload import Workload, concat_workloads

PROGRESS_SLICE_S = 0.3      # wall seconds per kernel call of a run that reports progress
PASS_LOG_BUDGET_ROWS = 1 << 21  # pass-log rows of a whole batch (240 MB); drained when full
MIN_PASS_LOG_ROWS = 512


_RUNNABLE = (L.SIM_RUNNING, L.SIM_PAUSED, L.SIM_NEED_FLUSH)


class BatchRun:
    """A batch held in kernel state between calls.

    ``advance(horizon_ms)`` takes every live simulation through every instant up to
    the horizon (inf: until it ends) and returns the statuses; ``add_requests(s,
    workload)`` gives a simulation more requests between steps (the state grows by
    reallocation, ``aisim_fast.engine.grow``); ``requests(s)``, ``passes(s)``,
    ``kv_events(s)``, ... read the tables so far. ``run_batch`` is one of these
    advanced to infinity, for every unit of its batch.

    ``status[s]`` is the kernel's word for where simulation s stands: ``running``
    (not advanced yet), ``paused`` (at a horizon), ``done``, or a failure (``dead_end``,
    ``capacity``, ``arena_full``, ``events_full``) with ``error[s]`` saying why.

    ``growable=True`` sizes every simulation for requests not known yet: its block
    arenas are its whole KV pools (an estimate from the known requests could be
    outgrown) and its queues hold every request it has, growing with it (unless
    ``queue_slots`` fixes them). ``add_requests`` needs it.
    """

    def __init__(self, sims: Sequence[Simulation], pass_log_rows: int = DEFAULT_PASS_LOG_ROWS,
                 record_passes: bool = True, record_handoffs: bool = False, event_rows: int = 0,
                 log_outputs: bool = False, growable: bool = False, sim_names=None, log_kv: bool = True,
                 spill_passes: bool = False, kernel_parts=None, features=None):
        self.growable = growable
        self._workload_buffers: dict = {}  # simulation -> growing_arrays buffers of its workload
        self._fixed_queues = [sim.queue_slots is not None for sim in sims]
        if growable:
            sims = [dataclasses.replace(
                sim, arena_blocks=sim.arena_blocks if sim.arena_blocks is not None else max(
                    sim.rank.num_gpu_blocks, sim.prefill_rank.num_gpu_blocks if sim.disaggregated else 0),
                queue_slots=sim.queue_slots if sim.queue_slots is not None else sim.workload.num_requests + 1)
                for sim in sims]
        checked: dict = {}  # a sweep's units share a few configs: check each once
        for sim in sims:
            key = tuple(id(getattr(sim, f.name)) for f in dataclasses.fields(sim) if f.name != "workload")
            if key not in checked:
                check_simulation(sim, allow_empty=True)
                checked[key] = True
        self.sims = list(sims)
        self.sim_names = list(range(len(sims))) if sim_names is None else list(sim_names)
        self.event_rows = event_rows
        # before build_state, whose prompt hashing compiles too (``kernel_parts``: the
        # kernel sets the caller will run instead of the event loop's; those are
        # announced by ``replay_batch``, which knows the batch's features)
        compile_notice(list(kernel_parts or []) + (["events"] if event_rows else []))
        # the pass log is a buffer the driver drains whenever it fills: a batch of many
        # simulations (or worker units) shares one budget instead of 64k rows each
        rows = min(pass_log_rows, max(MIN_PASS_LOG_ROWS, PASS_LOG_BUDGET_ROWS // max(1, len(sims))))
        self.state = KernelState(*build_state(self.sims, rows if record_passes else 0,
                                              record_handoffs, event_rows, log_outputs, log_kv,
                                              independent_workers=not growable, features=features))
        self._stats_merged: set[int] = set()  # independent simulations merged (_merge_worker_stats)
        if event_rows:
            compile_event_kernels(self.state)
        # a simulation's time cap ends it at its last instant at or before the cap
        self._cap_ms = np.array([np.inf if sim.max_sim_time_ms is None else float(sim.max_sim_time_ms)
                                 for sim in self.sims])
        st = self.state.st
        for s, sim in enumerate(self.sims):
            if sim.token_stats_excluded is not None and len(sim.token_stats_excluded):
                rows = np.asarray(sim.token_stats_excluded, np.int64)
                self.state.rq.i64[st.i64[s, L.SM_Q_OFF] + rows, L.RQ_NO_TOKEN_STATS] = 1
                if st.i64[s, L.SM_PREFILL_Q_OFF] >= 0:
                    self.state.rq.i64[st.i64[s, L.SM_PREFILL_Q_OFF] + rows, L.RQ_NO_TOKEN_STATS] = 1
        self._pass_chunks: list[list[np.ndarray]] = [[] for _ in sims]
        # spill_passes: drained pass-log rows go to an unnamed temporary file (removed
        # with it) instead of memory, indexed by (byte offset, rows) per simulation: a
        # million-request run drains gigabytes of them
        self._spill = tempfile.TemporaryFile() if spill_passes else None
        if self._spill is not None:  # closed with the run, not left to the file's own finalizer
            weakref.finalize(self, self._spill.close)
        self._spill_index: list[list[tuple[int, int]]] = [[] for _ in sims]
        self._event_chunks: list[list[np.ndarray]] = [[] for _ in sims]
        self._advanced = np.zeros(len(sims), bool)
        self.kernel_calls = 0

    # -- stepping ------------------------------------------------------------------
    def advance(self, horizon_ms: float = np.inf) -> list[str]:
        """Advance every live simulation through every instant up to ``horizon_ms``."""
        st = self.state.st
        live = np.flatnonzero(np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE))
        self._advanced[live] = True
        # a capped simulation stops at its cap: one kernel call per distinct stop (a
        # batch's simulations share the horizon, and almost always their cap)
        stop_ms = np.minimum(float(horizon_ms), self._cap_ms[live])
        for stop in np.unique(stop_ms):
            ids = live[stop_ms == stop]
            while len(ids):
                s_ = self.state
                replay_batch(s_.cfg, s_.pool, s_.rq, s_.wl, s_.wk, s_.st, ids, s_.max_lease, s_.max_bs,
                             stop)
                self.kernel_calls += 1
                self._drain()
                ids = ids[st.i64[ids, L.SM_STATUS] == L.SIM_NEED_FLUSH]
        # every instant up to its cap drained: the simulation has ended
        ended = live[(self._cap_ms[live] <= horizon_ms) & (st.i64[live, L.SM_STATUS] == L.SIM_PAUSED)]
        st.i64[ended, L.SM_STATUS] = L.SIM_DONE
        self._merge_worker_stats()
        return self.status

    def _merge_worker_stats(self) -> None:
        """An independent simulation (``build_state``) that has ended gets its workers'
        token-gap rows merged into its own, once: Chan's merge of the moments in worker
        order, as the round-robin split's units are merged, so the result does not
        depend on how its calls were sliced."""
        st, wk = self.state.st, self.state.wk
        for s in np.flatnonzero(st.i64[:, L.SM_INDEPENDENT]):
            if s in self._stats_merged or np.isin(st.i64[s, L.SM_STATUS], _RUNNABLE):
                continue
            self._stats_merged.add(s)
            w0 = st.i64[s, L.SM_W_OFF]
            rows = wk.i64[w0:w0 + st.i64[s, L.SM_W_LEN], L.WK_STAT_ROW]
            st.token_stat[s] = sketch_merge_rows(st.token_stat[rows])
            sketch.add_hist_rows(st.token_hist, np.full(len(rows), s, np.int64), st.token_stat[rows],
                                 st.token_hist[rows])

    def advance_in_slices(self, progress, slice_s: float | None = None) -> list[str]:
        """``advance()`` in virtual-time slices sized to take about ``slice_s`` wall
        seconds each (``PROGRESS_SLICE_S``), calling ``progress(sim_ms, done, total)``
        after each: the same end state as one call (stepping is exact)."""
        slice_s = PROGRESS_SLICE_S if slice_s is None else slice_s
        st = self.state.st
        step_ms = 1000.0
        horizon_ms = 0.0
        while True:
            live = np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE)
            if not live.any():
                return self.status
            horizon_ms = max(horizon_ms, float(st.now_ms[live].min())) + step_ms
            start_s = time.perf_counter()
            self.advance(horizon_ms)
            took_s = time.perf_counter() - start_s
            live = np.isin(st.i64[:, L.SM_STATUS], _RUNNABLE)
            sim_ms = float(st.now_ms[live].min()) if live.any() else float(st.now_ms.max(initial=0.0))
            progress(sim_ms, int(st.i64[:, L.SM_NUM_TERMINAL].sum()), int(st.i64[:, L.SM_Q_LEN].sum()))
            # next slice: scaled toward the wall-time target, at most 4x either way, and at
            # least a virtual millisecond so that every call moves the clock
            step_ms = max(1.0, step_ms * min(4.0, max(0.25, slice_s / max(took_s, 1e-6))))

    def _drain(self) -> None:
        """Move the pass logs and engine event logs out of the kernel state. A request
        in an event is kept as its simulation's logical row (the one ``requests(s)``
        numbers): kernel rows move when the batch grows."""
        st, pool = self.state.st, self.state.pool
        log_len = st.i64[:, L.SM_PASS_LOG_LEN]
        for s in np.flatnonzero(log_len):
            if self._spill is None:
                self._pass_chunks[s].append(st.pass_log[s, :log_len[s]].copy())
            else:
                self._spill.seek(0, os.SEEK_END)
                self._spill_index[s].append((self._spill.tell(), int(log_len[s])))
                self._spill.write(np.ascontiguousarray(st.pass_log[s, :log_len[s]]).tobytes())
            log_len[s] = 0
        if not self.event_rows:
            return
        event_len = pool.event_log[:, 0, L.EVH_LEN]
        for s in np.flatnonzero((event_len > 0) & (event_len <= self.event_rows)):
            self._event_chunks[s].append(drained_event_rows(self.state, s, event_len[s]))
            event_len[s] = 0

    def add_requests(self, s: int, workload: Workload) -> None:
        """Give simulation ``s`` the requests of ``workload`` (whole sessions; hash ids
        in the id space of its trace, e.g. ``workload.select_rows`` of the same file).
        Open loop: each session starts at its ``start_ms``, which must lie after the
        simulation's clock once it has been advanced. Closed loop: the new sessions
        queue behind the old ones for a concurrency slot. A finished simulation
        becomes live again."""
        self.add_requests_many([(s, workload)])

    def add_requests_many(self, items) -> None:
        """``add_requests`` for several simulations in one growth of the state (each
        simulation at most once in ``items``, a list of (s, workload)): every check
        passes before anything changes."""
        if not self.growable:
            raise ValueError("add_requests needs a BatchRun made with growable=True")
        plans = []
        for s, workload in items:
            sim = self.sims[s]
            if sim.placement == "kv_router":
                raise ValueError("add_requests does not grow a kv_router simulation yet (its router "
                                 "state is sized for the trace it started with)")
            code = int(self.state.st.i64[s, L.SM_STATUS])
            if code not in (L.SIM_RUNNING, L.SIM_PAUSED, L.SIM_DONE):
                raise SimulationError(f"simulation {self.sim_names[s]} is {L.SIM_STATUS_NAMES[code]}: "
                                      "it takes no more requests")
            if workload.num_requests == 0:
                continue
            # checks the trace block size; the simulation's token arrays grow in place
            merged = concat_workloads(sim.workload, workload, self._workload_buffers.setdefault(s, {}))
            now_ms = float(self.state.st.now_ms[s])
            if sim.concurrency == 0 and self._advanced[s]:
                starts = workload.start_ms[workload.order]
                if starts[0] <= now_ms:
                    raise ValueError(
                        f"simulation {self.sim_names[s]}: an added request starts at t={starts[0]:.6f} ms, "
                        f"not after the simulation's clock t={now_ms:.6f} ms")
            plans.append((s, workload, merged, code))
        if len({s for s, *_ in plans}) != len(plans):
            raise ValueError("add_requests_many: a simulation appears twice")
        state = self.state
        rows = []
        for s, workload, merged, code in plans:
            sim = self.sims[s]
            sizes = [table_key(workload, r)[1]
                     for r in [sim.rank] + ([sim.prefill_rank] if sim.disaggregated else [])]
            table_rows = append_workload_rows(state, workload, sizes)
            tpl = sim_template(dataclasses.replace(sim, workload=workload), table_rows, {})
            # the new sessions follow the old ones (release ties go by session)
            n_sessions = int(sim.workload.session.max(initial=-1)) + 1
            tpl = dataclasses.replace(
                tpl, rq_i=tpl.rq_i.shifted(L.RQ_SESSION, n_sessions),
                prefill_rq_i=None if tpl.prefill_rq_i is None
                else tpl.prefill_rq_i.shifted(L.RQ_SESSION, n_sessions))
            n_total = merged.num_requests
            grow = not self._fixed_queues[s]
            rows.append((s, tpl, n_total + 1 if grow else None, n_total + 1 if grow else None))
            self.sims[s] = dataclasses.replace(sim, workload=merged,
                                               queue_slots=n_total + 1 if grow else sim.queue_slots)
        if rows:
            add_rows_many(state, rows)
        for s, _, _, code in plans:
            if code == L.SIM_DONE:
                state.st.i64[s, L.SM_STATUS] = L.SIM_PAUSED

    # -- where each simulation stands ------------------------------------------------
    @property
    def status(self) -> list[str]:
        return [L.SIM_STATUS_NAMES[c] for c in self.state.st.i64[:, L.SM_STATUS]]

    @property
    def error(self) -> list[str]:
        return [self._error(s) for s in range(len(self.sims))]

    def _error(self, s: int) -> str:
        st = self.state.st
        code = int(st.i64[s, L.SM_STATUS])
        name = self.sim_names[s]
        if code == L.SIM_DEAD_END:
            in_flight = int(st.i64[s, L.SM_NUM_ARRIVED] - st.i64[s, L.SM_NUM_TERMINAL]
                            + st.i64[s, L.SM_NUM_NOT_SENT])
            if st.i64[s, L.SM_DEAD_IN_FLIGHT] >= 0:  # the reference counts one worker's
                in_flight = int(st.i64[s, L.SM_DEAD_IN_FLIGHT])
            return (f"simulation {name}: dead end at t={st.now_ms[s]:.6f} ms, an effect-free "
                    f"zero-duration pass with {in_flight} in-flight requests remaining, as the "
                    "reference reports it: they can never be scheduled (a request outgrows its KV "
                    "pool, or a preempted decode request blocks activated ones)")
        if code == L.SIM_ARENA_FULL:
            return f"simulation {name}: the block arena of a worker is full"
        if code == L.SIM_EVENTS_FULL:
            return f"simulation {name}: more engine events in one instant than {self.event_rows} log rows"
        if code == L.SIM_CAPACITY:
            sim = self.sims[s]
            return (f"simulation {name}: a worker's queue overflowed its {sim.queue_slots} slots at "
                    f"t={st.now_ms[s]:.6f} ms (placement {sim.placement}); raise queue_slots "
                    "or leave it unset to size the queues from the trace")
        return ""

    def offsets(self, s: int) -> tuple[int, int]:
        """The first kernel row and first worker of simulation s (they move as it grows)."""
        st = self.state.st
        return int(st.i64[s, L.SM_Q_OFF]), int(st.i64[s, L.SM_W_OFF])

    def now_ms(self, s: int) -> float:
        """The simulation's clock: the last instant it drained."""
        return float(self.state.st.now_ms[s])

    # -- tables so far ---------------------------------------------------------------
    def requests(self, s: int) -> pd.DataFrame:
        st = self.state.st
        agentic = None
        if st.i64[s, L.SM_AGENTIC]:
            # what its run decided (kernels.agentic.release): the lane each play ran on,
            # and each request's send and feedback batch in the order they happened
            q0 = int(st.i64[s, L.SM_Q_OFF])
            rows = st.ag_q[q0:q0 + len(self.sims[s].workload.input_len)]
            agentic = (st.ag_play[st.i64[s, L.SM_AG_PLAY_OFF]:st.i64[s, L.SM_AG_PLAY_END], L.AGP_LANE].copy(),
                       rows[:, L.AGQ_SENT_SEQ].copy(), rows[:, L.AGQ_ENDED_SEQ].copy())
        return request_frame(self.sims[s], self.state.rq, int(st.i64[s, L.SM_Q_OFF]),
                             int(st.i64[s, L.SM_W_OFF]), agentic)

    def passes(self, s: int) -> pd.DataFrame:
        return pass_frame(list(self.pass_chunks(s)))

    def pass_chunks(self, s: int) -> Iterator[np.ndarray]:
        """Simulation s's drained pass-log rows (raw PL_* columns), in drain order (read
        back one by one when they were spilled)."""
        for chunk in self._raw_pass_chunks(s):
            if any_attention_dp(self.sims[s]):
                # the kernel logs a pass under its rank: name the rank's worker and number
                chunk = chunk.copy()
                chunk[:, L.PL_WORKER], chunk[:, L.PL_RANK] = worker_and_rank(
                    self.sims[s], chunk[:, L.PL_WORKER].astype(np.int64))
            yield chunk

    def _raw_pass_chunks(self, s: int) -> Iterator[np.ndarray]:
        if self._spill is None:
            yield from self._pass_chunks[s]
            return
        dtype = self.state.st.pass_log.dtype
        width = self.state.st.pass_log.shape[2]
        for offset, rows in self._spill_index[s]:
            self._spill.seek(offset)
            data = self._spill.read(rows * width * dtype.itemsize)
            yield np.frombuffer(data, dtype).reshape(rows, width)

    def handoffs(self, s: int) -> pd.DataFrame:
        st = self.state.st
        return handoff_frame(self.sims[s], st.hlog[s, :st.i64[s, L.SM_HLOG_LEN]])

    def routing(self, s: int) -> pd.DataFrame:
        """The kv_router decisions of simulation s so far, in decision order."""
        st = self.state.st
        n = int(st.i64[s, L.SM_RT_LOG_LEN])
        return routing_frame(self.sims[s], st.rt_log[s, :n] if n else np.zeros((0, L.RL_NUM_COLUMNS)),
                              st.rt_costs[s, :n] if n else np.zeros((0, 0)))

    def kv_events(self, s: int) -> pd.DataFrame:
        return kv_event_frame(self.sims[s], event_rows(self._event_chunks[s]),
                               int(self.state.st.i64[s, L.SM_W_OFF]))

    def engine_events(self, s: int) -> pd.DataFrame:
        return engine_event_frame(self.sims[s], event_rows(self._event_chunks[s]),
                                   int(self.state.st.i64[s, L.SM_W_OFF]))

    def pressure_events(self, s: int) -> pd.DataFrame:
        return pressure_event_frame(self.sims[s], event_rows(self._event_chunks[s]),
                                     int(self.state.st.i64[s, L.SM_W_OFF]))

    def output_events(self, s: int) -> pd.DataFrame:
        return output_event_frame(self.sims[s], event_rows(self._event_chunks[s]),
                                   int(self.state.st.i64[s, L.SM_W_OFF]))

    def leftovers(self, s: int) -> dict:
        return leftovers_of(self.state.pool, self.state.wk, self.state.st, s)


def leftovers_of(pool: L.Pool, wk: L.Workers, st: L.Sims, s: int) -> dict:
    """State a finished simulation still holds: per worker (prefill pool first) the
    blocks counted active (referenced, pinned or reserved), queued requests and
    pending destinations, plus the driver's open handoffs, queued actions and
    transfers in flight. All zero when the run drained."""
    ws = slice(int(st.i64[s, L.SM_W_OFF]), int(st.i64[s, L.SM_W_OFF] + st.i64[s, L.SM_W_LEN]))
    pw = pool.w64[ws]
    wi = wk.i64[ws]
    active = pw[:, L.PW_NUM_COPIES] - pw[:, L.PW_LRU_LEN] + pw[:, L.PW_NUM_RESERVED]
    if pool.radix.w64.shape[0] > ws.start:
        # an SGLang worker's are the pages of its radix tree that some lease locks
        rw = pool.radix.w64[ws]
        active = active + rw[:, L.RW_PROTECTED] // np.maximum(rw[:, L.RW_PAGE_SIZE], 1)
    return {
        "active_blocks": active,
        "queued_requests": wi[:, L.WK_RUN_LEN] + wi[:, L.WK_WAIT_LEN] + wi[:, L.WK_SG_READY_LEN],
        "pending_destinations": wi[:, L.WK_PEND_LEN].copy(),
        "open_handoffs": int(st.i64[s, L.SM_OPEN_HANDOFFS]),
        "queued_actions": int(st.i64[s, L.SM_ACTQ_LEN]),
        "transfers_in_flight": int(st.i64[s, L.SM_XFER_LEN]),
    }


def merge_leftovers(parts: list[dict]) -> dict:
    """Leftovers of a simulation run as per-worker units, workers in order."""
    return {key: (np.concatenate([p[key] for p in parts]) if isinstance(parts[0][key], np.ndarray)
                  else sum(p[key] for p in parts)) for key in parts[0]}
