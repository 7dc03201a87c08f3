"""The environment loop of a multi-turn generation: one environment per sample, stepped off
the engine's decode loop, observations appended as exact token deltas.

:class:`MultiTurn` is built once per actor worker from ``rollout.multi_turn`` (it loads the
environment class or the tools and checks the chat template); each generation call makes an
:class:`EpisodeRunner`, the engine's ``TurnHandler`` for that call. When a sequence ends a
turn, the runner decodes that turn's tokens, starts ``env.step(text)`` in a daemon thread
and returns at once; the engine keeps decoding the others and polls. A finished step's
observation becomes the chat template's delta, tokenized alone, which the engine prefills
onto the sequence's cached history.

An environment is any class with ``__init__(row)``, ``reset() -> str | None`` (text added
to the first user message) and ``step(action) -> (observation, reward, done)``; the
observation is a string (the next user message), a list of message dicts (tool messages)
or None with ``done``. One that raises, does not return within ``env_timeout_s`` or
returns something else stops the run with :class:`EnvironmentFailure`, naming the sample
and the class.

Under rollout TP the replica's first rank runs the environments; its poll answers reach
the other ranks by broadcast in the same engine step, so every rank's engine stays in step.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from numbers import Real

import torch.distributed as dist

from minihf.rollout.engine import SEQ_STRIDE
from minihf.utils.imports import load_ref

from . import sandbox
from .render import ChatRenderer, check_append_only
from .tools import BUILTIN_TOOLS, CALL_CLOSE, CUT, ToolEnvironment, hermes_system_block, tool_schema


# the batch's non-tensor columns an environment's row is built from (the dataset's)
ENV_ROW_KEYS = ("raw_prompt", "data_source", "ground_truth", "extra_info", "index")


class EnvironmentFailure(RuntimeError):
    pass


def _spawn(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread (a hung environment cannot block the process's exit)."""
    fut: Future = Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the poll, naming the sample
            fut.set_exception(exc)

    threading.Thread(target=run, name="minihf-env", daemon=True).start()
    return fut


def load_tools(refs: list[str]) -> dict:
    tools = {}
    for ref in refs:
        fn = BUILTIN_TOOLS.get(ref) or load_ref(ref, "tool function")
        tool_schema(fn)  # a tool without a usable schema fails at start-up, naming it
        if fn.__name__ in tools:  # (the model calls a tool by name: one of the two was unreachable)
            raise ValueError(f"tools {refs}: {ref!r} is a tool named {fn.__name__!r}, as is one listed "
                             "before it; list each tool once, and give tools distinct function names")
        tools[fn.__name__] = fn
    return tools


def tool_renderer(tokenizer, refs: list[str]) -> ChatRenderer:
    """The renderer of prompts that offer the tools ``refs`` (the dataset's and the rollout's)."""
    schemas = [tool_schema(f) for f in load_tools(refs).values()]
    return ChatRenderer(tokenizer, schemas, hermes_system_block(schemas))


@dataclass
class Episode:
    """One sample's environment and what its conversation has done so far."""
    env: object
    uid: str
    turn_start: int = 0                  # index in the response where this assistant turn began
    turns: int = 0                       # assistant turns ended
    observations: int = 0
    rewards: list = field(default_factory=list)  # (response index of the turn's last token, reward)
    messages: list = field(default_factory=list)  # the conversation after the prompt


class MultiTurn:
    """The multi-turn settings of an actor worker (see the module docstring)."""

    def __init__(self, cfg, tokenizer, end_tokens: tuple[int, ...], *, tp_group=None, leader: bool = True):
        self.cfg, self.tokenizer, self.end_tokens = cfg, tokenizer, frozenset(end_tokens)
        self.tp_group, self.leader = tp_group, leader
        if cfg.environment:
            self.env_cls, self.tools = load_ref(cfg.environment, "environment class"), {}
            role = "user"
        else:
            self.tools = load_tools(cfg.tools)
            self.env_cls = partial(ToolEnvironment, tools=self.tools, max_parallel_calls=cfg.max_parallel_calls,
                                   max_response_length=cfg.max_tool_response_length,
                                   timeout_s=cfg.tool_timeout_s)
            role = "tool"
        # the mode of every run_python in this process (a user's tool or environment may call
        # it too); checked at start-up, where namespaces may be missing, for the built-in tool
        sandbox.configure(cfg.sandbox, verify=sandbox.python in self.tools.values())
        self.env_name = getattr(self.env_cls, "__name__", "ToolEnvironment")
        # a tool-call close tag that is one token also ends a turn (else the template's end of turn does)
        close = tokenizer.convert_tokens_to_ids(CALL_CLOSE) if self.tools else None
        self.stop_ids = (close,) if close is not None and close != tokenizer.unk_token_id else ()
        self.renderer = tool_renderer(tokenizer, cfg.tools) if self.tools else ChatRenderer(tokenizer)
        if not end_tokens:
            raise ValueError("multi-turn rollouts need the end-of-turn token: the model dir's "
                             "generation_config.json (or config.json) names no eos_token_id")
        check_append_only(self.renderer, end_tokens[0], role, cfg.tokenization_sanity_check_mode)

    def turn_text(self, tokens: list[int]) -> str:
        """An assistant turn's text as the environment reads it: special tokens kept (a
        tool-call tag may be one), the end-of-turn token that closed it dropped."""
        if tokens and tokens[-1] in self.end_tokens:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def runner(self, rows: list[dict], uids: list[str], prompts: list[list[int]], prompt_length: int) -> EpisodeRunner:
        return EpisodeRunner(self, rows, uids, prompts, prompt_length)


class EpisodeRunner:
    """One generation call's episodes: the engine's ``TurnHandler``."""

    def __init__(self, mt: MultiTurn, rows: list[dict], uids: list[str], prompts: list[list[int]],
                 prompt_length: int):
        self.mt, self.cfg = mt, mt.cfg
        self.episodes: list[Episode] = []
        self.pending: dict[int, tuple] = {}  # seq_id -> (seq, future, deadline)
        self.env_seconds = 0.0
        self._followers: dict[int, object] = {}  # seq_id -> seq on the other TP ranks
        started = prompts
        if mt.leader:
            try:
                started = self._start(rows, uids, prompts, prompt_length)
            except (Exception, SystemExit) as exc:
                started = exc
        self.prompts = self._share(started)

    # -- start ---------------------------------------------------------------------------
    def _where(self, i: int) -> str:
        return f"sample {i} (uid {self.episodes[i].uid})" if i < len(self.episodes) else f"sample {i}"

    def _call(self, i: int, what: str, fn, *args):
        fut = _spawn(fn, *args)
        try:
            return fut.result(timeout=self.cfg.env_timeout_s)
        except TimeoutError:
            raise EnvironmentFailure(f"{self.mt.env_name}.{what} on {self._where(i)} did not return "
                                     f"within rollout.multi_turn.env_timeout_s={self.cfg.env_timeout_s}") from None
        except (Exception, SystemExit) as exc:
            raise EnvironmentFailure(f"{self.mt.env_name}.{what} on {self._where(i)} raised "
                                     f"{type(exc).__name__}: {exc}") from exc

    def _start(self, rows, uids, prompts, prompt_length) -> list[list[int]]:
        out = []
        for i, (row, uid, prompt) in enumerate(zip(rows, uids, prompts)):
            self.episodes.append(Episode(env=None, uid=str(uid)))
            env = self.episodes[i].env = self._call(i, "__init__", self.mt.env_cls, row)
            text = self._call(i, "reset", env.reset)
            if text is None:
                out.append(prompt)
                continue
            if not isinstance(text, str):
                raise EnvironmentFailure(f"{self.mt.env_name}.reset on {self._where(i)} returned a "
                                         f"{type(text).__name__}; return a str or None")
            msgs = [dict(m) for m in row.get("raw_prompt") or []]
            users = [m for m in msgs if m["role"] == "user"]
            if not users:
                raise EnvironmentFailure(f"{self._where(i)} has no user message in its raw_prompt to "
                                         f"append {self.mt.env_name}.reset()'s text to")
            users[0]["content"] = users[0]["content"] + text
            ids = self.mt.renderer.prompt_ids(msgs)
            if len(ids) > prompt_length:
                raise ValueError(f"{self._where(i)}: the prompt with {self.mt.env_name}.reset()'s text is "
                                 f"{len(ids)} tokens, over rollout.prompt_length={prompt_length}; shorten the "
                                 "text or raise data.max_prompt_length")
            out.append(ids)
        return out

    def _share(self, obj):
        """``obj`` from the replica's leader on every rank of its TP group; an exception
        there is raised on every rank (so no rank waits for one that has failed)."""
        if isinstance(obj, Exception) and self.mt.leader:
            if self.mt.tp_group is not None:
                dist.broadcast_object_list([EnvironmentFailure(str(obj))], group=self.mt.tp_group, group_src=0)
            raise obj
        if self.mt.tp_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.mt.tp_group, group_src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    # -- the engine's TurnHandler --------------------------------------------------------
    def end_turn(self, seq) -> None:
        if not self.mt.leader:
            self._followers[seq.seq_id] = seq
            return
        ep = self.episodes[seq.seq_id // SEQ_STRIDE]
        text = self.mt.turn_text(seq.tokens[ep.turn_start:])
        ep.messages.append({"role": "assistant", "content": text})
        ep.turn_start = len(seq.tokens)  # recorded: a sequence that ends here has no cut-off turn
        fut = _spawn(self._timed_step, ep.env, text)
        self.pending[seq.seq_id] = (seq, fut, time.monotonic() + self.cfg.env_timeout_s)

    def _timed_step(self, env, text):
        t0 = time.perf_counter()
        try:
            return env.step(text)
        finally:
            self.env_seconds += time.perf_counter() - t0

    def poll(self, wait: bool):
        answers = None
        if self.mt.leader:
            try:
                answers = self._collect(wait)
            except (Exception, SystemExit) as exc:  # every TP rank raises it, none waits for the others
                answers = exc
        answers = self._share(answers)
        return [(self._seq(sid), tokens, reason) for sid, tokens, reason in answers]

    def _seq(self, sid: int):
        if self.mt.leader:
            return self.pending.pop(sid)[0]
        return self._followers.pop(sid)

    def _collect(self, wait: bool) -> list[tuple[int, list[int] | None, str]]:
        while True:
            done = [sid for sid, (_, fut, _) in self.pending.items() if fut.done()]
            if done or not wait:
                break
            deadline = min(d for _, _, d in self.pending.values())
            late = [sid for sid, (_, _, d) in self.pending.items() if d <= time.monotonic()]
            if late:
                raise EnvironmentFailure(
                    f"{self.mt.env_name}.step on {self._where(late[0] // SEQ_STRIDE)} did not return within "
                    f"rollout.multi_turn.env_timeout_s={self.cfg.env_timeout_s}")
            time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        return [(sid, *self._answer(sid)) for sid in sorted(done)]

    def _answer(self, sid: int) -> tuple[list[int] | None, str]:
        seq, fut, _ = self.pending[sid]
        i = sid // SEQ_STRIDE
        ep, cfg, where = self.episodes[i], self.cfg, self._where(i)
        try:
            result = fut.result()
        except (Exception, SystemExit) as exc:
            raise EnvironmentFailure(f"{self.mt.env_name}.step on {where} raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(result, tuple) and len(result) == 3):
            raise EnvironmentFailure(f"{self.mt.env_name}.step on {where} returned {type(result).__name__}; "
                                     "return (observation: str | list[dict] | None, reward: float, done: bool)")
        obs, reward, done = result
        if not isinstance(reward, Real) or isinstance(reward, bool) or not math.isfinite(reward):
            raise EnvironmentFailure(f"{self.mt.env_name}.step on {where} returned reward {reward!r}; return a "
                                     "finite float (a NaN or infinite reward would poison the advantages)")
        ep.turns += 1
        ep.rewards.append((len(seq.tokens) - 1, float(reward)))
        if done:
            return None, "done"
        if cfg.max_assistant_turns is not None and ep.turns >= cfg.max_assistant_turns:
            return None, "max_assistant_turns"
        if cfg.max_user_turns is not None and ep.observations >= cfg.max_user_turns:
            return None, "max_user_turns"
        if isinstance(obs, str):
            messages = [{"role": "user", "content": obs}]
        elif isinstance(obs, list) and obs and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   and m.get("role") in ("user", "tool") for m in obs):
            messages = [dict(m) for m in obs]
        else:
            raise EnvironmentFailure(
                f"{self.mt.env_name}.step on {where} returned observation {obs!r:.80} with done=False; "
                "return a str (the next user message) or a list of {'role': 'user'|'tool', 'content': str} dicts")
        limit = cfg.max_tool_response_length
        for m in messages:  # (a ToolEnvironment's messages arrive cut already)
            text = m["content"].encode("utf-8", "replace").decode("utf-8")  # lone surrogates from JSON escapes
            if len(text) > limit and not (len(text) == limit + len(CUT) and text.endswith(CUT)):
                text = text[:limit] + CUT
            m["content"] = text
        tokens = self.mt.renderer.delta_ids(messages, seq.tokens[-1])
        if len(tokens) >= seq.max_tokens - len(seq.tokens):  # no room for it and one more token
            return None, "length"
        ep.messages.extend(messages)
        ep.observations += 1
        ep.turn_start = len(seq.tokens) + len(tokens)
        return tokens, ""


def multi_turn_metrics(batch) -> dict[str, float]:
    """``multi_turn/*`` and ``response_length/{assistant,observation}/mean`` of a generated
    batch (``minihf.hybrid.rollout_output.episode_outputs``'s columns)."""
    t = batch.tensors
    turns = t["multi_turn_turns"]
    attn = t["attention_mask"][:, -t["responses"].shape[1]:].float()
    assistant = t["response_mask"].float().sum(-1)
    m = {"multi_turn/num_turns/mean": turns.mean().item(), "multi_turn/num_turns/max": turns.max().item(),
         "multi_turn/tool_calls/mean": t["multi_turn_tool_calls"].mean().item(),
         "multi_turn/tool_errors/mean": t["multi_turn_tool_errors"].mean().item(),
         "response_length/assistant/mean": assistant.mean().item(),
         "response_length/observation/mean": (attn.sum(-1) - assistant).mean().item()}
    finish = list(batch.non_tensors["multi_turn_finish"])
    done = [t for t, f in zip(turns.tolist(), finish) if f == "done"]
    if done:  # turns of the episodes the environment ended (a game won, an answer given)
        m["multi_turn/num_turns/done_mean"] = sum(done) / len(done)
    for reason in sorted(set(finish)):
        m[f"multi_turn/finish_reason/{reason}"] = finish.count(reason) / len(finish)
    return m


def weighted_mean(parts: list[tuple[int, dict]]) -> dict[str, float]:
    """Per key, the mean of several batches' metrics weighted by their sizes ``(size, metrics)``."""
    out = {}
    for key in sorted({k for _, part in parts for k in part}):
        n = sum(size for size, part in parts if key in part)
        out[key] = sum(size * part[key] for size, part in parts if key in part) / n
    return out
