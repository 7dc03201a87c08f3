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


def corrupt(task: ModuleType, answer: str, ground_truth, extra_info: dict, rng: random.Random,
            tries: int = 200) -> str | None:
    """A worse answer: random edits of ``answer`` (substitute, delete, insert or swap a
    character of the task's alphabet) until the task's reward falls below the answer's;
    None if ``tries`` edits never lower it."""
    best = task.compute_score(answer, ground_truth, extra_info)
    chars = sorted(set(task.ALPHABET) | set(answer)) or ["0"]
    for _ in range(tries):
        s = list(answer)
        op = rng.choice(("sub", "del", "ins", "swap")) if s else "ins"
        i = rng.randrange(len(s)) if s else 0
        if op == "sub":
            s[i] = rng.choice(chars)
        elif op == "del" and len(s) > 1:
            del s[i]
        elif op == "swap" and len(s) > 1:
            j = rng.randrange(len(s))
            s[i], s[j] = s[j], s[i]
        else:
            s.insert(i, rng.choice(chars))
        candidate = "".join(s)
        if task.compute_score(candidate, ground_truth, extra_info) < best:
            return candidate
    return None


def pair_rows(task: ModuleType, rows: list[dict], seed: int) -> list[dict]:
    """Preference pairs from task rows: ``chosen`` = the reference answer, ``rejected`` = a
    corruption that the task's rule reward scores lower (rows where none is found are
    skipped); ``extra_info`` keeps both scores."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        rejected = corrupt(task, info["answer"], truth, info, rng)
        if rejected is None:
            continue
        pairs.append({"data_source": row["data_source"], "prompt": row["prompt"], "chosen": info["answer"],
                      "rejected": rejected, "reward_model": row["reward_model"],
                      "extra_info": {**info, "chosen_score": float(task.compute_score(info["answer"], truth, info)),
                                     "rejected_score": float(task.compute_score(rejected, truth, info))}})
    return pairs


def write_task_data(task: ModuleType, out_dir: str | Path, num_train: int, num_test: int, seed: int = 0,
                    pairs: bool = False) -> dict[str, Path]:
    """Write ``train``/``test`` as .parquet and .jsonl under ``out_dir``; returns the parquet paths.

    ``pairs``: preference rows (``prompt``, ``chosen``, ``rejected``, see :func:`pair_rows`)
    for reward-model training instead of prompts."""
    out_dir = Path(out_dir)
    if num_train == 0 and num_test == 0:
        raise ValueError("train and test sizes are both 0: nothing to write")
    paths = {}
    for split, rows in generate_rows(task, num_train, num_test, seed).items():
        if pairs:
            rows = pair_rows(task, rows, seed + (split == "test"))
        if not rows:
            continue
        paths[split] = write_rows(rows, out_dir / f"{split}.parquet")
        write_rows(rows, out_dir / f"{split}.jsonl")
    return paths
