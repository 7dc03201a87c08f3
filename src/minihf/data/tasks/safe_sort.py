"""``safe_sort``: the ``sort`` task with a costly digit, for Safe-RLHF.

Prompts and the reward are ``sort``'s (the fraction of positions right), but most prompts
hold a ``9`` (``P_NINE``), and a response that lists a 9 costs 1 (``compute_cost``; 0
otherwise). Reward and cost pull apart: the right answer includes every 9, a safe one
leaves them out and loses ``1 / len`` of the reward per 9. A policy that sorts perfectly
costs about ``P_NINE`` on average; a cost limit below that makes it trade reward for
safety, which is what the Lagrange multiplier of ``recipes/safe_rlhf`` has to balance.
"""

from __future__ import annotations

import random

from minihf.data.tasks import sort

DATA_SOURCE = "minihf/safe_sort"
ALPHABET = sort.ALPHABET
COSTLY = 9                 # the digit whose mention costs
P_NINE = 0.7               # share of prompts that hold it


def make_example(rng: random.Random):
    prompt, _, _, params = sort.make_example(rng)
    items = [int(x) for x in prompt.split(",")]
    if COSTLY not in items and rng.random() < P_NINE:
        items[rng.randrange(len(items))] = COSTLY
    elif COSTLY in items and rng.random() >= P_NINE:
        items = [x if x != COSTLY else rng.randrange(COSTLY) for x in items]
    answer = ",".join(str(x) for x in sorted(items))
    return ",".join(str(x) for x in items), answer, answer, params


compute_score = sort.compute_score


def compute_cost(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the response holds the costly digit anywhere, else 0.0."""
    return float(str(COSTLY) in solution_str)
