"""minihf.controller."""
