"""Configurations: rank fields and execution payloads with the reference's names and defaults."""
