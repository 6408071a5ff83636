"""Token-gap statistics and the DDSketch."""
