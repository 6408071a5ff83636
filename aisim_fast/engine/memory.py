"""How much memory a batch of kernel state takes, and the check that it fits."""

from __future__ import annotations

from collections.abc import Sequence

from aisim_fast.engine.simulation import Simulation, SimulationError
from aisim_fast.engine.templates import SimTemplate, pow2_at_least
from aisim_fast.kernels.schema import layout as L
from aisim_fast.kernels.stats import sketch


class StateTooLarge(SimulationError):
    """The kernel state of a batch would not fit in the memory available."""


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def state_bytes(sims: Sequence[Simulation], templates: Sequence[SimTemplate], n_q: int,
                pass_log_rows: int, event_rows: int = 0) -> int:
    """Bytes of the kernel state ``build_state`` allocates for these simulations and
    their templates (the arrays the kernels touch; the workload tables aside)."""
    n_sims = len(sims)
    lease = sum(t.lease_entries + t.prefill_lease_entries for t in templates)
    n_w = arena = tab = queues = 0
    for t in templates:
        for _, n_workers, pool in t.pools:
            n_w += n_workers
            arena += n_workers * pool.arena
            tab += n_workers * pow2_at_least(2 * pool.arena)
            queues += n_workers * (pool.run_cap + pool.wait_cap)
    per_worker = (L.CFG_I_FIELDS + L.CFG_F_FIELDS + L.WK_FIELDS + L.PW_FIELDS + 2) * 8
    return int(n_q * (L.RQ_I_FIELDS + L.RQ_F_FIELDS) * 8 + lease * 12
               + arena * (L.PB_FIELDS * 4 + 8) + tab * 4 + queues * 8 + n_w * per_worker
               + n_sims * (pass_log_rows * L.PL_NUM_COLUMNS * 8
                           + (sketch.TOKEN_STAT_WIDTH + sketch.TOKEN_HIST_WIDTH) * 8
                           + (1 + event_rows) * L.EV_NUM_COLUMNS * 8 + L.SM_FIELDS * 8)
               + 4 * n_q * 8)


def check_state_fits(sims, templates, n_q, pass_log_rows, event_rows=0) -> None:
    """Refuse a batch whose state would not fit in the available memory (with a
    quarter to spare for the driver and the outputs), before allocating any of it."""
    need = state_bytes(sims, templates, n_q, pass_log_rows, event_rows)
    have = available_memory_bytes()
    if have is not None and need > 0.75 * have:
        workers = sum(s.ranks + s.prefill_ranks for s in sims)
        raise StateTooLarge(
            f"the batch needs about {_size(need)} of simulator state ({len(sims)} kernel unit(s), "
            f"{workers} workers, {n_q} request rows), {_size(have)} is available: use fewer "
            "workers or requests, or a smaller --batch-size")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.0f} MiB"
