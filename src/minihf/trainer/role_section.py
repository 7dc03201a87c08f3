"""A role a recipe adds (``roles.<name>`` of the RL config): its worker, its model and
scoring settings (``LogProbConfig``), and how it trains when it does (``train``, the
critic's keys). ``PPOConfig.roles`` maps names to these sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minihf.workers.config import LogProbConfig
from minihf.workers.optim import OptimConfig
from minihf.workers.section_checks import check_ppo_update


@dataclass
class RoleTrainConfig:
    """How a recipe role trains (``roles.<name>.train``), the critic's keys: its worker (a
    ``minihf.workers.TrainedRoleWorker``) updates on each step's rows with its own optimizer
    and LR schedule, and is checkpointed and resumed with the run."""
    enable: bool = False                 # the role trains (its worker must subclass TrainedRoleWorker)
    ppo_mini_batch_size: int = 16        # sequences per optimizer step, global
    ppo_micro_batch_size_per_gpu: Optional[int] = 4  # rows per forward/backward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per micro-batch (wins when set)
    ppo_epochs: int = 1                  # passes over each step's batch
    shuffle: bool = False                # reshuffle rows each epoch
    loss_agg_mode: str = "token-mean"    # how the worker's token losses are averaged (see agg_loss)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))

    def __post_init__(self):
        check_ppo_update(self)


@dataclass
class RoleSection(LogProbConfig):
    """A role a recipe adds (``roles.<name>``): its worker class built with this section,
    placed by ``controller.placement.<name>`` and initialised; trained, checkpointed and
    resumed when ``train.enable``. The default worker scores response tokens
    (``<name>_log_prob``); a recipe's own class reads what it needs of this section,
    ``options`` included."""
    worker: str = "LogProbWorker"        # a minihf.workers class or file.py:Class, built as worker(section)
    options: dict = field(default_factory=dict)  # free-form settings for a recipe's worker class
    train: RoleTrainConfig = field(default_factory=RoleTrainConfig)  # the role's own updates (off: frozen)

    def __post_init__(self):
        super().__post_init__()
        from minihf.utils.imports import check_ref, is_code_ref
        import minihf.workers

        if is_code_ref(self.worker):
            try:
                check_ref(self.worker, "worker class")
            except (FileNotFoundError, AttributeError) as e:
                raise ValueError(f"worker: {e}") from None
        elif self.worker not in minihf.workers.__all__ or self.worker.endswith("Config"):
            from minihf.config import suggest

            workers = [w for w in minihf.workers.__all__ if w.endswith("Worker")]
            raise ValueError(f"worker={self.worker!r} is not a worker class; {suggest(self.worker, workers)}"
                             f"choose one of {workers} or name one in a file: path/to/file.py:Class")
        if not self.model.path:
            raise ValueError("model.path is not set; name the role's checkpoint dir")
