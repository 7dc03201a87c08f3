"""Shared pieces of the synthetic tasks: verl-format rows and the train/test file writer.

A task module provides ``DATA_SOURCE``, ``ALPHABET`` (every character its prompts and
answers use, for the char tokenizer), ``make_example(rng) -> (prompt, ground_truth,
answer, params)`` and ``compute_score(solution_str, ground_truth, extra_info=None)``; a
multi-turn one also ``demo_messages(row)`` (a ``messages`` column: the SFT demonstration)
and ``HIDDEN_ANSWER = True`` when its prompts do not determine the answer.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

from minihf.data.files import write_rows


MAX_ANSWER_DIGITS = 1000  # far above any task's answer; int() refuses past 4300 digits


def answer_int(text: str) -> int | None:
    """The integer an answer spells (``text`` already checked to be an optional sign and
    ASCII digits), or None past ``MAX_ANSWER_DIGITS`` digits: a model repeating a digit for
    thousands of tokens gives a wrong answer, not a ``ValueError`` that stops the run."""
    return int(text) if len(text) <= MAX_ANSWER_DIGITS else None


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
    rows = {
        split: [make_row(task.DATA_SOURCE, p, gt, ans, split, i, params) for i, (p, gt, ans, params) in enumerate(items)]
        for split, items in splits.items()
    }
    if hasattr(task, "demo_messages"):  # a multi-turn task: SFT learns from whole conversations
        for row in rows["train"] + rows["test"]:
            row["messages"] = task.demo_messages(row)
    return rows


def corrupt(task: ModuleType, answer: str, ground_truth, extra_info: dict, rng: random.Random,
            tries: int = 200, score=None, max_edits: int = 1) -> str | None:
    """A worse answer: random edits of ``answer`` (substitute, delete, insert or swap a
    character of the task's alphabet) until ``score(text, ground_truth, extra_info)`` (the
    task's reward by default) falls below the answer's; None if ``tries`` never lower it.
    Each try starts from ``answer`` with 1 edit, the later tries with up to ``max_edits``
    (the fewest edits that work, so the pair differs where it matters)."""
    score = score or task.compute_score
    best = score(answer, ground_truth, extra_info)
    chars = sorted(set(task.ALPHABET) | set(answer)) or ["0"]
    per_level = max(1, tries // max_edits)
    for t in range(tries):
        s = list(answer)
        for _ in range(min(max_edits, 1 + t // per_level)):
            _edit(s, chars, rng)
        candidate = "".join(s)
        if score(candidate, ground_truth, extra_info) < best:
            return candidate
    return None


def _edit(s: list[str], chars: list[str], rng: random.Random) -> None:
    """One random edit of ``s`` in place."""
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


def _sign(cost: float) -> int:
    return 1 if cost > 0 else -1


def pair_rows(task: ModuleType, rows: list[dict], seed: int, by: str = "reward",
              other_share: float = 0.5) -> list[dict]:
    """Preference pairs from task rows (rows where no pair is found are skipped).

    ``by="reward"``: ``chosen`` = the reference answer, ``rejected`` = something the task's
    rule reward scores lower: in ``other_share`` of the rows the reference answer of another
    row of the same length (well-formed, so a reward model must compare it with the prompt,
    not just check its form or length), else a random edit of the answer; ``extra_info``
    keeps both scores. ``by="cost"`` (a task
    with ``compute_cost``, for a cost model): ``chosen`` = the *costlier* of the reference
    answer and an edit of it whose cost differs, plus ``chosen_sign`` / ``rejected_sign``
    (+1 costly, -1 free), Safe-RLHF's safety labels; ``extra_info`` keeps both costs."""
    if by not in ("reward", "cost"):
        raise ValueError(f"pairs by {by!r}; choose 'reward' or 'cost'")
    if by == "cost" and not hasattr(task, "compute_cost"):
        raise ValueError(f"task {task.DATA_SOURCE!r} has no cost function; cost pairs need a task "
                         "with compute_cost (e.g. safe_sort)")
    rng = random.Random(seed)
    by_length: dict[int, list[str]] = {}
    for row in rows:
        by_length.setdefault(len(row["extra_info"]["answer"]), []).append(row["extra_info"]["answer"])
    pairs = []
    for row in rows:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        answer = info["answer"]
        if by == "reward":
            rejected = corrupt(task, answer, truth, info, rng)
            same = by_length.get(len(answer), [])
            other = same[rng.randrange(len(same))] if same else answer
            if rng.random() < other_share and task.compute_score(other, truth, info) < task.compute_score(
                    answer, truth, info):
                rejected = other  # well-formed, as long, but for another prompt: the score must read the prompt
            if rejected is None:
                continue
            chosen, extra = answer, {"chosen_score": float(task.compute_score(answer, truth, info)),
                                     "rejected_score": float(task.compute_score(rejected, truth, info))}
            signs = {}
        else:
            cost = task.compute_cost(answer, truth, info)
            flipped = corrupt(task, answer, truth, info, rng, max_edits=4,  # several 9s: several edits
                              score=task.compute_cost if cost > 0 else lambda *a: -task.compute_cost(*a))
            if flipped is None:
                continue
            chosen, rejected = (answer, flipped) if cost > 0 else (flipped, answer)
            costs = [float(task.compute_cost(x, truth, info)) for x in (chosen, rejected)]
            extra = {"chosen_cost": costs[0], "rejected_cost": costs[1]}
            signs = {"chosen_sign": _sign(costs[0]), "rejected_sign": _sign(costs[1])}
        pairs.append({"data_source": row["data_source"], "prompt": row["prompt"], "chosen": chosen,
                      "rejected": rejected, **signs, "reward_model": row["reward_model"],
                      "extra_info": {**info, **extra}})
    return pairs


def write_task_data(task: ModuleType, out_dir: str | Path, num_train: int, num_test: int, seed: int = 0,
                    pairs: bool = False, pairs_by: str = "reward") -> dict[str, Path]:
    """Write ``train``/``test`` as .parquet and .jsonl under ``out_dir``; returns the parquet paths.

    ``pairs``: preference rows (``prompt``, ``chosen``, ``rejected``, see :func:`pair_rows`)
    for reward-model training instead of prompts, ranked by ``pairs_by``."""
    out_dir = Path(out_dir)
    if num_train == 0 and num_test == 0:
        raise ValueError("train and test sizes are both 0: nothing to write")
    paths = {}
    for split, rows in generate_rows(task, num_train, num_test, seed).items():
        if pairs:
            rows = pair_rows(task, rows, seed + (split == "test"), by=pairs_by)
        if not rows:
            continue
        paths[split] = write_rows(rows, out_dir / f"{split}.parquet")
        write_rows(rows, out_dir / f"{split}.jsonl")
    return paths
