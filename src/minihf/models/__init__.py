"""minihf.models."""
