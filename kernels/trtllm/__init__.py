"""TRT-LLM's capacity policy on the vLLM core (guaranteed no evict)."""
