"""The event loop of a simulation and its steps: arrivals, the busy heap, the rank queues,
the pass dispatch, token output, the pass log."""
