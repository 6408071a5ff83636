"""SGLang's scheduler rank, radix cache and handoff commands."""
