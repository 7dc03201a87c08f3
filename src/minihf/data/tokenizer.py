"""Character-level tokenizers for synthetic tasks, and loading any tokenizer from a model dir.

``build_char_tokenizer`` makes a small tokenizer with the ``tokenizers`` library (one token
per character of a task alphabet, plus special tokens) wrapped in transformers'
``PreTrainedTokenizerFast``, with a Jinja chat template. ``save_tokenizer`` writes it as a
normal Hugging Face tokenizer dir (tokenizer.json, tokenizer_config.json with the chat
template, special_tokens_map.json, chat_template.jinja), readable by transformers 4.x and 5.x.

``load_tokenizer`` is the one path every tokenizer goes through, a downloaded one or a
minihf-made one. Deliberate deviation from a plain ``AutoTokenizer.from_pretrained``:
transformers resolves the tokenizer class from the model type in config.json, so a generic
tokenizer saved next to a Qwen2 config.json reloads as ``Qwen2Tokenizer``, which re-derives
its pre-tokenizer and silently changes ids (spaces vanish). When tokenizer_config.json names
a generic class ("PreTrainedTokenizerFast"/"TokenizersBackend"), tokenizer.json is the
whole truth, so we load it with ``PreTrainedTokenizerFast`` directly.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from minihf.utils.files import read_json

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS) + ROLE_TOKENS

# One turn: <|role|>content<eos>. The assistant's <eos> ends generation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('minihf chat template: unknown role ' + message['role'] + '; use system, user or assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
# Any one of these marks a dir that holds a tokenizer (fast, sentencepiece, BPE, WordPiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt")


# A tool-use template: extra roles (``tool``), and the tools offered (``tools=``) as one
# compact system line of their names; the hermes call tags are single tokens.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] if 'function' in t else t['name'] }}"
    "{% if not loop.last %},{% endif %}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in roles %}"
    "{{ raise_exception('minihf chat template: unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(alphabet: str, model_max_length: int = 2048, extra_roles: tuple[str, ...] = (),
                         extra_special_tokens: tuple[str, ...] = ()):
    """A ``PreTrainedTokenizerFast`` with one token per distinct character of ``alphabet``.

    Ids: specials first (``<pad>``=0, ``<unk>``=1, ``<bos>``=2, ``<eos>``=3, role markers),
    then the alphabet's characters in sorted order, so the same alphabet always gives the
    same ids. Characters outside the alphabet encode as ``<unk>``. ``extra_roles`` (e.g.
    ``("tool",)``) and ``extra_special_tokens`` (e.g. ``("<tool_call>", "</tool_call>")``)
    get ids after the alphabet, and the chat template then offers tools (``tools=``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("build_char_tokenizer: empty alphabet; pass the characters the task uses, e.g. '0123456789+-='")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    extra = tuple(f"<|{r}|>" for r in extra_roles) + tuple(extra_special_tokens)
    for t in extra:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char a word
    tok.decoder = decoders.Fuse()  # join without spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + extra])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS + extra),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    if extra:
        roles = ", ".join(repr(r) for r in ROLES + tuple(extra_roles))
        fast.chat_template = "{% set roles = [" + roles + "] %}" + TOOL_CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, path: str | Path) -> Path:
    """Save as a normal HF tokenizer dir that reloads identically in transformers 4.x and 5.x.

    Besides ``save_pretrained`` this pins ``tokenizer_class`` to the generic
    ``PreTrainedTokenizerFast`` and also writes the chat template into tokenizer_config.json
    and a special_tokens_map.json (transformers 5 no longer writes them, 4.x reads them).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):  # 5.x writes a list; 4.x wants a dict here
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    specials = {
        key: getattr(tokenizer, key)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tokenizer, key, None) is not None
    }
    extra = [t for t in tokenizer.all_special_tokens if t not in specials.values()]
    if extra:
        specials["additional_special_tokens"] = extra
    (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    return path


def load_tokenizer(model_dir: str | Path, padding_side: str = "left"):
    """Load the tokenizer of a model dir through transformers, offline-safe.

    Generic tokenizers (tokenizer_class ``PreTrainedTokenizerFast``/``TokenizersBackend``,
    e.g. every minihf-made one) load with ``PreTrainedTokenizerFast`` so ids never depend on
    the model type; anything else goes through ``AutoTokenizer``. A tokenizer without a pad
    token gets its eos token as pad (with one warning); without either it is an error.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"load_tokenizer: {model_dir} is not a directory; pass a model dir containing tokenizer.json "
            f"(make one offline with `minihf init-model {model_dir} --task digits`)"
        )
    if (model_dir / "meta.json").exists() and (model_dir / "model").is_dir():
        raise FileNotFoundError(
            f"load_tokenizer: {model_dir} is a minihf training checkpoint, not a model dir; "
            f"export it first with `minihf export {model_dir} OUT` and pass OUT"
        )
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        # AutoTokenizer would otherwise build an empty tokenizer from config.json alone
        # (every text encodes to no ids) or fail deep inside transformers.
        raise FileNotFoundError(
            f"load_tokenizer: {model_dir} holds no tokenizer (none of {list(_TOKENIZER_FILES)}); "
            "copy the tokenizer files of the checkpoint into it, or save one with "
            "tokenizer.save_pretrained(dir)"
        )
    config_file = model_dir / "tokenizer_config.json"
    config = read_json(config_file, "copy a good tokenizer_config.json from the model's source") \
        if config_file.exists() else {}
    # trust_remote_code=False always: a model dir's own code (``auto_map``) is never run, and
    # transformers would otherwise ask "run the custom code? [y/N]" on a terminal
    if config.get("tokenizer_class") in _GENERIC_CLASSES and (model_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), trust_remote_code=False)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise ValueError(
                f"load_tokenizer: {model_dir} needs its own code to load its tokenizer "
                f"(tokenizer_class {config.get('tokenizer_class')!r} via auto_map); minihf never runs "
                "code from a model dir: use a tokenizer transformers ships (a tokenizer.json with "
                "tokenizer_class PreTrainedTokenizerFast, or a built-in class)") from None
    if tokenizer.chat_template is None and "chat_template" in config:
        tokenizer.chat_template = config["chat_template"]
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"load_tokenizer: the tokenizer in {model_dir} has neither a pad nor an eos token; "
                "add pad_token to its tokenizer_config.json"
            )
        warnings.warn(
            f"tokenizer in {model_dir} has no pad token; using its eos token {tokenizer.eos_token!r} "
            f"(id {tokenizer.eos_token_id}) as pad",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def encode_chat(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Renders to text and encodes without extra special tokens, which gives the same ids in
    transformers 4.x (returns a list) and 5.x (returns a BatchEncoding).
    """
    if tokenizer.chat_template is None:
        raise ValueError(
            "encode_chat: the tokenizer has no chat_template; pass plain-text prompts with "
            "apply_chat_template=False, or add a chat_template to tokenizer_config.json"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
