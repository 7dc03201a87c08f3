"""minihf.parallel."""
from minihf.parallel.fsdp import apply_fsdp  # noqa: E402,F401
