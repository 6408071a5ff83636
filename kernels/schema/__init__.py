"""The kernels' state, declared once: every column of every table (``schema.layout``)."""
