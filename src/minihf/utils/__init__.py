"""Small shared utilities: local process spawning (tests, benchmarks), sharded checkpoints,
the ``minihf doctor`` report."""
