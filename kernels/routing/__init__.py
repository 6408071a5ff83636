"""Which worker a request goes to: round robin, random, the KV router."""
