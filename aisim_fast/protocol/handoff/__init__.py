"""The prefill -> decode handoff coordinator and its audit of kernel runs."""
