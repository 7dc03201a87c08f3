"""Char tokenizer: save/load next to a Qwen2 config, fresh offline process, chat template, pad."""

import json
import os
import subprocess
import sys
import warnings

import pytest
from transformers import Qwen2Config

from minihf.data.tokenizer import (BOS, EOS, build_char_tokenizer, encode_chat, load_tokenizer,
                                   save_tokenizer)

ALPHABET = "0123456789+-*/(),:= "
TEXT = "12 + (3*4) = 24, 5:6"
CHAT = [{"role": "system", "content": "1 2"}, {"role": "user", "content": "3,4:10,2"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_char_tokenizer(ALPHABET), path)
    # The hazard: a generic tokenizer next to a Qwen2 config.json.
    Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64).save_pretrained(str(path))
    return path


def test_char_ids_and_decode():
    tok = build_char_tokenizer(ALPHABET)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT)  # one token per character, spaces included
    assert tok.decode(ids) == TEXT
    vocab = tok.get_vocab()
    assert [vocab[c] for c in "12 "] == ids[:3]
    assert tok("x")["input_ids"] == [tok.unk_token_id]
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)


def test_reload_next_to_qwen2_config_keeps_ids(tok_dir):
    original = build_char_tokenizer(ALPHABET)
    loaded = load_tokenizer(tok_dir)
    assert loaded(TEXT)["input_ids"] == original(TEXT)["input_ids"]
    assert loaded.decode(loaded(TEXT)["input_ids"]) == TEXT
    assert encode_chat(loaded, CHAT) == encode_chat(original, CHAT)
    assert loaded.padding_side == "left"
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in config
    assert json.loads((tok_dir / "special_tokens_map.json").read_text())["eos_token"] == EOS


def test_chat_template_text_and_errors(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}<|system|>1 2{EOS}<|user|>3,4:10,2{EOS}<|assistant|>"
    no_gen = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert no_gen == text[: -len("<|assistant|>")]
    ids = encode_chat(tok, CHAT)
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "1 23,4:10,2"
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)


def test_missing_pad_token_uses_eos_and_warns(tmp_path):
    save_tokenizer(build_char_tokenizer(ALPHABET), tmp_path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = json.loads((tmp_path / name).read_text())
        data.pop("pad_token", None)
        (tmp_path / name).write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="no pad token") as record:
        tok = load_tokenizer(tmp_path)
    assert len([w for w in record if "no pad token" in str(w.message)]) == 1
    assert tok.pad_token == EOS and tok.pad_token_id == tok.eos_token_id


def test_load_tokenizer_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="init-model"):
        load_tokenizer(tmp_path / "nope")
    # a dir with only config.json (e.g. weights copied without the tokenizer) is an error,
    # not an empty tokenizer that encodes every text to no ids
    Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64).save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


_CHILD = r"""
import json, sys
from minihf.data.tokenizer import load_tokenizer, encode_chat
tok = load_tokenizer(sys.argv[1])
ids = tok(sys.argv[2])["input_ids"]
chat = encode_chat(tok, json.loads(sys.argv[3]))
print(json.dumps({"ids": ids, "decoded": tok.decode(ids), "chat": chat, "class": type(tok).__name__,
                  "pad": tok.pad_token_id, "eos": tok.eos_token_id}))
"""


def test_round_trip_in_fresh_offline_process(tok_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tok_dir), TEXT, json.dumps(CHAT)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved tokenizer has a pad token: no warning
        parent = load_tokenizer(tok_dir)
    assert child["ids"] == parent(TEXT)["input_ids"]
    assert child["decoded"] == TEXT
    assert child["chat"] == encode_chat(parent, CHAT)
    assert (child["pad"], child["eos"]) == (0, 3)


def test_a_model_dir_with_its_own_tokenizer_code_is_refused_never_run(smollm2_tokenizer_dir, tmp_path):
    """A tokenizer_config.json whose auto_map points at the dir's own Python: minihf refuses
    it in one line and never runs it (nor asks "run the custom code? [y/N]")."""
    import json
    import shutil

    import pytest

    from minihf.data import load_tokenizer

    d = tmp_path / "custom"
    shutil.copytree(smollm2_tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "marker"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import PreTrainedTokenizerFast\n"
                               "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(ValueError, match=r"needs its own code .* minihf never runs code from a model dir"):
        load_tokenizer(d)
    assert not marker.exists()
