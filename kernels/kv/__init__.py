"""The paged KV block pool of a worker and a request's lease on it."""
