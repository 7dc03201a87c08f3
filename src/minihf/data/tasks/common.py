"""Shared pieces of the synthetic tasks: verl-format rows and the train/test file writer.

A task module provides ``DATA_SOURCE``, ``ALPHABET`` (every character its prompts and
answers use, for the char tokenizer), ``make_example(rng) -> (prompt, ground_truth,
answer, params)`` and ``compute_score(solution_str, ground_truth, extra_info=None)``.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

from minihf.data.files import write_rows


def make_row(data_source: str, prompt: str, ground_truth, answer: str, split: str, index: int, params: dict) -> dict:
    """One row in verl's format; ``extra_info.answer`` is a reference response (useful for SFT)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, **params},
    }


def generate_rows(task: ModuleType, num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """Train and test rows; test prompts never appear in train when the task has enough distinct ones."""
    if num_train < 0 or num_test < 0:
        raise ValueError(f"sizes must be >= 0, got train={num_train} test={num_test}")
    rng = random.Random(seed)
    seen: set[str] = set()
    examples = []
    attempts = 0
    while len(examples) < num_train + num_test:
        attempts += 1
        example = task.make_example(rng)
        if example[0] in seen and attempts < 20 * (num_train + num_test):
            continue  # the task space may be small; after many tries, allow repeats
        seen.add(example[0])
        examples.append(example)
    splits = {"train": examples[:num_train], "test": examples[num_train:]}
    return {
        split: [make_row(task.DATA_SOURCE, p, gt, ans, split, i, params) for i, (p, gt, ans, params) in enumerate(items)]
        for split, items in splits.items()
    }


def write_task_data(task: ModuleType, out_dir: str | Path, num_train: int, num_test: int, seed: int = 0) -> dict[str, Path]:
    """Write ``train``/``test`` as .parquet and .jsonl under ``out_dir``; returns the parquet paths."""
    out_dir = Path(out_dir)
    paths = {}
    for split, rows in generate_rows(task, num_train, num_test, seed).items():
        if not rows:
            continue
        paths[split] = write_rows(rows, out_dir / f"{split}.parquet")
        write_rows(rows, out_dir / f"{split}.jsonl")
    return paths
