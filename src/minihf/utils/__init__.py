"""Small shared utilities: local process spawning (tests, benchmarks), sharded checkpoints,
a quick process exit (no final GC pass), the ``minihf doctor`` report."""
