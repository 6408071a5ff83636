"""Speculative decoding: the acceptance draws and the multi-token passes."""
