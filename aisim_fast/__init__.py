"""aisim_fast: batch LLM-inference cluster simulator with Numba kernels over numpy arrays."""

__version__ = "0.1.0"


def sweep(spec, out=None, **kwargs):
    """Run a sweep (a spec file or dict) and return one row per point as a DataFrame;
    ``aisim_fast.studies.sweeps.run_sweep`` has the options (jobs, scheduler, resume, ...)."""
    from aisim_fast.studies.sweeps import run_sweep

    return run_sweep(spec, out, **kwargs)


def size(spec, sla, **kwargs):
    """Size a base payload (a dict or its file) for an SLA: one answer per offered load;
    ``aisim_fast.studies.sizing.size`` has the options (trace, goodput, max_workers, rates)."""
    from aisim_fast.studies.sizing import size as _size

    return _size(spec, sla, **kwargs)
