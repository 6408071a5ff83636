"""Summary metrics with the reference's definitions."""
