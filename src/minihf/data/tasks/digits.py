"""``digits``: continue an arithmetic sequence modulo a number (verl's digit-completion idea).

Prompt ``"a,b:m,N"``: the sequence starts at ``a`` with step ``b``, taken mod ``m``; the
answer is the next ``N`` terms, comma separated: ``(a+b)%m, (a+2b)%m, ..., (a+Nb)%m``.
E.g. ``"3,4:10,4"`` -> ``"7,1,5,9"``. The reward is dense: the fraction of positions that
are right, over ``max(N, number of terms given)`` so that extra terms cost credit too.
"""

from __future__ import annotations

import random

from minihf.data.tasks.common import answer_int

DATA_SOURCE = "minihf/digits"
ALPHABET = "0123456789,:"
MAX_MODULUS = 20
MAX_TERMS = 6


def continuation(a: int, b: int, modulus: int, n: int) -> list[int]:
    return [(a + k * b) % modulus for k in range(1, n + 1)]


def make_example(rng: random.Random, max_modulus: int = MAX_MODULUS, max_terms: int = MAX_TERMS):
    modulus = rng.randint(2, max_modulus)
    a, b = rng.randrange(modulus), rng.randint(1, modulus - 1)
    n = rng.randint(1, max_terms)
    answer = ",".join(str(x) for x in continuation(a, b, modulus, n))
    params = {"start": a, "step": b, "modulus": modulus, "num_terms": n}
    return f"{a},{b}:{modulus},{n}", answer, answer, params


def parse_terms(text: str) -> list[int | None]:
    """Comma-separated integers; a term that is not an integer becomes None (scored wrong)."""
    terms: list[int | None] = []
    for part in text.strip().split(","):
        part = part.strip()
        # isascii: str.isdigit also accepts e.g. '²', which int() rejects
        terms.append(answer_int(part) if part.isascii() and part.isdigit() else None)
    return terms


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Fraction of the expected terms that are right, position by position (0.0 .. 1.0)."""
    expected = [int(x) for x in str(ground_truth).split(",")]
    given = parse_terms(solution_str) if solution_str.strip() else []
    correct = sum(1 for g, e in zip(given, expected) if g == e)
    return correct / max(len(expected), len(given))
