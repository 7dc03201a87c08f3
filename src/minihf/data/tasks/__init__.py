"""Synthetic tasks with generators and reward functions: ``digits``, ``sort``, ``arith``,
``countdown``, and ``chat_arith`` (English prompts for a pretrained chat model).

``TASKS`` maps a task name to its module; ``make_task_data(name, out_dir, ...)`` writes
train/test files in verl's format.
"""

from __future__ import annotations

from pathlib import Path

from minihf.data.tasks import arith, chat_arith, countdown, digits, sort
from minihf.data.tasks.common import write_task_data

TASKS = {"digits": digits, "sort": sort, "arith": arith, "countdown": countdown,
         "chat_arith": chat_arith}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


def make_task_data(name: str, out_dir: str | Path, num_train: int = 1000, num_test: int = 100, seed: int = 0,
                   pairs: bool = False) -> dict[str, Path]:
    """Write ``train``/``test`` .parquet and .jsonl files for task ``name`` (prompts, or
    preference pairs with ``pairs``); returns the parquet paths."""
    return write_task_data(get_task(name), out_dir, num_train, num_test, seed, pairs=pairs)
