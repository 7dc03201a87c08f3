"""Text in, text out: tokenizer + :class:`LLM` for the ``minihf generate`` command.

The tokenizer comes from the model dir through ``minihf.data.tokenizer.load_tokenizer`` (the
one offline-safe path every minihf tokenizer goes through). Generation stops at the
config's EOS ids and at the tokenizer's EOS token.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from minihf.rollout.llm import LLM, eos_ids_from_dir
from minihf.rollout.sampling import SamplingParams
from minihf.utils.files import MODEL_FIX, read_json


def generate_text(model_dir: str | Path, prompts: list[str], params: SamplingParams, chat: bool = False,
                  max_model_len: int | None = None, allow_unk: bool = False) -> list[list[tuple[str, str]]]:
    """Completions (``params.n`` per prompt) as ``(text, finish)``, special tokens skipped.

    ``model_dir``: an HF model dir, or a training checkpoint (an RL run's ``global_step_N``,
    a role's or an SFT run's), exported to a scratch dir first. ``finish`` is ``stop`` (an
    EOS), ``length`` (``max_tokens`` reached) or ``max_model_len`` (the context is full:
    prompt + completion reached ``max_model_len``).

    ``chat=True`` renders each prompt as one user turn with the tokenizer's chat template. A
    prompt with characters outside the vocabulary (they would silently become the unknown
    token) is refused, listing them, unless ``allow_unk``.
    """
    from minihf.hub import model_dir_of

    for i, p in enumerate(prompts):  # a non-UTF-8 argument arrives with surrogate escapes
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as exc:
            byte = ord(p[exc.start]) - 0xDC00 if 0xDC80 <= ord(p[exc.start]) <= 0xDCFF else None
            shown = f"byte 0x{byte:02x}" if byte is not None else repr(p[exc.start])
            raise ValueError(f"prompt {i + 1} is not UTF-8 text ({shown} at character {exc.start}); pass "
                             "UTF-8 (e.g. `iconv -f latin1 -t utf-8` on the file it came from)") from None
    with tempfile.TemporaryDirectory(prefix="minihf-generate-") as scratch:
        return _generate_text(model_dir_of(model_dir, Path(scratch)), prompts, params, chat,
                              max_model_len, allow_unk, str(model_dir))


def check_max_model_len(model_dir: Path, max_model_len: int | None, name: str) -> None:
    """``max_model_len`` within the model's context (``minihf.models.config_checks.context_error``,
    the wording training uses): past it the positions have no trained rotary angles, and a
    cache of that length is allocated first (a traceback, or minutes, for a huge one)."""
    from minihf.models import load_args
    from minihf.models.config_checks import context_error

    if max_model_len is None:
        return
    limit = load_args(model_dir).max_position_embeddings
    if max_model_len < 1:
        raise ValueError(f"--max-model-len {max_model_len} must be >= 1 (leave it out for the model's "
                         f"context, {limit})")
    message = context_error(f"--max-model-len {max_model_len}", max_model_len, limit, f"model {name}",
                            f"pass at most {limit}, or leave it out (the model's context)")
    if message:
        raise ValueError(message)


def chat_template_file(model_dir: Path) -> str:
    """Where a model dir's chat template is (what ``load_tokenizer`` reads)."""
    if (Path(model_dir) / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    return "tokenizer_config.json's chat_template"


def encode_chats(tok, prompts: list[str], model_dir: Path, name: str) -> list[list[int]]:
    """Each prompt as one user turn through the chat template; a template that does not
    compile or raises (``raise_exception``) is one line naming its file and jinja's error."""
    from minihf.data.tokenizer import encode_chat

    out = []
    for p in prompts:
        try:
            out.append(encode_chat(tok, [{"role": "user", "content": p}]))
        except ValueError:  # no template at all: encode_chat says so
            raise
        except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateSyntaxError, TemplateError, ...)
            line = getattr(exc, "lineno", None)
            at = f" at line {line}" if line else ""
            text = (getattr(exc, "message", None) or str(exc) or "").splitlines()
            raise ValueError(f"the chat template of {name} ({chat_template_file(model_dir)}) failed{at}: "
                             f"{type(exc).__name__}: {text[0] if text else ''}; fix the template, or "
                             "generate without --chat") from None
    return out


def _generate_text(model_dir: Path, prompts: list[str], params: SamplingParams, chat: bool,
                   max_model_len: int | None, allow_unk: bool, name: str | None = None
                   ) -> list[list[tuple[str, str]]]:
    from minihf.data.tokenizer import load_tokenizer, unknown_chars_error

    name = name or str(model_dir)
    check_max_model_len(model_dir, max_model_len, name)
    tok = load_tokenizer(model_dir)
    message = None if allow_unk else unknown_chars_error(tok, [(f"prompt {p!r}", p) for p in prompts], "prompt",
                                                         "remove them, or pass --allow-unk")
    if message:
        raise ValueError(message)
    if chat:
        ids = encode_chats(tok, prompts, model_dir, name)
    else:
        ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    empty = [p for p, i in zip(prompts, ids) if not i]
    if empty:
        raise ValueError(f"prompt(s) {empty!r} encode to no tokens; pass non-empty text")
    config = read_json(model_dir / "config.json", MODEL_FIX)
    eos = set(eos_ids_from_dir(model_dir, config))
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    llm = LLM(model_dir, max_model_len=max_model_len, eos_token_ids=tuple(sorted(eos)))
    outs = llm.generate(ids, params)
    limit = llm.engine.max_model_len
    llm.free()

    def finish(prompt_ids, c) -> str:
        if c.finish_reason != "length":
            return c.finish_reason
        full = len(c.token_ids) < params.max_tokens or len(prompt_ids) + len(c.token_ids) >= limit
        return "max_model_len" if full else "length"  # cut before max_tokens: the context was full
    return [[(tok.decode(c.token_ids, skip_special_tokens=True), finish(i, c)) for c in o.outputs]
            for i, o in zip(ids, outs)]
