"""minihf: a lightweight, pure-PyTorch framework for reinforcement learning on language models.

One ``torchrun`` job; rank 0 is the single controller that runs the algorithm as a plain
program and sends commands to role worker groups over torch.distributed (HybridFlow without
Ray). See DESIGN.md in the repository for the map.
"""

__version__ = "0.1.0"
