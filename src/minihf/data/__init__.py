"""minihf.data."""
