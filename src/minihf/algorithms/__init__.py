"""minihf.algorithms."""
