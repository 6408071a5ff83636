"""Forward-pass timing: polynomial, fixed, op-level (AIC) tables."""
