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
whole truth, so we load it with ``PreTrainedTokenizerFast`` directly. Before transformers
reads anything, ``check_tokenizer_files`` checks the files (one line naming the file and key
for a broken one), and after it a tokenizer that encodes text to no ids (built from
tokenizer_config.json without its vocabulary) is refused.
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
# The JSON files transformers reads from a tokenizer dir; each must be a JSON object.
_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json", "added_tokens.json",
               "vocab.json")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")
# Text every real tokenizer encodes to at least one id (byte-level BPE, sentencepiece and
# character tokenizers alike, through <unk> if need be); none means it has no vocabulary.
_PROBE = "Hello, world 0123456789"


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
    config = check_tokenizer_files(model_dir)
    # trust_remote_code=False always: a model dir's own code (``auto_map``) is never run, and
    # transformers would otherwise ask "run the custom code? [y/N]" on a terminal
    try:
        if config.get("tokenizer_class") in _GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), trust_remote_code=False)
        else:  # importing AutoTokenizer scans every model of transformers (~0.5 s a process)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise _unreadable(model_dir, e) from e
        raise ValueError(
            f"load_tokenizer: {model_dir} needs its own code to load its tokenizer "
            f"(tokenizer_class {config.get('tokenizer_class')!r} via auto_map); minihf never runs "
            "code from a model dir: use a tokenizer transformers ships (a tokenizer.json with "
            "tokenizer_class PreTrainedTokenizerFast, or a built-in class)") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a ValueError is handled above
        raise _unreadable(model_dir, e) from e
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot read
        if type(e) is not Exception:
            raise
        raise _unreadable(model_dir, e) from e
    _check_has_vocabulary(tokenizer, model_dir)
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


def _fix(name: str) -> str:
    return f"copy a good {name} from the model's source (or the tokenizer dir it was made from)"


def _check_special_tokens(entries: dict, path: Path) -> None:
    """Special-token values: a string, an AddedToken object ({"content": ...}) or null; the
    additional ones a list of those (or, in transformers 5, a dict of named ones)."""
    def token_ok(v):
        return v is None or isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str))

    for key in _SPECIAL_KEYS:
        if key in entries and not token_ok(entries[key]):
            raise ValueError(f"{path}: {key}={entries[key]!r} must be a token string (e.g. \"<eos>\") or null; "
                             f"{_fix(path.name)}")
    for key in _SPECIAL_LISTS:
        value = entries.get(key)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if value is not None and (items is None or not all(token_ok(v) and v is not None for v in items)):
            raise ValueError(f"{path}: {key}={value!r} must be a list of token strings; {_fix(path.name)}")


def check_tokenizer_files(model_dir: str | Path) -> dict:
    """The tokenizer files of ``model_dir`` checked before transformers reads them; returns
    tokenizer_config.json's settings (``{}`` without one).

    A ValueError naming the file (and key) for a JSON file that is empty, truncated, not JSON
    or not an object (``_JSON_FILES``); a tokenizer.json without the ``model`` object or
    ``added_tokens`` list a tokenizer needs; special tokens that are not strings; settings of
    the wrong kind (``tokenizer_class``, ``chat_template``, ``model_max_length``,
    ``padding_side``); a chat_template.jinja that is not text; and a generic tokenizer class
    without the tokenizer.json it is read from. transformers itself would raise a KeyError
    or AttributeError from deep inside, or (tokenizer.json missing) build a tokenizer without
    a vocabulary that encodes every text to no ids."""
    model_dir = Path(model_dir)
    data = {}
    for name in _JSON_FILES:
        path = model_dir / name
        if path.is_file():
            data[name] = read_json(path, _fix(name))
            if not isinstance(data[name], dict):
                raise ValueError(f"{path} must be a JSON object, got a {type(data[name]).__name__}; {_fix(name)}")
    tok_json = data.get("tokenizer.json")
    if tok_json is not None:
        path = model_dir / "tokenizer.json"
        if not isinstance(tok_json.get("model"), dict):
            raise ValueError(f"{path} has no \"model\" object (the vocabulary and how text is split), so it "
                             f"is not a tokenizers tokenizer.json; {_fix(path.name)}")
        if not isinstance(tok_json.get("added_tokens", []), list) or "added_tokens" not in tok_json:
            raise ValueError(f"{path}: added_tokens={tok_json.get('added_tokens')!r} must be a list (the special "
                             f"tokens; [] for none); {_fix(path.name)}")
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if name in data:
            _check_special_tokens(data[name], model_dir / name)
    config = data.get("tokenizer_config.json", {})
    path = model_dir / "tokenizer_config.json"
    kinds = {"tokenizer_class": (str,), "chat_template": (str, list), "model_max_length": (int, float)}
    for key, types in kinds.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            want = {"tokenizer_class": "a class name string", "chat_template": "a Jinja template string",
                    "model_max_length": "a number"}[key]
            raise ValueError(f"{path}: {key}={value!r} must be {want}; {_fix(path.name)}")
    for key in ("padding_side", "truncation_side"):
        if config.get(key) not in (None, "left", "right"):
            raise ValueError(f"{path}: {key}={config[key]!r} must be \"left\" or \"right\"; {_fix(path.name)}")
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        try:
            template.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{template} is not UTF-8 text (a binary or damaged file); "
                             f"{_fix(template.name)}") from None
    cls = config.get("tokenizer_class")
    if cls in _GENERIC_CLASSES and tok_json is None:
        raise ValueError(f"{path}: tokenizer_class {cls!r} reads its vocabulary from tokenizer.json, and "
                         f"{model_dir} has none; copy tokenizer.json from the model's source (without it "
                         "every text would encode to no tokens)")
    return config


def _unreadable(model_dir: Path, exc: BaseException) -> ValueError:
    """One line for a tokenizer dir transformers could not load past our checks."""
    files = [n for n in (*_JSON_FILES, "tokenizer.model", "vocab.txt", "merges.txt") if (model_dir / n).exists()]
    reason = (str(exc).splitlines() or [""])[0][:200]
    return ValueError(f"load_tokenizer: transformers could not load the tokenizer in {model_dir} from "
                      f"{', '.join(files) or 'its files'} ({type(exc).__name__}: {reason}); one of them is "
                      "damaged or of another format: copy the tokenizer files from the model's source")


def _check_has_vocabulary(tokenizer, model_dir: Path) -> None:
    """A ValueError if ``tokenizer`` encodes ordinary text to no ids: transformers builds such
    a tokenizer from tokenizer_config.json when the vocabulary files are missing."""
    try:
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception:  # e.g. a vocabulary without <unk>: it has one, the probe just does not fit it
        return
    if not ids:
        wanted = sorted(set(getattr(tokenizer, "vocab_files_names", {}).values())) or ["tokenizer.json"]
        raise ValueError(f"load_tokenizer: the tokenizer in {model_dir} ({type(tokenizer).__name__}, from "
                         f"tokenizer_config.json) has no vocabulary: it encodes every text to no tokens; "
                         f"copy its vocabulary file(s) ({', '.join(wanted)}) from the model's source")


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


def chars_outside_vocab(tok, chars) -> set[str]:
    """The characters among ``chars`` that ``tok`` can only encode as its unknown token (none
    when it has no unknown token): what ``minihf generate`` and ``minihf eval`` refuse."""
    unk = tok.unk_token_id
    if unk is None:
        return set()
    return {c for c in set(chars) if unk in tok(c, add_special_tokens=False)["input_ids"]}


def unknown_chars_error(tok, texts, what: str, fix: str) -> str | None:
    """The message for the first ``(where, text)`` of ``texts`` (each a ``what``: a prompt,
    an example) holding characters ``tok`` can only encode as its unknown token (a character
    tokenizer's; byte-level BPE has none), naming them and ``fix``; None when every text
    encodes. The tokenizer's added tokens (``<tool_call>``) are whole tokens, not their
    characters; a text that holds the unknown token's own string is let through (it asks for
    that token)."""
    if tok.unk_token_id is None:
        return None
    added = sorted(tok.get_added_vocab(), key=len, reverse=True)

    def plain(text: str) -> str:
        for token in added:
            text = text.replace(token, "")
        return text

    texts = [(where, plain(text)) for where, text in texts
             if not (tok.unk_token and tok.unk_token in text)]
    unknown = chars_outside_vocab(tok, {c for _, text in texts for c in text})
    for where, text in texts if unknown else []:
        bad = sorted(unknown & set(text))
        if bad:
            return (f"{where}: the {what} has characters outside the model's vocabulary: {bad} (they would "
                    f"all become {tok.unk_token!r}); {fix}")
    return None
