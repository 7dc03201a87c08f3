"""Text in, text out: tokenizer + :class:`LLM` for the ``minihf generate`` command.

The tokenizer comes from the model dir through ``minihf.data.tokenizer.load_tokenizer`` (the
one offline-safe path every minihf tokenizer goes through). Generation stops at the
config's EOS ids and at the tokenizer's EOS token.
"""

from __future__ import annotations

from pathlib import Path

from .llm import LLM, eos_ids_from_dir
from .sampling import SamplingParams


def generate_text(model_dir: str | Path, prompts: list[str], params: SamplingParams, chat: bool = False,
                  max_model_len: int | None = None) -> list[list[str]]:
    """Completions (``params.n`` per prompt) decoded to text, special tokens skipped.

    ``chat=True`` renders each prompt as one user turn with the tokenizer's chat template.
    """
    import json

    from minihf.data.tokenizer import encode_chat, load_tokenizer

    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    if chat:
        ids = [encode_chat(tok, [{"role": "user", "content": p}]) for p in prompts]
    else:
        ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    empty = [p for p, i in zip(prompts, ids) if not i]
    if empty:
        raise ValueError(f"prompt(s) {empty!r} encode to no tokens; pass non-empty text")
    config = json.loads((model_dir / "config.json").read_text())
    eos = set(eos_ids_from_dir(model_dir, config))
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    llm = LLM(model_dir, max_model_len=max_model_len, eos_token_ids=tuple(sorted(eos)))
    outs = llm.generate(ids, params)
    llm.free()
    return [[tok.decode(c.token_ids, skip_special_tokens=True) for c in o.outputs] for o in outs]
