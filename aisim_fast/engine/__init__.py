"""The batch engine: simulations lowered into kernel state, run, grown and turned into tables."""
