"""Tools: typed Python functions the model calls, their JSON schemas, the hermes call
format, the built-in ``calculator``, and :class:`ToolEnvironment`, the environment a tool
set becomes.

A tool is a plain function with type hints and a Google-style docstring
(``Args: name: description``); its schema comes from transformers' ``get_json_schema`` and
reaches the prompt through the chat template's ``tools=`` argument, or, for a template
without tool support, a system-prompt block (:func:`hermes_system_block`).

hermes format: a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in
the assistant's text, several per turn up to ``max_parallel_calls``. A malformed call, an
unknown tool, bad arguments, a tool that raises or runs past ``tool_timeout_s``: each is an
``error: ...`` tool message the model reads, counted in ``tool_errors``, never an
exception. A turn with no call ends the episode (the answer). Built-in tools: ``calculator``
(below) and ``python`` (``minihf.multi_turn.sandbox``).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
from typing import Callable

from .sandbox import python

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CUT = "...(truncated)"  # what a message cut to max_tool_response_length ends with
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-style function schema of ``fn`` (from its signature and docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"tool {getattr(fn, '__name__', fn)!r}: cannot build its JSON schema ({exc}); give it "
            "type hints on every argument and a docstring with an 'Args:' section describing "
            "each one") from exc


def hermes_system_block(schemas: list[dict]) -> str:
    """The tool description a template without ``tools=`` support gets in its system
    prompt (the hermes convention)."""
    lines = ["You may call one or more functions to assist with the user query.",
             "You are provided with function signatures within <tools></tools> XML tags:",
             "<tools>"]
    lines += [json.dumps(s, separators=(",", ":")) for s in schemas]
    lines += ["</tools>",
              "For each function call, return a json object with function name and arguments "
              f"within {CALL_OPEN}{CALL_CLOSE} XML tags:",
              f'{CALL_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{CALL_CLOSE}']
    return "\n".join(lines)


def parse_tool_calls(text: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """``(calls, errors)`` of one assistant turn in hermes format: each call as ``(name,
    arguments)``; each malformed one as a message saying what was wrong."""
    calls, errors = [], []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"error: the tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()[:80]}")
            continue
        except RecursionError:  # ~1000 nested brackets: the decoder's own limit
            errors.append("error: the tool call's JSON is nested too deeply")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('error: a tool call must be {"name": <string>, "arguments": <object>}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                pass
        if not isinstance(args, dict):
            errors.append(f"error: the arguments of {obj['name']!r} must be a JSON object")
            continue
        calls.append((obj["name"], args))
    rest = _CALL.sub("", text)
    if CALL_OPEN in rest or CALL_CLOSE in rest:
        errors.append(f"error: unbalanced {CALL_OPEN} / {CALL_CLOSE} tags")
    return calls, errors


# -- the built-in calculator: arithmetic by walking the syntax tree, never eval -----------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 100


def _arith(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10 ** 6):
            raise ValueError("exponent too large")
        out = _BINARY[type(node.op)](a, b)
        if isinstance(out, int) and len(str(abs(out))) > _MAX_DIGITS:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported syntax {ast.unparse(node)!r}; use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. 123*(45+6)
    """
    if len(expression) > 200:
        return "error: expression longer than 200 characters"
    try:
        value = _arith(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
        return f"error: {exc.msg if isinstance(exc, SyntaxError) else exc}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


BUILTIN_TOOLS = {"calculator": calculator, "python": python}


def _call_with_timeout(fn: Callable, args: dict, timeout_s: float):
    """``fn(**args)`` in a daemon thread, waited for at most ``timeout_s`` (a call that never
    returns is abandoned: Python cannot stop it; the ``python`` tool runs in a subprocess)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(**args)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes an observation
            box["error"] = exc

    t = threading.Thread(target=run, name="minihf-tool", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"did not return within tool_timeout_s={timeout_s}")
    if "error" in box:
        raise box["error"]
    return box["value"]


class ToolEnvironment:
    """A tool set as an environment: each assistant turn's calls are run and answered with
    one tool message each; a turn without a call ends the episode (reward 0: the recipe's
    reward function scores the answer)."""

    def __init__(self, row: dict, tools: dict[str, Callable], max_parallel_calls: int = 1,
                 max_response_length: int = 256, timeout_s: float = 30.0):
        self.tools, self.max_parallel_calls = tools, max_parallel_calls
        self.max_response_length, self.timeout_s = max_response_length, timeout_s
        self.tool_calls = self.tool_errors = 0

    def reset(self) -> None:
        return None

    def _run(self, name: str, args: dict) -> str:
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; the tools are {sorted(self.tools)}"
        try:
            out = _call_with_timeout(fn, args, self.timeout_s)
        except TypeError as exc:
            return f"error: bad arguments for {name}: {exc}"
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a failing tool is the model's observation
            return f"error: {name} raised {type(exc).__name__}: {exc}"
        return out if isinstance(out, str) else json.dumps(out, default=str)

    def step(self, action: str):
        calls, errors = parse_tool_calls(action)
        if not calls and not errors:
            return None, 0.0, True
        messages = [{"role": "tool", "content": e} for e in errors]
        for name, args in calls[: self.max_parallel_calls]:
            out = self._run(name, args)
            if out.startswith("error:"):
                errors.append(out)
            if len(out) > self.max_response_length:  # an error's text too: the code may print it
                out = out[: self.max_response_length] + CUT
            messages.append({"role": "tool", "name": name, "content": out})
        if len(calls) > self.max_parallel_calls:
            messages.append({"role": "tool", "content": f"error: {len(calls)} calls in one turn; "
                             f"only the first max_parallel_calls={self.max_parallel_calls} ran"})
            errors.append("too many calls")
        self.tool_calls += min(len(calls), self.max_parallel_calls)
        self.tool_errors += len(errors)
        return messages, 0.0, False
