"""``arith``: add or subtract two multi-digit integers; exact-match reward.

Prompt ``"123+45="`` -> answer ``"168"``; ``"12-345="`` -> ``"-333"``. The reward is 1.0
when the response (stripped; text after a final ``=`` if the model repeats the equation)
is exactly the integer result, else 0.0.
"""

from __future__ import annotations

import random
import re

from minihf.data.tasks.common import answer_int

DATA_SOURCE = "minihf/arith"
ALPHABET = "0123456789+-="
MAX_DIGITS = 3

_INT = re.compile(r"-?\d+")


def make_example(rng: random.Random, max_digits: int = MAX_DIGITS):
    x = rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)
    y = rng.randint(0, 10 ** rng.randint(1, max_digits) - 1)
    op = rng.choice("+-")
    result = x + y if op == "+" else x - y
    return f"{x}{op}{y}=", str(result), str(result), {"x": x, "y": y, "op": op}


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the answer is exactly the right integer, else 0.0 (malformed answers score 0)."""
    answer = solution_str.strip().rsplit("=", 1)[-1].strip()
    if not _INT.fullmatch(answer):
        return 0.0
    return 1.0 if answer_int(answer) == int(ground_truth) else 0.0
