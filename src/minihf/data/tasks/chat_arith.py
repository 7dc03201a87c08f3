"""``chat_arith``: add two integers of 1..50, asked in English, for a pretrained chat model.

Prompt ``"What is 47 + 8? Answer with just the number."`` -> ``"55"``. Made for small instruct
models behind a chat template (the ``grpo_smollm2_arith`` recipe): the response is free
text, so the answer is the number after the last ``####`` if the response has one, else
the last number in it (``"47 + 8 = 55."`` -> 55; thousands commas are dropped). Reward 1.0
for exactly the right integer, else 0.0. The range keeps SmolLM2-135M-Instruct's start
at ~20% of sampled answers right (~10% for 1..99): enough groups with a signal for GRPO.
"""

from __future__ import annotations

import random
import re

from minihf.data.tasks.common import answer_int

DATA_SOURCE = "minihf/chat_arith"
TEMPLATE = "What is {x} + {y}? Answer with just the number."
ALPHABET = "".join(sorted(set(TEMPLATE.replace("{x}", "").replace("{y}", "") + "0123456789#-,=.")))
MAX_VALUE = 50

_MARKED = re.compile(r"####\s*(-?[\d,]*\d)")
_NUMBER = re.compile(r"-?\d[\d,]*")


def make_example(rng: random.Random, max_value: int = MAX_VALUE):
    x, y = rng.randint(1, max_value), rng.randint(1, max_value)
    answer = str(x + y)
    return TEMPLATE.format(x=x, y=y), answer, answer, {"x": x, "y": y}


def extract_answer(solution_str: str) -> str | None:
    """The number after the last ``####``, else the last number; None if there is none."""
    marked = _MARKED.findall(solution_str)
    found = marked or _NUMBER.findall(solution_str)
    if not found:
        return None
    return found[-1].replace(",", "")


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the extracted answer is exactly the right integer, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None or not re.fullmatch(r"-?\d+", answer):
        return 0.0
    return 1.0 if answer_int(answer) == int(ground_truth) else 0.0
