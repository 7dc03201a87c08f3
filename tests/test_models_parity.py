"""minihf.models vs transformers on the same random weights (fp32, CPU).

Every case builds a tiny model with transformers' own config class, perturbs *all* its
parameters (so norm weights and biases are not the trivial 1/0 of a fresh init), saves it
with save_pretrained and loads it with minihf's load_hf.
"""

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from minihf.models import KVCache, load_hf, read_safetensors, save_hf

TOL = 1e-5
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama-tied-llama3": (LlamaConfig, dict(tie_word_embeddings=True, rope_theta=5e5,
                                            rope_scaling=LLAMA3)),
    "llama-untied-bias": (LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True,
                                            mlp_bias=True)),
    "qwen2-tied": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2-untied": (Qwen2Config, dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3-tied": (Qwen3Config, dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-untied": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=16)),
    "mistral-untied": (MistralConfig, dict(tie_word_embeddings=False, head_dim=16,
                                           sliding_window=None)),
    "mistral-tied": (MistralConfig, dict(tie_word_embeddings=True, head_dim=16,
                                         sliding_window=None)),
    # mixture of experts: renormalised top-2 of 8; top-3 of 6 unnormalised with layer 0
    # dense (mlp_only_layers); Mixtral's block_sparse_moe with w1/w2/w3
    "qwen3moe-norm-untied": (Qwen3MoeConfig, dict(tie_word_embeddings=False, head_dim=16, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True)),
    "qwen3moe-mixed-tied": (Qwen3MoeConfig, dict(tie_word_embeddings=True, head_dim=16, num_experts=6,
                                            num_experts_per_tok=3, moe_intermediate_size=24,
                                            norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral-untied": (MixtralConfig, dict(tie_word_embeddings=False, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=None)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (hf_dir, transformers model), built lazily and shared by the tests."""
    cache = {}

    def get(name):
        if name not in cache:
            cls, extra = CASES[name]
            cfg = cls(**TINY, **extra)
            torch.manual_seed(hash(name) % 1000)
            hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
            with torch.no_grad():
                for p in hf.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (path, hf)
        return cache[name]

    return get


def _hf_logits(hf, tokens, **kw):
    with torch.no_grad():
        return hf(input_ids=tokens, use_cache=False, **kw).logits


def _padded(lengths, T, left, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            mask[i, T - n:] = 1
        else:
            mask[i, :n] = 1
    tokens = tokens * mask  # pad id 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return tokens, mask, positions


@pytest.mark.parametrize("name", list(CASES))
def test_padded_and_packed_match_transformers(checkpoints, name):
    path, hf = checkpoints(name)
    model = load_hf(path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == ("-tied" in name)
    # padded batch, both sides, rows of different lengths; only real tokens compared
    for left in (False, True):
        tokens, mask, pos = _padded([9, 6, 3], 9, left)
        ref = _hf_logits(hf, tokens, attention_mask=mask, position_ids=pos)
        with torch.no_grad():
            out = model(tokens, pos, attention_mask=mask)
        real = mask.bool()
        assert torch.isfinite(out).all()
        assert (out[real] - ref[real]).abs().max() <= TOL, f"left={left}"
    # packed: three sequences in one row (+2 trailing pads), each vs its own HF run
    lens = [5, 8, 3]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 100, (n,), generator=g) for n in lens]
    tokens = torch.cat(seqs + [torch.zeros(2, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(2, dtype=torch.long)])[None]
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32)
    with torch.no_grad():
        out = model(tokens, positions, cu_seqlens=cu)[0]
    assert torch.isfinite(out).all()
    for s, start in zip(seqs, cu[:-1].tolist()):
        ref = _hf_logits(hf, s[None])[0]
        assert (out[start:start + len(s)] - ref).abs().max() <= TOL


@pytest.mark.parametrize("name", ["llama-tied-llama3", "qwen2-untied", "qwen3-tied", "qwen3moe-mixed-tied",
                                  "mixtral-untied"])
def test_kv_cache_decode_matches_full_forward(checkpoints, name):
    path, _ = checkpoints(name)
    model = load_hf(path)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 100, (2, 11), generator=g)
    pos = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        full = model(tokens, pos)
        cache = KVCache.for_model(model, max_batch=4, max_len=16)
        # chunked prefill (4 + 3 tokens), then one token at a time
        steps = [model(tokens[:, :4], pos[:, :4], kv_cache=cache),
                 model(tokens[:, 4:7], pos[:, 4:7], kv_cache=cache)]
        steps += [model(tokens[:, t:t + 1], pos[:, t:t + 1], kv_cache=cache) for t in range(7, 11)]
    inc = torch.cat(steps, dim=1)
    assert (inc - full).abs().max() <= TOL


@pytest.mark.parametrize("name", ["llama-tied-llama3", "qwen3-untied", "qwen3moe-norm-untied"])
def test_save_hf_loads_in_transformers_single_and_sharded(checkpoints, name, tmp_path):
    path, _ = checkpoints(name)
    model = load_hf(path)
    tokens = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    for sub, shard in (("single", "5GB"), ("sharded", 40_000)):
        out = save_hf(model, tmp_path / sub, max_shard_size=shard)
        index = out / "model.safetensors.index.json"
        assert index.exists() == (sub == "sharded")
        if sub == "sharded":
            files = set(json.loads(index.read_text())["weight_map"].values())
            assert len(files) > 2
        keys = read_safetensors(out)
        assert ("lm_head.weight" in keys) == ("untied" in name)
        hf2 = AutoModelForCausalLM.from_pretrained(out).eval()
        assert (_hf_logits(hf2, tokens) - ours).abs().max() <= TOL
        with torch.no_grad():
            again = load_hf(out)(tokens)
        assert torch.equal(again, ours)


def test_value_and_score_models_from_causal_checkpoint(checkpoints, tmp_path):
    path, _ = checkpoints("qwen2-tied")
    lm = load_hf(path)
    tokens = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = lm.forward_hidden(tokens)
    for head, auto in (("value", AutoModelForTokenClassification),
                       ("score", AutoModelForSequenceClassification)):
        with pytest.warns(UserWarning, match="initialised the new head"):
            m = load_hf(path, head=head)
        with torch.no_grad():
            assert torch.equal(m.forward_hidden(tokens), hidden)
            vals = m(tokens)
        assert vals.shape == (2, 6) and vals.std() > 0
        out = save_hf(m, tmp_path / head)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == [f"Qwen2{auto.__name__[len('AutoModel'):]}"]
        hf = auto.from_pretrained(out).eval()
        with torch.no_grad():
            if head == "value":
                ref = hf(tokens).logits[..., 0]
                assert (ref - vals).abs().max() <= TOL
            else:  # HF pools at each row's rightmost token != pad_token_id (transformers 5)
                ref = hf(tokens[:1]).logits[0, 0]  # batch 1: no pad token needed
                assert (ref - vals[0, -1]).abs() <= TOL
                # a right-padded batch of 3 lengths; pad id 99 never occurs among the real tokens
                hf.config.pad_token_id = 99
                lengths = torch.tensor([6, 3, 5])
                mask = (torch.arange(6) < lengths[:, None]).long()
                real = torch.randint(0, 99, (3, 6), generator=torch.Generator().manual_seed(5))
                padded = torch.where(mask.bool(), real, 99)
                ref = hf(padded, attention_mask=mask).logits[:, 0]
                ours = m(padded, attention_mask=mask)[torch.arange(3), lengths - 1]
                assert ref.shape == (3,) and (ref - ours).abs().max() <= TOL
                alone = torch.stack([m(real[i:i + 1, :n])[0, -1] for i, n in enumerate(lengths.tolist())])
                assert (alone - ours).abs().max() <= TOL  # padding changes nothing
        reloaded = load_hf(out, head=head)  # same head: no fresh init, identical values
        with torch.no_grad():
            assert torch.equal(reloaded(tokens), vals)
    with pytest.raises(ValueError, match="head='value' or head='score'"):
        load_hf(tmp_path / "score", head="lm")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_hf(tmp_path)
