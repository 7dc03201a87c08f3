"""minihf: a lightweight, pure-PyTorch framework for reinforcement learning on language models.

One ``torchrun`` job; rank 0 is the single controller that runs the algorithm as a plain
program and sends commands to role worker groups over torch.distributed (HybridFlow without
Ray). The map: docs/architecture.md in the repository.
"""

__version__ = "0.1.0"

__all__ = ["train", "train_sft", "train_rm", "TrainResult"]


def __getattr__(name: str):
    # the entry points import torch: only when used, so `import minihf` stays instant
    if name in __all__:
        from minihf import api

        return getattr(api, name)
    raise AttributeError(f"module 'minihf' has no attribute {name!r}")
