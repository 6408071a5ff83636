"""aisim_fast: batch LLM-inference cluster simulator with Numba kernels over numpy arrays."""

__version__ = "0.1.0"
