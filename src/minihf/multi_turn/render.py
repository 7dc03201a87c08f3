"""Chat-template rendering for token-in/token-out trajectories.

An observation (user or tool messages) is rendered as a *delta*: the text the chat template
puts after an assistant turn's end-of-turn token, up to and including the next assistant
header. It is tokenized alone and appended to the trajectory; the tokens the model sampled
are never decoded and re-encoded.

A delta is only right if the template is append-only: rendering a conversation whole gives
the prompt, the assistant turns and the deltas in sequence. Some are not (Qwen3's drops
earlier ``<think>`` blocks). :func:`check_append_only` renders a two-turn conversation both
ways at start-up and names the first position where they differ.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_PROBE = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "I will check."}]


class TemplateMismatch(ValueError):
    pass


class ChatRenderer:
    """Renders prompts and observation deltas with ``tokenizer``'s chat template; ``tools``
    (JSON schemas) go through the template's ``tools=`` argument when it has tool support,
    else into a system-prompt block (``system_block``)."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, system_block: str | None = None):
        if tokenizer.chat_template is None:
            raise ValueError("multi-turn rollouts render observations with the chat template, "
                             "but the tokenizer has none; add a chat_template to tokenizer_config.json")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.native_tools = bool(self.tools) and "tools" in tokenizer.chat_template
        self.system_block = system_block if self.tools and not self.native_tools else None
        self._ends: dict[int, tuple[str, int]] = {}  # end token -> (probe text, turn end in it)

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        msgs = list(messages)
        if self.system_block:
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + self.system_block}
            else:
                msgs.insert(0, {"role": "system", "content": self.system_block})
        kwargs = {"tools": self.tools} if self.native_tools else {}
        try:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja's own types; say what was rendered
            roles = [m.get("role") for m in msgs]
            raise ValueError(f"the chat template failed on messages with roles {roles}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.text(messages, add_generation_prompt=True))

    def delta_text(self, messages: list[dict], end_token: int, check: bool = True) -> str:
        """The text after an assistant turn that ended with ``end_token`` and before the
        next assistant turn's content, for observation ``messages``. A turn that ended on
        the template's end-of-turn token continues after it; one that ended on another stop
        token (a tool-call close tag) gets the template's end-of-turn text first. ``check``:
        refuse a template that renders the earlier turns differently once they follow."""
        base, cut = self._turn_end(end_token)
        full = self.text(_PROBE + messages, add_generation_prompt=True)
        if check and not full.startswith(base[:cut]):
            raise TemplateMismatch("the chat template renders earlier turns differently once an "
                                   "observation follows (not append-only)")
        return full[cut:]

    def _turn_end(self, end_token: int) -> tuple[str, int]:
        """The probe conversation's text and where a turn ended by ``end_token`` stops in it
        (the same for every observation: worked out once per end token)."""
        if end_token not in self._ends:
            base = self.text(_PROBE, add_generation_prompt=False)
            content = _PROBE[-1]["content"]
            cut = base.rfind(content) + len(content)
            end = self.tokenizer.decode([end_token])
            # the model sampled the end-of-turn token itself: the template's text there is that
            # token (not only starts with its text: a turn cut at '<' is not one ended by '<|im_end|>')
            if base[cut:].startswith(end) and self.encode(base[cut:])[:1] == [end_token]:
                cut += len(end)
            self._ends[end_token] = (base, cut)
        return self._ends[end_token]

    def delta_ids(self, messages: list[dict], end_token: int, check: bool = True) -> list[int]:
        return self.encode(self.delta_text(messages, end_token, check))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a shorter one differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_append_only(renderer: ChatRenderer, end_token: int, observation_role: str, mode: str) -> None:
    """Render user, assistant, observation, assistant whole and as prompt + turns + delta;
    ``strict``: raise on a difference, ``warn``: log it, ``off``: skip."""
    if mode == "off":
        return
    tok = renderer.tokenizer
    obs = {"role": observation_role, "content": "5"}
    if observation_role == "tool":
        obs["name"] = "calculator"
    turns = ["I will check.", "The answer is 5."]
    msgs = [_PROBE[0], {"role": "assistant", "content": turns[0]}, obs, {"role": "assistant", "content": turns[1]}]
    try:
        whole = renderer.encode(renderer.text(msgs, add_generation_prompt=False))
        pieces = (renderer.prompt_ids(msgs[:1]) + renderer.encode(turns[0]) + [end_token]
                  + renderer.delta_ids([obs], end_token, check=False) + renderer.encode(turns[1])
                  + [end_token])
    except TemplateMismatch as exc:
        problem = str(exc)
    else:
        at = first_difference(whole[:len(pieces)], pieces)
        if at is None:
            return
        problem = (f"rendered whole, token {at} is {tok.decode(whole[at:at + 8])!r}; rendered as "
                   f"prompt + turns + observation deltas it is {tok.decode(pieces[at:at + 8])!r}")
    msg = (f"the chat template is not append-only: {problem}. Trajectories would train on tokens "
           "the template never renders; use an append-only template, or set "
           "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=off (or warn)")
    if mode == "strict":
        raise TemplateMismatch(msg)
    logger.warning(msg)
