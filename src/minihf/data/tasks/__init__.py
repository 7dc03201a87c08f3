"""Synthetic tasks with generators and reward functions: ``digits``, ``sort``, ``arith``,
``countdown``, ``chat_arith`` (English prompts for a pretrained chat model),
``safe_sort`` (``sort`` with a costly digit: a task with a ``compute_cost`` for Safe-RLHF),
``guess`` (a multi-turn game for an environment: find a hidden digit), ``tool_arith``
(multiplication with a calculator tool; ``chat_tool_arith`` asks it in English) and
``chat_code`` (small Python functions, scored by unit tests in the sandbox).

``TASKS`` maps a task name to its module; ``make_task_data(name, out_dir, ...)`` writes
train/test files in verl's format.
"""

from __future__ import annotations

from pathlib import Path

from minihf.data.tasks import (arith, chat_arith, chat_code, chat_tool_arith, countdown, digits, guess,
                               safe_sort, sort, tool_arith)
from minihf.data.tasks.common import write_task_data

TASKS = {"digits": digits, "sort": sort, "arith": arith, "countdown": countdown,
         "chat_arith": chat_arith, "safe_sort": safe_sort, "guess": guess,
         "tool_arith": tool_arith, "chat_tool_arith": chat_tool_arith, "chat_code": chat_code}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


def make_task_data(name: str, out_dir: str | Path, num_train: int = 1000, num_test: int = 100, seed: int = 0,
                   pairs: bool = False, pairs_by: str = "reward") -> dict[str, Path]:
    """Write ``train``/``test`` .parquet and .jsonl files for task ``name`` (prompts, or
    preference pairs with ``pairs``, ranked by the task's ``reward`` or ``cost``); returns
    the parquet paths."""
    return write_task_data(get_task(name), out_dir, num_train, num_test, seed, pairs=pairs, pairs_by=pairs_by)
