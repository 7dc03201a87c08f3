"""minihf.trainer."""
