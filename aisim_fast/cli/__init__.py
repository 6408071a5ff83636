"""The ``aisim-fast`` command line (``app``: parser, commands, console)."""

from aisim_fast.cli.app import main

__all__ = ["main"]
