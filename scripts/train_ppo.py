"""The main job: RL on a language model (PPO, GRPO, ... by recipe).

    torchrun --nproc_per_node=2 scripts/train_ppo.py               # the default recipe: grpo
    torchrun --nproc_per_node=2 scripts/train_ppo.py recipe=ppo trainer.total_training_steps=5
    python scripts/train_ppo.py recipe=grpo                        # one process

Arguments are ``recipe=NAME`` (``recipes/<name>/config.yaml``, or a path) and dotted
overrides of ``minihf.trainer.ppo_job.PPOJobConfig`` (verl's keys, e.g.
``actor_rollout_ref.actor.optim.lr=1e-4 data.train_batch_size=16``). The default recipe
builds what it needs under ``outputs/`` when absent (task data, a random-init model and
its SFT warm start), validates, trains, validates, saves and prints a summary. Same as
``minihf train``.
"""

from __future__ import annotations

import sys

import minihf.utils.script_start  # noqa: F401 - first: Ctrl-C and a dead launcher during the imports below
from minihf.controller import run_script
from minihf.launcher import main

if __name__ == "__main__":
    run_script(lambda argv: main("train", argv), sys.argv[1:])
