"""Unit tests for minihf.models pieces: config parsing, RoPE, masks, KVCache, build/init.

End-to-end logits parity with transformers lives in test_models_parity.py.
"""

import json

import pytest
import torch
from transformers import LlamaConfig, MistralConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minihf.models import (KVCache, ModelArgs, build_model, init_weights, load_hf,
                           materialize, save_hf)
from minihf.models.masks import padded_causal_mask, plan_buckets, segments
from minihf.models.rope import inv_freq

TINY = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _tiny_args(**kw) -> ModelArgs:
    return ModelArgs(arch="qwen2", vocab_size=50, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=48, attention_bias=True, **kw)


def test_rope_config_layouts_v4_and_v5_parse_the_same():
    v4 = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_theta": 5e5,
          "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}}
    v5 = LlamaConfig(**TINY, rope_theta=5e5, rope_scaling=dict(LLAMA3))
    a, b = ModelArgs.from_hf(v4), ModelArgs.from_hf(v5)
    assert a.rope_theta == b.rope_theta == 5e5
    assert a.rope_scaling == b.rope_scaling == LLAMA3
    assert (a.arch, a.head_dim, a.num_key_value_heads, a.attention_bias) == ("llama", 8, 2, False)
    plain = ModelArgs.from_hf({"model_type": "qwen2", **TINY, "rope_theta": 1e6})
    assert plain.rope_scaling is None and plain.attention_bias and not plain.qk_norm


def test_config_written_for_code_built_args_reads_back_in_transformers():
    args = _tiny_args(rope_theta=2e4, rope_scaling=dict(LLAMA3), tie_word_embeddings=True)
    cfg = args.to_hf_config("lm", dtype="float32")
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    back = ModelArgs.from_hf(cfg)
    assert (back.rope_theta, back.rope_scaling, back.tie_word_embeddings) == (2e4, LLAMA3, True)
    from transformers import Qwen2Config
    hf = Qwen2Config.from_dict(cfg)
    assert hf.rope_parameters["rope_theta"] == 2e4 and hf.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_inv_freq_matches_transformers(scaling):
    cfg = LlamaConfig(**TINY, rope_theta=5e5, rope_scaling=scaling)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    ours = inv_freq(ModelArgs.from_hf(cfg))
    assert torch.equal(ours, ref)


def test_bad_configs_are_clear_errors():
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelArgs.from_hf({"model_type": "llama", **TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_type in"):
        ModelArgs.from_hf({"model_type": "llama", **TINY, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="unsupported architecture 'phi3'.*MistralForCausalLM"):
        ModelArgs.from_hf({"model_type": "phi3", **TINY})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelArgs.from_hf({"model_type": "llama", **TINY, "hidden_act": "gelu"})


def test_masks_by_hand():
    # packed [a0 a1 | b0 | pad]: sequences of 2, 1 and (trailing padding) 1 tokens
    # one bucket (sorted by length: b, pad, a), right-padded by repeating the last token
    seg = segments(torch.tensor([0, 2, 3], dtype=torch.int32), 4)
    assert [g.tolist() for g in seg.gather] == [[2, 2, 3, 3, 0, 1]] and seg.shapes == [(3, 2)]
    assert seg.back.tolist() == [4, 5, 0, 2]  # a0, a1 in row 2; b0 in row 0; pad in row 1
    # lengths far apart go to separate buckets (padded work sum S_b L_b^2 + overhead)
    assert plan_buckets([10, 80, 12, 78]) == [[0, 2], [3, 1]]
    assert plan_buckets([10, 11, 12], overhead=10**9) == [[0, 1, 2]]
    assert plan_buckets([5, 500], overhead=0) == [[0], [1]] and plan_buckets([]) == []
    left = padded_causal_mask(torch.tensor([[0, 0, 1, 1]]))[0, 0].int()
    assert left.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    right = padded_causal_mask(torch.tensor([[1, 1, 0]]))[0, 0].int()
    assert right.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_kv_cache_update_by_hand():
    cache = KVCache(num_layers=1, max_batch=3, n_kv_heads=1, max_len=5, head_dim=2)
    k = torch.arange(8.0).view(2, 1, 2, 2)  # rows 0,1; 2 tokens each
    keys, vals, mask = cache.update(0, k, -k, torch.tensor([[0, 1], [2, 3]]))
    assert keys.shape == (2, 1, 5, 2)
    assert torch.equal(keys[0, 0, :2], k[0, 0]) and torch.equal(keys[1, 0, 2:4], k[1, 0])
    assert torch.equal(vals[1, 0, 2:4], -k[1, 0])
    assert cache.filled.tolist() == [2, 4, 0]
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert mask[1, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]


def test_meta_build_materialize_and_init_weights():
    args = _tiny_args(tie_word_embeddings=True)
    model = build_model(args, device="meta")
    assert all(p.is_meta for p in model.parameters())
    materialize(model, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # to_empty untied it
    init_weights(model, seed=1)
    again = init_weights(materialize(build_model(args, device="meta"), "cpu"), seed=1)
    other = init_weights(build_model(args), seed=2)
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not torch.equal(sd["model.embed_tokens.weight"], sd3["model.embed_tokens.weight"])
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert abs(w.std().item() - args.initializer_range) < 0.003
    assert torch.equal(sd["model.norm.weight"], torch.ones(32))
    assert torch.equal(sd["model.layers.1.self_attn.q_proj.bias"], torch.zeros(32))


def test_forward_input_errors_and_finite_pads():
    model = init_weights(build_model(_tiny_args()), seed=0)
    tokens = torch.randint(0, 50, (2, 5))
    cache = KVCache.for_model(model, max_batch=2, max_len=8)
    with pytest.raises(ValueError, match="not cu_seqlens or attention_mask"):
        model(tokens, torch.arange(5).expand(2, 5), kv_cache=cache, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="batch size 1"):
        model(tokens, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    mask = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]])  # an all-pad row must stay finite
    with torch.no_grad():
        out = model(tokens, (mask.cumsum(-1) - 1).clamp(min=0), attention_mask=mask)
    assert out.shape == (2, 5, 50) and torch.isfinite(out).all()


def test_dtype_checkpoint_errors_and_sliding_window_warning(tmp_path):
    model = init_weights(build_model(_tiny_args()), seed=0)
    save_hf(model, tmp_path / "ok")
    bf = load_hf(tmp_path / "ok", dtype=torch.bfloat16)
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    assert bf(torch.randint(0, 50, (1, 4))).dtype == torch.bfloat16
    # a config that disagrees with the weights
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
    with pytest.raises(ValueError, match="intermediate|shape"):
        load_hf(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing.*layers.2"):
        load_hf(tmp_path / "ok")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(tmp_path / "empty")
    mistral = MistralConfig(**TINY, sliding_window=16)
    mistral.architectures = ["MistralForCausalLM"]
    m = init_weights(build_model(ModelArgs.from_hf(mistral)), seed=0)
    save_hf(m, tmp_path / "mistral")
    with pytest.warns(UserWarning, match="sliding-window"):
        load_hf(tmp_path / "mistral")


def test_model_dir_errors_say_what_the_dir_is(tmp_path):
    from minihf.models import load_args

    with pytest.raises(FileNotFoundError, match=r"model dir \S*nope does not exist"):
        load_args(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no config.json \(expected a Hugging Face") as e:
        load_args(tmp_path / "empty")
    assert "export" not in str(e.value) and "bin" not in str(e.value)
    for marker in ("meta.json", ".metadata", "model/.metadata"):  # minihf ckpt, bare DCP, DCP inside
        ckpt = tmp_path / marker.replace("/", "_").strip(".")
        (ckpt / marker).parent.mkdir(parents=True)
        (ckpt / marker).write_text("{}")
        with pytest.raises(FileNotFoundError, match="has no config.json.*training checkpoint.*minihf export"):
            load_args(ckpt)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json.*pytorch_model.bin.*safetensors"):
        load_args(tmp_path / "bin")
    save_hf(init_weights(build_model(_tiny_args()), seed=0), tmp_path / "bin")  # config + weights
    (tmp_path / "bin" / "model.safetensors").unlink()  # now config.json + pytorch_model.bin only
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin.*safetensors"):
        load_hf(tmp_path / "bin")


def test_flash_varlen_path_plumbing_with_a_reference_kernel(monkeypatch):
    """The CUDA flash-attn branch cannot run here; drive it with a reference kernel that
    has flash_attn_varlen_func's signature and check it against the SDPA mask path."""
    import torch.nn.functional as F

    from minihf.models import layers, masks

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and causal and torch.equal(cu_q, cu_k)
        calls.append((cu_q.tolist(), max_q))
        rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        return out

    model = init_weights(build_model(_tiny_args()), seed=0)
    tokens = torch.randint(0, 50, (1, 9))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu = torch.tensor([0, 3, 5, 7], dtype=torch.int32)  # last 2 tokens: trailing padding
    with torch.no_grad():
        ref = model(tokens, positions, cu_seqlens=cu)
        monkeypatch.setattr(masks, "flash_varlen_usable", lambda device, dtype: True)
        monkeypatch.setattr(layers, "flash_attn_varlen_func", fake_varlen)
        out = model(tokens, positions, cu_seqlens=cu)
    assert calls[0] == ([0, 3, 5, 7, 9], 3) and len(calls) == 2  # one call per layer
    assert (out - ref).abs().max() < 1e-5  # other summation order; |z| < 0.5: 300+ ulp


def test_logits_to_keep_selects_positions():
    """transformers' ``logits_to_keep`` (a tensor of positions, repeats allowed): the same
    logits as the full forward at those positions, padded or packed, and gradients flow."""
    model = init_weights(build_model(_tiny_args()), seed=0)
    tokens = torch.randint(0, 50, (2, 7))
    keep = torch.tensor([6, 2, 2, 0])
    full = model(tokens, attention_mask=torch.ones(2, 7))
    part = model(tokens, attention_mask=torch.ones(2, 7), logits_to_keep=keep)
    # the head on fewer rows may take another GEMM kernel: ~1 ulp of |z| < 0.5; atol 1e-6 is 30+ ulp
    assert part.shape == (2, 4, full.shape[-1]) and torch.allclose(part, full[:, keep], atol=1e-6)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = model(tokens[:1], cu_seqlens=cu)
    part = model(tokens[:1], cu_seqlens=cu, logits_to_keep=keep)
    assert torch.allclose(part, packed[:, keep], atol=1e-6)
    part.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
