"""aisim_fast: a GPU-free simulator of LLM-inference clusters, request for request the
reference simulator's (AISimulate), as Numba kernels over numpy arrays.

The public surface (what the README uses)::

    from aisim_fast import load_spec, run_batch, simulation_from_setup

    setup = load_spec("payload.json")            # or parse_payload(a dict)
    result = run_batch([simulation_from_setup(setup)])
    result.requests[0], result.passes[0]          # pandas frames

``Simulation`` is one point built by hand (a ``load_trace`` workload, a ``RankConfig``,
a topology); ``BatchRun`` holds a batch in kernel state between steps; ``Rank`` /
``RankGroup`` drive scheduler ranks command by command; ``sweep`` and ``size`` run many
points. Each name is imported on first use, so ``import aisim_fast`` stays cheap for the
command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from aisim_fast.version import __version__

# public name -> the module that defines it
_HOMES = {
    "load_trace": ("aisim_fast.trace.workload", "load_mooncake"),
    "load_mooncake": ("aisim_fast.trace.workload", "load_mooncake"),
    "load_default_trace": ("aisim_fast.trace.workload", "load_default_trace"),
    "Workload": ("aisim_fast.trace.workload", "Workload"),
    "TraceError": ("aisim_fast.trace.workload", "TraceError"),
    "parse_payload": ("aisim_fast.config.payload", "parse_payload"),
    "load_spec": ("aisim_fast.config.payload", "load_spec"),
    "parse_rank": ("aisim_fast.config.payload", "parse_rank"),
    "ReplaySetup": ("aisim_fast.config.payload", "ReplaySetup"),
    "RankConfig": ("aisim_fast.config.payload", "RankConfig"),
    "ConfigError": ("aisim_fast.config.payload", "ConfigError"),
    "Simulation": ("aisim_fast.engine.simulation", "Simulation"),
    "simulation_from_setup": ("aisim_fast.engine.simulation", "simulation_from_setup"),
    "SimulationError": ("aisim_fast.engine.simulation", "SimulationError"),
    "run_batch": ("aisim_fast.engine.batch", "run_batch"),
    "BatchResult": ("aisim_fast.engine.batch", "BatchResult"),
    "BatchRun": ("aisim_fast.engine.batch_run", "BatchRun"),
    "Rank": ("aisim_fast.protocol.rank", "Rank"),
    "RankGroup": ("aisim_fast.protocol.rank", "RankGroup"),
    "run_sweep": ("aisim_fast.studies.sweeps", "run_sweep"),
    "size_deployment": ("aisim_fast.studies.sizing", "size"),
    "read_sweep_requests": ("aisim_fast.studies.sweeps", "read_point_requests"),
}

__all__ = [
    "__version__",
    # traces
    "load_trace", "load_mooncake", "load_default_trace", "Workload", "TraceError",
    # configurations
    "parse_payload", "load_spec", "parse_rank", "ReplaySetup", "RankConfig", "ConfigError",
    # simulations
    "Simulation", "simulation_from_setup", "run_batch", "BatchResult", "BatchRun", "SimulationError",
    # the rank protocol
    "Rank", "RankGroup",
    # many simulations
    "sweep", "size", "run_sweep", "size_deployment", "read_sweep_requests",
]
assert set(__all__) == {"__version__", "sweep", "size", *_HOMES}

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time each loads on first use
    from aisim_fast.config.payload import (ConfigError, RankConfig, ReplaySetup, load_spec, parse_payload,
                                           parse_rank)
    from aisim_fast.engine.batch import BatchResult, run_batch
    from aisim_fast.engine.batch_run import BatchRun
    from aisim_fast.engine.simulation import Simulation, SimulationError, simulation_from_setup
    from aisim_fast.protocol.rank import Rank, RankGroup
    from aisim_fast.studies.sizing import size as size_deployment
    from aisim_fast.studies.sweeps import read_point_requests as read_sweep_requests
    from aisim_fast.studies.sweeps import run_sweep
    from aisim_fast.trace.workload import TraceError, Workload, load_default_trace, load_mooncake
    from aisim_fast.trace.workload import load_mooncake as load_trace


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'aisim_fast' has no attribute {name!r}")
    module, attribute = _HOMES[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def sweep(spec, out=None, **kwargs):
    """Run a sweep (a spec file or dict) and return one row per point as a DataFrame;
    ``run_sweep`` has the options (jobs, scheduler, resume, ...)."""
    from aisim_fast.studies.sweeps import read_point_requests as read_sweep_requests
    from aisim_fast.studies.sweeps import run_sweep

    return run_sweep(spec, out, **kwargs)


def size(spec, sla, **kwargs):
    """Size a base payload (a dict or its file) for an SLA: one answer per offered load;
    ``size_deployment`` (``aisim_fast.studies.sizing.size``) has the options (trace,
    goodput, max_workers, rates)."""
    from aisim_fast.studies.sizing import size as size_deployment

    return size_deployment(spec, sla, **kwargs)
