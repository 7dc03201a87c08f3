"""minihf: a lightweight, pure-PyTorch framework for reinforcement learning on language models.

One ``torchrun`` job; rank 0 is the single controller that runs the algorithm as a plain
program and sends commands to role worker groups over torch.distributed (HybridFlow without
Ray). The map: docs/architecture.md in the repository.
"""

from minihf.utils.host_memory import enable_huge_pages

# before torch's first CPU allocation, which reads it: large tensors on huge pages
# (fewer page faults in each training step; minihf.utils.host_memory says why and how much)
enable_huge_pages()

__version__ = "0.1.0"

__all__ = ["train", "train_sft", "train_rm", "TrainResult"]


def __getattr__(name: str):
    # the entry points import torch: only when used, so `import minihf` stays instant
    if name in __all__:
        from minihf import api

        return getattr(api, name)
    raise AttributeError(f"module 'minihf' has no attribute {name!r}")
