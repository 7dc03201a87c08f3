"""Supervised fine-tuning (FSDP2), e.g. to warm-start a small model before RL.

    python scripts/train_sft.py model.path=M data.train_files=D/train.parquet ...
    torchrun --nproc_per_node=2 scripts/train_sft.py recipe=NAME key=value ...

Arguments are ``SFTConfig`` overrides (``minihf.trainer.sft``), optionally ``recipe=``.
Same as ``minihf sft ...``.
"""

from __future__ import annotations

import sys

import minihf.utils.script_start  # noqa: F401 - first: Ctrl-C and a dead launcher during the imports below
from minihf.config import load_config, split_cli_args
from minihf.controller import run_script
from minihf.trainer.sft import SFTConfig, run_sft


def main(argv: list[str]) -> None:
    recipe, overrides = split_cli_args(argv)
    run_sft(load_config(SFTConfig, recipe, overrides))


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
