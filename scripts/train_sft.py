"""Supervised fine-tuning (FSDP2), e.g. to warm-start a small model before RL.

    python scripts/train_sft.py model.path=M data.train_files=D/train.parquet ...
    torchrun --nproc_per_node=2 scripts/train_sft.py recipe=NAME key=value ...

Arguments are ``SFTConfig`` overrides (``minihf.trainer.sft``), optionally ``recipe=``.
Same as ``minihf sft ...``.
"""

from __future__ import annotations

import sys

import minihf.utils.script_start  # noqa: F401 - first: Ctrl-C and a dead launcher during the imports below
from minihf.controller import run_script
from minihf.launcher import main

if __name__ == "__main__":
    run_script(lambda argv: main("sft", argv), sys.argv[1:])
