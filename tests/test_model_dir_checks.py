"""Model dirs broken one file at a time (a tester's round on ``minihf init-model --size tiny
--task digits``), each refused at load in one line naming the file, the key and the fix:

* tokenizer files (``minihf.data.tokenizer.check_tokenizer_files``, run by ``load_tokenizer``,
  which train, generate, eval and ``init-model --tokenizer`` all use): tokenizer.json missing
  next to a tokenizer_config.json (it used to load a tokenizer that encodes every text to no
  ids), JSON that is empty, truncated, not an object or not a tokenizer, special tokens that
  are not strings;
* eos ids in generation_config.json and config.json (``minihf.rollout.llm.eos_ids``): not
  whole numbers, negative or outside the vocabulary;
* more config.json values (``minihf.models.args.check_config``): absurd sizes, non-finite
  floats, rope settings, booleans written as strings, ``architectures`` as a string.
"""

import json
import shutil

import pytest
from typer.testing import CliRunner

from minihf.cli import app
from minihf.data.tokenizer import load_tokenizer
from minihf.models import load_args, load_hf
from minihf.rollout.llm import eos_ids_from_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from minihf.hub import init_model

    return init_model(tmp_path_factory.mktemp("checks") / "model", size="tiny", task="digits")


def broken(model_dir, tmp_path, name, change):
    """A copy of ``model_dir`` with ``name`` changed: ``change`` is None (deleted), bytes
    (the new content), a callable of the old bytes, or a dict merged into the JSON."""
    out = tmp_path / "bad"
    shutil.copytree(model_dir, out)
    target = out / name
    if change is None:
        target.unlink()
    elif isinstance(change, dict):
        target.write_text(json.dumps({**json.loads(target.read_text()), **change}))
    else:
        target.write_bytes(change(target.read_bytes()) if callable(change) else change)
    return out


def says(res, text: str) -> bool:
    """The CLI failed without a traceback, saying ``text`` (compared without spaces: Rich
    wraps long lines anywhere, even inside a path)."""
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    return "".join(text.split()) in "".join(res.output.replace("│", " ").split())


# ---------------------------------------------------------------------------- tokenizer files


@pytest.mark.parametrize("name, change, message", [
    ("tokenizer.json", None, r"tokenizer_config.json: tokenizer_class 'PreTrainedTokenizerFast' reads its "
                             r"vocabulary from tokenizer.json, and .* has none; copy tokenizer.json"),
    ("tokenizer.json", b'{"a":1}', r"tokenizer.json has no \"model\" object .*copy a good tokenizer.json"),
    ("tokenizer.json", {"added_tokens": {}}, r"tokenizer.json: added_tokens=\{\} must be a list"),
    ("tokenizer.json", b"", r"tokenizer.json is empty \(written only in part\?\); copy a good tokenizer.json"),
    ("tokenizer.json", lambda b: b[:len(b) // 2], r"tokenizer.json is not valid JSON \(.* at line \d+, column \d+\)"),
    ("tokenizer_config.json", b"[1, 2]", r"tokenizer_config.json must be a JSON object, got a list"),
    ("tokenizer_config.json", {"tokenizer_class": 5}, r"tokenizer_config.json: tokenizer_class=5 must be a class name"),
    ("tokenizer_config.json", {"padding_side": "up"}, r"tokenizer_config.json: padding_side='up' must be \"left\""),
    ("special_tokens_map.json", b"{not json", r"special_tokens_map.json is not valid JSON"),
    ("special_tokens_map.json", b"[]", r"special_tokens_map.json must be a JSON object, got a list"),
    ("special_tokens_map.json", {"eos_token": 3}, r"special_tokens_map.json: eos_token=3 must be a token string"),
    ("chat_template.jinja", b"\xff\xfe{{", r"chat_template.jinja is not UTF-8 text"),
])
def test_broken_tokenizer_files_name_the_file(model_dir, tmp_path, name, change, message):
    bad = broken(model_dir, tmp_path, name, change)
    with pytest.raises(ValueError, match=rf"{bad}/{message}"):
        load_tokenizer(bad)


def test_a_tokenizer_without_vocabulary_is_refused(model_dir, tmp_path):
    # tokenizer_config.json alone, no class named: transformers builds the model type's own
    # tokenizer (Qwen2Tokenizer) with no vocabulary, which encodes every text to no ids
    bad = broken(model_dir, tmp_path, "tokenizer.json", None)
    (bad / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"tokenizer in {bad} \(Qwen2Tokenizer, from tokenizer_config.json\) "
                                         r"has no vocabulary: it encodes every text to no tokens; copy"):
        load_tokenizer(bad)


def test_tokenizer_checks_on_the_paths_that_load_one(model_dir, tmp_path):
    from minihf.hub import init_model

    bad = broken(model_dir, tmp_path, "tokenizer.json", None)
    res = CliRunner().invoke(app, ["generate", str(bad), "-p", "1,2"])  # was "encode to no tokens"
    assert says(res, f"{bad}/tokenizer_config.json: tokenizer_class 'PreTrainedTokenizerFast' reads"), res.output
    with pytest.raises(ValueError, match=r"has none; copy tokenizer.json"):
        init_model(tmp_path / "new", tokenizer=bad)
    assert not (tmp_path / "new").exists()


def test_good_tokenizer_dirs_still_load(model_dir, smollm2_tokenizer_dir, tmp_path):
    assert load_tokenizer(model_dir)("1,2", add_special_tokens=False)["input_ids"]
    assert len(load_tokenizer(smollm2_tokenizer_dir)("Hello world")["input_ids"]) == 2
    # tokenizer_config.json may go: tokenizer.json is then the whole tokenizer
    alone = broken(model_dir, tmp_path, "tokenizer_config.json", None)
    assert load_tokenizer(alone)("1,2", add_special_tokens=False)["input_ids"]
    none = tmp_path / "none"
    shutil.copytree(model_dir, none, ignore=shutil.ignore_patterns("tokenizer*", "special*", "chat*"))
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):  # as before
        load_tokenizer(none)


# ---------------------------------------------------------------------------- eos ids


@pytest.mark.parametrize("value, message", [
    ("x", r"eos_token_id='x' must be a token id \(a whole number from 0 to 31, vocab_size=32 in config.json\) "
          r"or a list of them \(a string: write it without quotes\)"),
    (-1, r"eos_token_id=-1 must be a token id"),
    (32, r"eos_token_id=32 must be a token id"),
    ([3, 40], r"eos_token_id=\[3, 40\] must be a token id"),
    (True, r"eos_token_id=True must be a token id"),
])
def test_bad_eos_ids_name_the_file_and_key(model_dir, tmp_path, value, message):
    config = json.loads((model_dir / "config.json").read_text())
    bad = broken(model_dir, tmp_path, "generation_config.json", {"eos_token_id": value})
    with pytest.raises(ValueError, match=rf"{bad / 'generation_config.json'}: {message}.*; fix that value in "
                                         r"generation_config.json, or delete the file"):
        eos_ids_from_dir(bad, config)
    bad_cfg = tmp_path / "bad_cfg"
    shutil.copytree(model_dir, bad_cfg)
    (bad_cfg / "generation_config.json").unlink()
    (bad_cfg / "config.json").write_text(json.dumps({**config, "eos_token_id": value}))
    pattern = rf"{bad_cfg / 'config.json'}: {message}.*; fix that value in config.json"
    with pytest.raises(ValueError, match=pattern):
        eos_ids_from_dir(bad_cfg, json.loads((bad_cfg / "config.json").read_text()))
    with pytest.raises(ValueError, match=pattern):  # and wherever the model is loaded
        load_args(bad_cfg)


def test_eos_ids_through_generate_and_good_ones(model_dir, tmp_path):
    bad = broken(model_dir, tmp_path, "generation_config.json", {"eos_token_id": "x"})
    res = CliRunner().invoke(app, ["generate", str(bad), "-p", "1,2"])  # was "invalid literal for int()"
    assert says(res, f"{bad}/generation_config.json: eos_token_id='x' must be a token id"), res.output
    config = json.loads((model_dir / "config.json").read_text())
    assert eos_ids_from_dir(model_dir, config) == (3,)
    good = tmp_path / "good"
    shutil.copytree(model_dir, good)
    (good / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 31]}))
    assert eos_ids_from_dir(good, config) == (3, 31)
    (good / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert eos_ids_from_dir(good, config) == ()  # null there: no eos, as transformers reads it


# ---------------------------------------------------------------------------- config.json values


LINEAR = {"rope_theta": 10000.0, "rope_type": "linear"}
LLAMA3 = {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True, "sliding_window": "abc"},
     r"sliding_window='abc' must be a whole number >= 1 .* \(a string: write it without quotes\)"),
    ({"vocab_size": 10**12}, r"vocab_size=1000000000000 \(tokens in the vocabulary\) is past the most minihf "
                             r"accepts, 16777216 \(2\*\*24\)"),
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers=1000000 \(decoder layers\) is past the most minihf accepts"),
    ({"max_position_embeddings": 10**12}, r"max_position_embeddings=1000000000000 \(the context length\) is past"),
    ({"vocab_size": 2**24, "hidden_size": 2**20, "head_dim": 16},
     r"its sizes \(vocab_size=16777216, hidden_size=1048576, .*\) imply 17.6T parameters, past the 1.1T"),
    ({"rope_parameters": {"rope_theta": float("inf"), "rope_type": "default"}},
     r"rope_parameters.rope_theta=inf must be a finite number > 0"),
    ({"rope_theta": float("inf"), "rope_parameters": None}, r"rope_theta=inf must be a finite number > 0"),
    ({"rms_norm_eps": 1e300}, r"rms_norm_eps=1e\+300 must be a number > 0 and < 1"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a number > 0 and < 1"),
    ({"rope_parameters": {**LINEAR, "factor": -2}},
     r"rope_parameters.factor=-2 must be a finite number > 0 \(rope_type 'linear' reads it\)"),
    ({"rope_parameters": LINEAR}, r"rope_parameters.factor is missing \(rope_type 'linear' reads it\)"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": float("inf")}},
     r"rope_scaling.factor=inf must be a finite number > 0"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": None, "type": "linear", "factor": -2}},
     r"rope_scaling.factor=-2 must be a finite number > 0"),  # the type is read as _parse_rope reads it
    ({"rope_parameters": {**LINEAR, "rope_type": ["linear"]}}, r"unsupported rope_parameters.rope_type=\['linear'\]"),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 0}}, r"rope_parameters.low_freq_factor=0 must be a finite"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}},
     r"rope_parameters.high_freq_factor=1.0 must be greater than low_freq_factor=1.0"),
    ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": "512"}},
     r"rope_parameters.original_max_position_embeddings='512' must be a whole number"),
    ({"rope_parameters": {**LINEAR, "rope_type": "yarn", "factor": 2.0}},
     r"unsupported rope_parameters.rope_type='yarn' .*: minihf supports rope_type in"),
    ({"rope_parameters": "linear"}, r"rope_parameters='linear' must be a JSON object"),
    ({"rope_parameters": None, "rope_scaling": ["linear", 2.0]},
     r"rope_scaling=\['linear', 2.0\] must be a JSON object"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false' must be true or false, a JSON boolean "
                                       r"\(a string: write it without quotes\)"),
    ({"attention_bias": "false"}, r"attention_bias='false' must be true or false"),
    ({"mlp_bias": 0}, r"mlp_bias=0 must be true or false"),
    ({"use_sliding_window": "no"}, r"use_sliding_window='no' must be true or false"),
    ({"architectures": "Qwen2ForCausalLM"}, r"architectures='Qwen2ForCausalLM' must be a list of class names, "
                                            r"e.g. \[\"Qwen2ForCausalLM\"\]"),
    ({"architectures": ["Phi3ForCausalLM"]}, r"unsupported architecture 'Phi3ForCausalLM'"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported: minihf's MLP is SwiGLU"),
    ({"initializer_range": "0.02"}, r"initializer_range='0.02' must be a finite number >= 0"),
])
def test_more_bad_config_json_values_name_the_file_and_key(model_dir, tmp_path, change, message):
    bad = broken(model_dir, tmp_path, "config.json", change)
    with pytest.raises(ValueError, match=rf"^{bad / 'config.json'}: {message}"):
        load_hf(bad)


def test_a_config_that_disagrees_with_its_weights_fails_before_allocating(model_dir, tmp_path):
    # within every cap and ~2**39 parameters (2 TiB in fp32): the shapes are compared on the
    # meta device, before any memory is taken (this was an allocation error)
    bad = broken(model_dir, tmp_path, "config.json", {"vocab_size": 2**23, "hidden_size": 2**16})
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(32, 64\), the config implies "
                                         r"\(8388608, 65536\); config.json and weights disagree"):
        load_hf(bad)


def test_good_config_values_still_load(model_dir, tmp_path):
    args = load_args(broken(model_dir, tmp_path, "config.json", {
        "use_sliding_window": True, "sliding_window": 16, "tie_word_embeddings": True, "attention_bias": None,
        "rope_parameters": LLAMA3, "eos_token_id": [3, 31], "max_position_embeddings": None}))
    assert (args.sliding_window, args.tie_word_embeddings, args.max_position_embeddings) == (16, True, 4096)
    assert args.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    # a rope_parameters without rope_theta is still read (rope_theta from the top level)
    args = load_args(broken(model_dir, tmp_path / "2", "config.json", {
        "rope_theta": 5e5, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}))
    assert (args.rope_theta, args.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
