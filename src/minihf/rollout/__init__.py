"""minihf.rollout."""
