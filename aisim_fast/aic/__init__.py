"""Op-level (model x GPU) timing from aiconfigurator-core."""
