"""``tool_arith``: multiply a 3-digit by a 2-digit number, with a ``calculator`` tool.

Prompt ``"347*56"`` -> answer ``"19432"``. A small model cannot multiply, but it can call
the tool (hermes format: ``<tool_call>{"name":"calculator","arguments":{"expression":
"347*56"}}</tool_call>``, the tags single tokens of the char tokenizer, whose template also
has a ``tool`` role), read the result and answer with it. The reward is 1.0 when the
assistant text (its turns, special tokens dropped) ends in the right integer.

The row's ``messages`` column is the SFT demonstration; the SFT recipe renders it with the
tools offered (``data.tools``: the template's ``tools:calculator`` system line), so SFT and
RL prompts agree.
Only ``TOOL_DEMO_FRACTION`` of the demonstrations use the tool; the others answer at once
with the right number, which the model learns to imitate but cannot compute: RL has to
find that calling the tool pays (``recipes/grpo_tool_arith``).
"""

from __future__ import annotations

import json
import random
import re

DATA_SOURCE = "minihf/tool_arith"
CALL = '{"name":"calculator","arguments":{"expression":"EXPR"}}'
ALPHABET = "".join(sorted(set(CALL + "tools:calculator" + "0123456789*")))  # the template's tool line too
EXTRA_ROLES = ("tool",)
EXTRA_SPECIAL_TOKENS = ("<tool_call>", "</tool_call>")
TOOL_DEMO_FRACTION = 0.25

_TRAILING = re.compile(r"(-?\d+)\s*$")


def make_example(rng: random.Random):
    x, y = rng.randint(100, 999), rng.randint(10, 99)
    answer = str(x * y)
    return f"{x}*{y}", answer, answer, {"x": x, "y": y, "demo_tool": rng.random() < TOOL_DEMO_FRACTION}


def tool_call(expression: str) -> str:
    body = json.loads(CALL.replace("EXPR", expression))
    return f"<tool_call>{json.dumps(body, separators=(',', ':'))}</tool_call>"


def demo_messages(row: dict) -> list[dict]:
    info, answer = row["extra_info"], row["reward_model"]["ground_truth"]
    msgs = list(row["prompt"])
    if info["demo_tool"]:
        msgs += [{"role": "assistant", "content": tool_call(row["prompt"][0]["content"])},
                 {"role": "tool", "content": answer}]
    return msgs + [{"role": "assistant", "content": answer}]


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the text ends in the right integer, else 0.0."""
    m = _TRAILING.search(solution_str)
    return 1.0 if m and m.group(1) == str(ground_truth) else 0.0
