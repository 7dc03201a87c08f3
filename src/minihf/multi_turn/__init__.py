"""minihf.multi_turn: agentic rollouts (tools and environments), token-in/token-out.

``tools`` (schemas, the hermes call format, the built-in calculator, ``ToolEnvironment``),
``render`` (observation deltas through the chat template, the append-only check) and
``loop`` (``MultiTurn``: one environment per sample stepped off the engine's decode loop).
The engine side (pause at a turn end, extend-prefill the observation) is
``minihf.rollout.engine``. docs/multi-turn.md has the whole picture.
"""

from .loop import EnvironmentFailure, Episode, EpisodeRunner, MultiTurn
from .render import ChatRenderer, TemplateMismatch, check_append_only
from .tools import ToolEnvironment, calculator, parse_tool_calls, tool_schema

__all__ = ["MultiTurn", "EpisodeRunner", "Episode", "EnvironmentFailure", "ChatRenderer",
           "TemplateMismatch", "check_append_only", "ToolEnvironment", "calculator",
           "parse_tool_calls", "tool_schema"]
