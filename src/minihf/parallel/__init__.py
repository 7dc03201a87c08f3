"""minihf.parallel."""
