"""minihf.workers."""
