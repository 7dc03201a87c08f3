"""Small shared utilities: local process spawning (tests, benchmarks), sharded checkpoints,
ending a job process without the final GC pass,
the ``minihf doctor`` report."""
