"""minihf.parallel: parallelism applied to a model after construction.

``fsdp.apply_fsdp`` shards a model for training (FSDP2, column-parallel weights on dim 0,
row-parallel on dim 1); ``tp.apply_tp`` rewrites it for tensor-parallel generation. Model
files know nothing of either.
"""

from minihf.parallel.fsdp import apply_fsdp

__all__ = ["apply_fsdp"]
