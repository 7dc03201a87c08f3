"""minihf.workers: FSDP2 role workers driven by the single controller.

``ActorRolloutRefWorker`` (policy + its rollout engine + frozen reference),
``CriticWorker``, ``RewardModelWorker``, ``LogProbWorker`` (a frozen LM's log-probs),
``TrainedRoleWorker`` (the base of a recipe role that trains) and
``RolloutWorker`` (the rollout engine alone, on ranks of its own); their config sections live in ``config.py``.
Shared mechanics: ``engine`` (meta build + sharded load, inference over micro-batches),
``train_state`` (``TrainState``: model + optimizer + schedule, update, save/load, used by
every trained role), ``optim`` (AdamW, LR schedule, global grad clipping), ``train_step``
(exactly normalised gradient accumulation), ``micro_batch`` (pure planning), ``packing``
(padding-free rows), ``forward`` (response-aligned log-probs / values / scores). Nothing
here imports ``minihf.trainer``: drivers sit above workers.
"""

import importlib

# Imported on first use, so that a config check (``minihf.workers.config``, which the
# launcher's parent process reads) does not import the FSDP and engine stack.
_HOMES = {"ActorRolloutRefWorker": "actor", "CriticWorker": "critic", "RewardModelWorker": "reward_model",
          "LogProbWorker": "log_prob", "RolloutWorker": "rollout", "TrainedRoleWorker": "trained_role",
          **{name: "config" for name in ("ActorConfig", "ActorRolloutRefConfig", "CriticConfig", "FSDPConfig",
                                          "LogProbConfig", "ModelConfig", "PolicyLossConfig", "RefConfig", "RewardModelConfig",
                                          "RLModelConfig", "RolloutConfig", "TrainedModelConfig", "ValKwargs")}}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"minihf.workers.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'minihf.workers' has no attribute {name!r}")
