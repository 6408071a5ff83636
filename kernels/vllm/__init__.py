"""The vLLM scheduler core (shared by TRT-LLM), its capacity policy hooks, decode steps and
decode runs."""
