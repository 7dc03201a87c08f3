"""Tiny-model factory: `minihf init-model` / `make-data` via the CLI, then the checkpoint load path."""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from minihf.cli import app
from minihf.hub.factory import ARCHS, SIZES, model_config
from minihf.data.rl_dataset import RLDataset
from minihf.data.tokenizer import encode_chat, load_tokenizer
from minihf.models import ModelArgs, build_model, init_weights, load_args, load_hf

runner = CliRunner()


def _text(result) -> str:
    """CLI output with rich's error box and line wrapping removed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "qwen2-tiny"
    result = runner.invoke(app, ["init-model", str(out), "--arch", "qwen2", "--size", "tiny", "--task", "countdown",
                                 "--seed", "3"])
    assert result.exit_code == 0, result.output
    return out


def test_init_model_dir_loads_like_a_checkpoint(model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "special_tokens_map.json"):
        assert (model_dir / name).exists(), name
    tok = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["hidden_size"] == 64
    assert config["vocab_size"] % 32 == 0 and config["vocab_size"] >= len(tok)
    assert (config["eos_token_id"], config["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)
    model = load_hf(model_dir)
    reference = init_weights(build_model(load_args(model_dir)), seed=3)  # what the seed should give
    for (name, p), (ref_name, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert name == ref_name and torch.equal(p, q), name
    ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": "3,5,7:22"}])])
    logits = model(ids, torch.arange(ids.shape[1])[None])
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()


def test_transformers_reads_the_same_model(model_dir):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": "12,3,4:7"}])])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ours = load_hf(model_dir)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, torch.arange(ids.shape[1])[None])
    # other kernels on the same weights; fp32 logits |z| < ~1.3 (ulp 1.2e-7): 1e-5 is 80+ ulp
    assert (got - expected).abs().max().item() <= 1e-5


def test_make_data_then_dataset(tmp_path, model_dir):
    result = runner.invoke(app, ["make-data", "countdown", str(tmp_path), "--train", "8", "--test", "2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    ds = RLDataset(tmp_path / "train.parquet", load_tokenizer(model_dir), max_prompt_length=64)
    assert len(ds) == 8
    assert ds.tokenizer.unk_token_id not in {t for i in range(8) for t in ds[i]["input_ids"]}


def test_cli_errors(tmp_path, model_dir):
    result = runner.invoke(app, ["init-model", str(model_dir)])
    assert result.exit_code != 0 and "already holds a model" in _text(result)
    result = runner.invoke(app, ["init-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert result.exit_code != 0 and "qwen2" in _text(result) and not (tmp_path / "x").exists()
    result = runner.invoke(app, ["make-data", "sudoku", str(tmp_path)])
    assert result.exit_code != 0 and "countdown" in _text(result)


@pytest.mark.parametrize("size, low, high", [("tiny", 5e4, 2e5), ("small", 4.5e6, 5.5e6), ("medium", 27e6, 33e6)])
def test_sizes_parameter_counts(size, low, high):
    for arch in ARCHS:
        config = model_config(arch, size, vocab_size=64, bos_token_id=2, eos_token_id=3, pad_token_id=0)
        assert config.head_dim * config.num_attention_heads == SIZES[size].hidden_size
        args = ModelArgs.from_hf(config)
        model = build_model(args, device="meta")
        n = sum(p.numel() for p in model.parameters())
        if args.is_moe:  # the size is what a token uses: 2 of 8 experts, each half the dense MLP
            expert = sum(p.numel() for p in model.model.layers[0].ffn.experts[0].parameters())
            assert expert == 3 * SIZES[size].hidden_size * SIZES[size].intermediate_size // 2
            n -= args.num_hidden_layers * (args.num_experts - args.num_experts_per_tok) * expert
        assert low <= n <= high, (arch, size, n)
