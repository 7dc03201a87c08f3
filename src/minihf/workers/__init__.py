"""minihf.workers: FSDP2 role workers driven by the single controller.

``ActorRolloutRefWorker`` (policy + its rollout engine + frozen reference),
``CriticWorker`` and ``RewardModelWorker``; their config sections live in ``config.py``.
Shared mechanics: ``engine`` (meta build + sharded load, inference over micro-batches),
``train_state`` (``TrainState``: model + optimizer + schedule, update, save/load, used by
every trained role), ``optim`` (AdamW, LR schedule, global grad clipping), ``train_step``
(exactly normalised gradient accumulation), ``micro_batch`` (pure planning), ``packing``
(padding-free rows), ``forward`` (response-aligned log-probs / values / scores). Nothing
here imports ``minihf.trainer``: drivers sit above workers.
"""

from minihf.workers.actor import ActorRolloutRefWorker
from minihf.workers.config import (ActorConfig, ActorRolloutRefConfig, CriticConfig, FSDPConfig,
                                   ModelConfig, PolicyLossConfig, RefConfig, RewardModelConfig,
                                   RLModelConfig, RolloutConfig, ValKwargs)
from minihf.workers.critic import CriticWorker
from minihf.workers.reward_model import RewardModelWorker

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "ActorRolloutRefWorker", "CriticConfig",
    "CriticWorker", "FSDPConfig", "ModelConfig", "PolicyLossConfig", "RefConfig",
    "RewardModelConfig", "RewardModelWorker", "RLModelConfig", "RolloutConfig", "ValKwargs",
]
