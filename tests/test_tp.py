"""Tensor parallelism: TP=2 and TP=4 (gloo, spawned ranks) vs the unsharded model in the same
process: logits allclose and greedy generations identical; plus the pure slicing rule."""

import pytest
import torch

from minihf.parallel.tp import shard_tensor, tp_shard_dim
from minihf.utils.spawn import spawn_ranks

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [5, 6, 7]]


def _tp_rank(rank, world_size, path):
    import torch.distributed as dist

    from minihf.models import load_hf
    from minihf.parallel.tp import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead, apply_tp, load_full_state_dict,
    )
    from minihf.rollout import LLM, SamplingParams

    group = dist.group.WORLD
    ids = torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    ref_model = load_hf(path)
    with torch.no_grad():
        ref_logits = ref_model(ids, pos)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, n=2)
    ref = LLM(ref_model, max_num_seqs=3)
    ref_greedy = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, greedy)]
    ref_lp = [o.outputs[0].logprobs for o in ref.generate(PROMPTS, greedy)]
    results = {}
    for vocab_parallel in (True, False):
        model = apply_tp(load_hf(path), group, vocab_parallel=vocab_parallel)
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(model.model.layers[0].mlp.down_proj, RowParallelLinear)
        assert attn.num_heads == 8 // world_size and attn.num_kv_heads == 4 // world_size
        assert isinstance(model.lm_head, VocabParallelLMHead) == vocab_parallel
        with torch.no_grad():
            logits = model(ids, pos)
        llm = LLM(model, max_num_seqs=3, cpu_column_major=True)  # the layout LLM(path) uses on CPU
        outs = llm.generate(PROMPTS, greedy)
        samples = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sampled)]
        # fresh weights (as after a training step) loaded by slicing the full state dict
        new_model = load_hf(path)
        with torch.no_grad():
            for p in new_model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
            new_ref = new_model(ids, pos)
            load_full_state_dict(model, new_model.state_dict(), group)
            new_logits = model(ids, pos)
        results[vocab_parallel] = dict(
            reload_diff=(new_logits - new_ref).abs().max().item(),
            logit_diff=(logits - ref_logits).abs().max().item(),
            same_greedy=[o.outputs[0].token_ids for o in outs] == ref_greedy,
            lp_diff=max(abs(a - b) for o, r in zip(outs, ref_lp) for a, b in zip(o.outputs[0].logprobs, r)),
            samples=samples,
        )
    return results


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    from test_rollout_engine import build_tiny

    path = tmp_path_factory.mktemp("tp") / "llama"
    # 8 query / 4 kv heads divide by 4; attention_bias + mlp_bias exercise column and row biases;
    # tied embeddings: the vocab-parallel head slices the embedding matrix, which stays whole
    build_tiny("llama", path, heads=8, kv_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    return str(path)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_tp1(tp_model_dir, world):
    results = spawn_ranks(_tp_rank, world, tp_model_dir, timeout_s=240)
    for rank, res in enumerate(results):
        for vp, r in res.items():
            assert r["logit_diff"] < 1e-4, (rank, vp, r["logit_diff"])
            assert r["reload_diff"] < 1e-4, (rank, vp, r["reload_diff"])
            assert r["same_greedy"], (rank, vp)
            assert r["lp_diff"] < 1e-4, (rank, vp)
            assert r["samples"] == results[0][vp]["samples"]  # every rank draws the same tokens


def test_slicing_rule():
    assert tp_shard_dim("model.layers.3.self_attn.q_proj.weight") == 0
    assert tp_shard_dim("model.layers.3.self_attn.k_proj.bias") == 0
    assert tp_shard_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert tp_shard_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert tp_shard_dim("model.layers.3.self_attn.o_proj.bias") is None
    assert tp_shard_dim("model.layers.3.mlp.down_proj.weight") == 1
    assert tp_shard_dim("lm_head.weight") == 0 and tp_shard_dim("lm_head.weight", vocab_parallel=False) is None
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "value_head.weight"):
        assert tp_shard_dim(name) is None, name
    w = torch.arange(24.0).view(4, 6)
    parts = [shard_tensor(w, 1, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts, 1), w) and parts[1].tolist() == [[2, 3], [8, 9], [14, 15], [20, 21]]
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(w, 0, 0, 3)
