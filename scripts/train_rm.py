"""Reward-model training (Bradley-Terry on preference pairs, FSDP2).

    minihf make-data sort outputs/data/sort_pairs --pairs
    python scripts/train_rm.py model.path=M data.train_files=outputs/data/sort_pairs/train.parquet ...
    torchrun --nproc_per_node=2 scripts/train_rm.py recipe=NAME key=value ...

Arguments are ``RMConfig`` overrides (``minihf.trainer.rm``), optionally ``recipe=``.
Same as ``minihf rm ...``. The run dir's ``hf/`` loads in transformers as
``AutoModelForSequenceClassification``; use it as ``reward_model.model.path`` in RL.
"""

from __future__ import annotations

import sys

import minihf.utils.script_start  # noqa: F401 - first: Ctrl-C and a dead launcher during the imports below
from minihf.controller import run_script
from minihf.launcher import main

if __name__ == "__main__":
    run_script(lambda argv: main("rm", argv), sys.argv[1:])
