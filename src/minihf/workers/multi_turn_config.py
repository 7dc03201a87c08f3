"""``rollout.multi_turn``: its settings and their checks (``MultiTurnConfig``; the loop that
reads them is ``minihf.multi_turn``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional


def _check_code_refs(tools: list, environment: str | None) -> None:
    """Each tool a built-in name or a ``file.py:name`` that exists (without running the file:
    a wrong one failed on the rollout ranks after start-up), and so the environment."""
    from minihf.multi_turn.tools import BUILTIN_TOOLS
    from minihf.utils.imports import check_name_or_ref

    def not_built_in(name: str) -> None:
        raise ValueError(f"{name!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor a "
                         "file.py:function reference")

    def not_a_ref(name: str) -> None:
        raise ValueError(f"{name!r} is not a file.py:Class reference")
    names = [str(t).rpartition(":")[2] for t in tools]  # the name the model calls it by
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"rollout.multi_turn.tools={tools} names {twice} more than once; the model calls "
                         "a tool by its name, so list each once, with distinct function names")
    refs = [("tools", t, "tool function", not_built_in) for t in tools if t not in BUILTIN_TOOLS]
    refs += [("environment", environment, "environment class", not_a_ref)] if environment else []
    for key, ref, what, lookup in refs:
        try:
            check_name_or_ref(ref, lookup, what)
        except ValueError as e:
            raise ValueError(f"rollout.multi_turn.{key}: {e}") from None


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools or an environment (verl's names; docs/multi-turn.md).

    ``tools``: tool functions (``file.py:name``, or a built-in: ``calculator``); or
    ``environment``: an environment class (``file.py:Class``, one instance per sample).
    ``rollout.response_length`` caps a trajectory's whole response (assistant and
    observation tokens). A tool or user message is cut to ``max_tool_response_length``
    characters.
    """
    enable: bool = False                 # multi-turn rollouts (tools or an environment)
    tools: list[str] = field(default_factory=list)  # tool functions: file.py:name or a built-in (calculator)
    environment: Optional[str] = None    # environment class, file.py:Class (instead of tools)
    max_assistant_turns: Optional[int] = None  # episode ends after this many assistant turns; null: no cap
    max_user_turns: Optional[int] = None  # episode ends before the observation past this many; null: no cap
    max_tokens_per_turn: Optional[int] = None  # an assistant turn also ends after this many tokens; null: no cap
    max_parallel_calls: int = 1          # tool calls run per assistant turn (more are an error observation)
    max_tool_response_length: int = 256  # characters of each tool/user message kept
    tool_timeout_s: float = 30.0         # one tool call's limit (an error observation past it)
    env_timeout_s: float = 120.0         # one environment step's limit (past it the run stops)
    sandbox: Literal["isolated", "process"] = "isolated"  # the python tool: isolated = Linux namespaces (refused where unavailable); process = rlimits and an audit hook only
    format: Literal["hermes"] = "hermes"  # tool-call format in the assistant's text
    tokenization_sanity_check_mode: Literal["strict", "warn", "off"] = "strict"  # start-up check that the chat template is append-only
    turn_rewards: bool = False           # each step's reward on its turn's last token (else their sum on the last)

    def __post_init__(self):
        if self.format != "hermes":
            raise ValueError(f"rollout.multi_turn.format={self.format!r}; only hermes is supported")
        if self.tokenization_sanity_check_mode not in ("strict", "warn", "off"):
            raise ValueError(f"rollout.multi_turn.tokenization_sanity_check_mode="
                             f"{self.tokenization_sanity_check_mode!r}; choose strict, warn or off")
        if not isinstance(self.tools, list):
            raise ValueError(f"rollout.multi_turn.tools={self.tools!r} must be a list of file.py:name "
                             "references or built-in tool names")
        if self.enable and not self.tools and not self.environment:
            raise ValueError("rollout.multi_turn.enable=true needs rollout.multi_turn.tools (a list) "
                             "or rollout.multi_turn.environment (file.py:Class)")
        if self.tools and self.environment:
            raise ValueError("set rollout.multi_turn.tools or rollout.multi_turn.environment, not both "
                             "(an environment can call tools itself)")
        if not self.enable and (self.tools or self.environment):
            which = "tools" if self.tools else "environment"
            warnings.warn(f"rollout.multi_turn.{which} is set but rollout.multi_turn.enable=false: the rollout "
                          "is single-turn and does not use it; set rollout.multi_turn.enable=true", stacklevel=2)
        if self.enable:  # (off: not used, so not checked; the warning above says so)
            _check_code_refs(self.tools, self.environment)
        for key in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"rollout.multi_turn.{key}={v!r} must be an int >= 1, or null")
        for key in ("max_parallel_calls", "max_tool_response_length"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rollout.multi_turn.{key}={v!r} must be an int >= 1")
        for key in ("tool_timeout_s", "env_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"rollout.multi_turn.{key}={getattr(self, key)!r} must be > 0")
        if self.tools and self.max_parallel_calls * self.tool_timeout_s >= self.env_timeout_s:
            raise ValueError(
                f"rollout.multi_turn: a turn's tool calls may take max_parallel_calls x tool_timeout_s = "
                f"{self.max_parallel_calls} x {self.tool_timeout_s} s, which does not fit in env_timeout_s="
                f"{self.env_timeout_s} (past it the run stops); raise env_timeout_s or lower the others")
        if self.sandbox not in ("isolated", "process"):
            raise ValueError(f"rollout.multi_turn.sandbox={self.sandbox!r}; choose isolated (namespaces, the "
                             "default) or process (rlimits and an audit hook only)")
