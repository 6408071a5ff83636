"""Attention DP: a worker as a group of ranks behind one pass barrier."""
