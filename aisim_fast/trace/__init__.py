"""Traces: loading, validation, workloads."""
