"""``chat_tool_arith``: multiply a 3-digit by a 2-digit number, asked in English, with a
``calculator`` tool: ``tool_arith`` for a pretrained chat model (``grpo_smollm2_tools``).

Prompt ``"What is 347 * 56? Answer with just the number."`` -> ``"19432"``. The row's
``messages`` column is the SFT demonstration: ``TOOL_DEMO_FRACTION`` of them call the tool
in the hermes format (``<tool_call>{"name": "calculator", "arguments": {"expression":
"347 * 56"}}</tool_call>``), read its answer and repeat it; the others state the product
at once. The SFT recipe renders them with the tools offered (``data.tools``), as the
rollout renders its prompts. The reward is ``chat_arith``'s: the number after the last
``####``, else the last number of the assistant text, exactly the product.
"""

from __future__ import annotations

import json
import random

from minihf.data.tasks.chat_arith import compute_score  # noqa: F401 - the same reading of the answer

DATA_SOURCE = "minihf/chat_tool_arith"
TEMPLATE = "What is {x} * {y}? Answer with just the number."
ALPHABET = "".join(sorted(set(TEMPLATE.replace("{x}", "").replace("{y}", "") + "0123456789")))
TOOL_DEMO_FRACTION = 0.25


def make_example(rng: random.Random):
    x, y = rng.randint(100, 999), rng.randint(10, 99)
    answer = str(x * y)
    return TEMPLATE.format(x=x, y=y), answer, answer, {"x": x, "y": y,
                                                       "demo_tool": rng.random() < TOOL_DEMO_FRACTION}


def demo_messages(row: dict) -> list[dict]:
    info, answer = row["extra_info"], row["reward_model"]["ground_truth"]
    msgs = list(row["prompt"])
    if info["demo_tool"]:
        call = {"name": "calculator", "arguments": {"expression": f"{info['x']} * {info['y']}"}}
        msgs += [{"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                 {"role": "tool", "content": answer}]
    return msgs + [{"role": "assistant", "content": answer}]
