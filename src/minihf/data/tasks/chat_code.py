"""``chat_code``: write a small Python function, scored by unit tests run in the sandbox.

Prompt ``"Write a Python function add(a, b) that returns the sum of a and b. Reply with only
the code."`` -> a function definition. The reward runs the response's code (the last
fenced block if the response has one, to its end if the length limit cut it, else the
whole text) followed by the row's tests
(``assert add(3, 4) == 7`` ...) in the ``python`` tool's sandbox (``minihf.multi_turn.
sandbox``: Linux namespaces, no network, no view of the trainer): 1.0 when every assert
passes, else 0.0. Made for code RL with a small instruct model (``grpo_smollm2_code``).

Without namespaces the reward raises (the run stops naming the sample) rather than scoring
every response 0: set ``MINIHF_SANDBOX=process`` in the environment to accept the weaker
mode knowingly (docs/multi-turn.md).
"""

from __future__ import annotations

import os
import secrets
import random
import re
import string

DATA_SOURCE = "minihf/chat_code"
# operation: (names the function may have, what it returns with {a} and {b}, the body, the reference)
OPERATIONS = {
    "sum": (("add", "plus", "total"), "the sum of {a} and {b}", "{a} + {b}", lambda a, b: a + b),
    "difference": (("sub", "minus", "subtract"), "{a} minus {b}", "{a} - {b}", lambda a, b: a - b),
    "product": (("mul", "times", "multiply"), "the product of {a} and {b}", "{a} * {b}", lambda a, b: a * b),
    "larger": (("larger", "bigger", "maximum"), "the larger of {a} and {b}", "max({a}, {b})", max),
    "smaller": (("smaller", "lesser", "minimum"), "the smaller of {a} and {b}", "min({a}, {b})", min),
    "distance": (("distance", "gap", "absdiff"), "the absolute difference of {a} and {b}", "abs({a} - {b})",
                 lambda a, b: abs(a - b)),
    "double_sum": (("double_sum", "twice_total"), "twice the sum of {a} and {b}", "2 * ({a} + {b})",
                   lambda a, b: 2 * (a + b)),
    "square_sum": (("square_plus", "sq_add"), "{a} squared plus {b}", "{a} ** 2 + {b}", lambda a, b: a * a + b),
}
ARGUMENTS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("first", "second"))
TEMPLATE = "Write a Python function {name}({a}, {b}) that returns {what}. Reply with only the code."
ALPHABET = "".join(sorted(set(string.printable) - set("\x0b\x0c")))
TESTS = 3

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
_OPEN = re.compile(r"```(?:python|py)?[ \t]*\n")


def make_example(rng: random.Random):
    """A request (one of 8 operations x 2-3 names x 5 argument pairs: 110 prompts), its
    asserts on three random pairs in -20..20, and a reference solution."""
    op = rng.choice(sorted(OPERATIONS))
    names, what, body, ref = OPERATIONS[op]
    name, (a, b) = rng.choice(names), rng.choice(ARGUMENTS)
    pairs = [(rng.randint(-20, 20), rng.randint(-20, 20)) for _ in range(TESTS)]
    tests = "\n".join(f"assert {name}({x}, {y}) == {ref(x, y)}" for x, y in pairs)
    answer = f"def {name}({a}, {b}):\n    return {body.format(a=a, b=b)}"
    return TEMPLATE.format(name=name, a=a, b=b, what=what.format(a=a, b=b)), tests, answer, {"function": name}


def extract_code(solution_str: str) -> str:
    """The last fenced code block of the response; a block the length limit cut before its
    closing fence runs to the end; else the whole response."""
    blocks = _FENCE.findall(solution_str)
    if blocks:
        return blocks[-1]
    opened = _OPEN.search(solution_str)
    return solution_str[opened.end():] if opened else solution_str


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the response's code passes the row's asserts in the sandbox, else 0.0."""
    from minihf.multi_turn import sandbox

    mode = os.environ.get("MINIHF_SANDBOX", "isolated")
    sandbox.check(mode)  # no namespaces: a ValueError naming the setting, not a silent 0
    # a marker the code cannot print ahead of the asserts: 'passed' alone was earned by
    # print('passed') then SystemExit, the asserts never run
    marker = f"passed {secrets.token_hex(8)}"
    program = f"{extract_code(solution_str)}\n\n{ground_truth}\nprint({marker!r})\n"
    return 1.0 if sandbox.run_python(program, mode=mode, wall_s=5.0, cpu_s=2) == marker + "\n" else 0.0
