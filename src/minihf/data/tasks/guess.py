"""``guess``: find a hidden digit in a range by guessing, told higher or lower (multi-turn).

Prompt ``"3-8"``: the secret is an integer in 3..8. Each assistant turn is one guess (a
digit); the environment (``recipes/grpo_guess_number/env.py``) answers ``>`` (the secret is
larger), ``<`` (smaller) or ends the episode when the guess is right. The prompt does not
determine the answer (``HIDDEN_ANSWER``): test prompts may repeat training prompts, with
other secrets.

``extra_info.answer`` is the secret; the row's ``messages`` column is a demonstration for
the SFT warm start: guesses consistent with the feedback, half of them a slow upward scan
from the low end and half uniform among the digits still possible (so RL has turns to save),
cut at ``MAX_TURNS``. The rule reward (``compute_score``, for evaluation outside the
environment) is 1.0 when the last guess in the assistant text is the secret.
"""

from __future__ import annotations

import random

DATA_SOURCE = "minihf/guess"
ALPHABET = "0123456789<>-?"
HIDDEN_ANSWER = True
MAX_TURNS = 6


def feedback(guess: int, secret: int) -> str | None:
    """The environment's answer to ``guess``: None when right, else ``>`` or ``<``."""
    return None if guess == secret else (">" if secret > guess else "<")


def demo_guesses(rng: random.Random, lo: int, hi: int, secret: int) -> list[int]:
    scan = rng.random() < 0.5
    low, high, out = lo, hi, []
    while len(out) < MAX_TURNS:
        g = low if scan else rng.randint(low, high)
        out.append(g)
        if g == secret:
            break
        low, high = (g + 1, high) if secret > g else (low, g - 1)
    return out


def make_example(rng: random.Random):
    lo = rng.randint(0, 6)
    hi = rng.randint(lo + 3, 9)
    secret = rng.randint(lo, hi)
    guesses = demo_guesses(rng, lo, hi, secret)
    return f"{lo}-{hi}", str(secret), str(secret), {"lo": lo, "hi": hi, "demo": guesses}


def demo_messages(row: dict) -> list[dict]:
    """The SFT demonstration of a row: user prompt, then guess / feedback turns."""
    secret = int(row["reward_model"]["ground_truth"])
    msgs = list(row["prompt"])
    for g in row["extra_info"]["demo"]:
        msgs.append({"role": "assistant", "content": str(g)})
        answer = feedback(g, secret)
        if answer is None:
            break
        msgs.append({"role": "user", "content": answer})
    if msgs[-1]["role"] == "user":  # cut at MAX_TURNS: end on the model's turn
        msgs.pop()
    return msgs


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the last digit of the assistant text (its last guess) is the secret."""
    digits = [c for c in solution_str if c.isdigit()]
    return 1.0 if digits and digits[-1] == str(ground_truth) else 0.0
