"""``sort``: sort a list of digits ascending; partial credit per position.

Prompt ``"5,3,8,1"`` -> answer ``"1,3,5,8"``. The reward is the fraction of positions that
hold the right digit, over ``max(len(expected), len(given))`` so that missing and extra
items both cost credit. A small model learns the format from a short SFT and the rest
from the reward, which makes it the main job's task (the score moves within minutes on a
CPU); ``digits`` (modular arithmetic) needs far more training at that size.
"""

from __future__ import annotations

import random

from minihf.data.tasks.digits import parse_terms

DATA_SOURCE = "minihf/sort"
ALPHABET = "0123456789,"
MIN_ITEMS, MAX_ITEMS = 2, 6


def make_example(rng: random.Random, min_items: int = MIN_ITEMS, max_items: int = MAX_ITEMS):
    items = [rng.randrange(10) for _ in range(rng.randint(min_items, max_items))]
    answer = ",".join(str(x) for x in sorted(items))
    return ",".join(str(x) for x in items), answer, answer, {"num_items": len(items)}


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Fraction of positions right (0.0 .. 1.0)."""
    expected = [int(x) for x in str(ground_truth).split(",")]
    given = parse_terms(solution_str) if solution_str.strip() else []
    correct = sum(1 for g, e in zip(given, expected) if g == e)
    return correct / max(len(expected), len(given))
