"""Agentic replay: requests released by a dependency graph (the ``agentic`` feature)."""
