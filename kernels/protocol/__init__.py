"""One rank driven command by command (the rank protocol's kernel side)."""
