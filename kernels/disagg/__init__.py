"""The prefill -> decode handoff inside the event loop, and the KV transfer delay."""
