"""``countdown``: reach a target with the given numbers and + - * / (TinyZero-style rewards).

Prompt ``"3,5,7:22"`` (numbers, then target) -> an equation such as ``"3*5+7"``. Each
given number may be used at most once (not all need be used). Rewards: 0.0 when no
well-formed equation can be read, 0.1 for a well-formed one that is wrong (wrong value, or
numbers not available), 1.0 for a correct one. The equation is the text inside the last
``<answer>...</answer>`` if there is one, else the last line; a trailing ``=<target>`` is
allowed. Parsing uses ``ast`` on a whitelist of nodes, never ``eval``.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter

DATA_SOURCE = "minihf/countdown"
ALPHABET = "0123456789+-*/():,= "
MAX_NUMBER = 20

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"[\d+\-*/() .]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def make_example(rng: random.Random, max_number: int = MAX_NUMBER):
    """Numbers plus a target built from a random expression over them, so a solution exists."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(3, 4))]
        order = rng.sample(numbers, len(numbers))
        expr, value = str(order[0]), order[0]
        for x in order[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (x == 0 or value % x):
                op = "+"
            value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x}[op]
            expr = f"({expr}){op}{x}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{x}"
        if 0 < value <= 1000:
            break
    prompt = ",".join(map(str, numbers)) + f":{value}"
    return prompt, {"target": value, "numbers": numbers}, expr, {}


def extract_equation(solution_str: str) -> str | None:
    tags = _ANSWER_TAG.findall(solution_str)
    text = tags[-1] if tags else (solution_str.strip().splitlines() or [""])[-1]
    text = text.strip()
    if "=" in text:
        text, _, rhs = text.partition("=")
        if not rhs.strip().lstrip("-").replace(".", "", 1).isdigit():
            return None
    text = text.strip()
    return text if text and _ALLOWED.fullmatch(text) else None


def _evaluate(node: ast.AST, used: list[int]) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def parse_equation(text: str) -> tuple[float | None, list[int]] | None:
    """``(value, numbers used)``; value None on division by zero; None if not well formed."""
    # RecursionError: a response of thousands of chained terms; ValueError: an integer
    # literal over Python's digit limit. Either is a malformed answer, not a crash.
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used: list[int] = []
    try:
        value = _evaluate(tree.body, used)
    except ZeroDivisionError:
        return None, used
    except (ValueError, RecursionError, OverflowError):
        return None
    return value, used


def compute_score(solution_str: str, ground_truth: dict, extra_info: dict | None = None,
                  format_score: float = 0.1, score: float = 1.0) -> float:
    equation = extract_equation(solution_str)
    parsed = parse_equation(equation) if equation is not None else None
    if parsed is None:
        return 0.0
    value, used = parsed
    available = Counter(int(x) for x in ground_truth["numbers"])
    if Counter(used) - available or value is None:
        return format_score
    return score if abs(value - float(ground_truth["target"])) < 1e-6 else format_score
