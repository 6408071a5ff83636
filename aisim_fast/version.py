"""The package version, written into every output (``aisim_fast.version``)."""

__version__ = "0.1.0"
