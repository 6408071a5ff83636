"""XXH3-64 and the prompt block-hash chains."""
