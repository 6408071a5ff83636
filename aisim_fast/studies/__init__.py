"""Many simulations: sweeps, sizing, plots."""
