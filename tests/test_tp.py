"""Tensor parallelism: TP=2 and TP=4 (gloo, spawned ranks) vs the unsharded model in the same
process: logits allclose and greedy generations identical; plus the pure slicing and head rules.

Llama (biases, tied vocab-parallel head) runs at TP 2 and 4 with every check; Qwen3 (q/k
RMSNorm per head, replicated) runs at TP 2 with the vocab-parallel head only, to keep the
suite fast. Tolerances are ~10x the largest difference measured (fp32 on CPU; only the
summation order differs): logits 6.7e-6 (llama TP=4; |logits| up to ~6) -> 6e-5, log-probs
4.1e-6 (qwen3 TP=2) -> 4e-5. Print the figures with ``pytest tests/test_tp.py -s``."""

import pytest
import torch

from minihf.parallel.placement import tp_dim
from minihf.parallel.tp import shard_tensor
from minihf.testing import spawn_ranks

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [5, 6, 7]]


def _tp_rank(rank, world_size, cases):
    """Per model dir in ``cases`` ([(name, path, full)]), TP vs unsharded figures on this rank."""
    import torch.distributed as dist

    from minihf.models import ModelArgs, build_model
    from minihf.parallel.tp import apply_tp

    out = {name: _tp_case(rank, world_size, path, full) for name, path, full in cases}
    if world_size == 4:  # 2 KV heads cannot split over 4 ranks: a clear error, model untouched
        model = build_model(ModelArgs(arch="qwen3", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      intermediate_size=64), device="meta")
        try:
            apply_tp(model, dist.group.WORLD)
            out["kv_error"] = None
        except ValueError as e:
            out["kv_error"] = str(e)
        out["kv_untouched"] = model.model.layers[0].self_attn.num_kv_heads == 2
    return out


def _tp_case(rank, world_size, path, full):
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
    ref_outs = ref.generate(PROMPTS, greedy)
    ref_greedy = [o.outputs[0].token_ids for o in ref_outs]
    ref_lp = [o.outputs[0].logprobs for o in ref_outs]
    results = {}
    for vocab_parallel in (True,):  # a replicated head (odd vocab): tests/test_reshard.py
        model = apply_tp(load_hf(path), group)
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(model.model.layers[0].mlp.down_proj, RowParallelLinear)
        assert attn.num_heads == 8 // world_size and attn.num_kv_heads == 4 // world_size
        assert isinstance(model.lm_head, VocabParallelLMHead) == vocab_parallel
        with torch.no_grad():
            logits = model(ids, pos)
        llm = LLM(model, max_num_seqs=3, cpu_column_major=True)  # the layout LLM(path) uses on CPU
        outs = llm.generate(PROMPTS, greedy)
        samples = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sampled)] if full else None
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
def tp_model_dirs(tmp_path_factory):
    from test_rollout_engine import build_tiny

    root = tmp_path_factory.mktemp("tp")
    # 8 query / 4 kv heads divide by 4; attention_bias + mlp_bias exercise column and row biases;
    # tied embeddings: the vocab-parallel head slices the embedding matrix, which stays whole
    build_tiny("llama", root / "llama", heads=8, kv_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    build_tiny("qwen3", root / "qwen3", heads=8, kv_heads=4)  # q_norm/k_norm act per head
    return {arch: str(root / arch) for arch in ("llama", "qwen3")}


LOGIT_TOL, LP_TOL = 6e-5, 4e-5  # ~10x the measured maxima (see module docstring)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_tp1(tp_model_dirs, world):
    cases = [("llama", tp_model_dirs["llama"], True)] + ([("qwen3", tp_model_dirs["qwen3"], False)] if world == 2 else [])
    results = spawn_ranks(_tp_rank, world, cases, timeout_s=240)
    worst = {}
    for rank, res in enumerate(results):
        for name, _, _ in cases:
            for vp, r in res[name].items():
                assert r["logit_diff"] < LOGIT_TOL, (name, rank, vp, r["logit_diff"])
                assert r["reload_diff"] < LOGIT_TOL, (name, rank, vp, r["reload_diff"])
                assert r["same_greedy"], (name, rank, vp)
                assert r["lp_diff"] < LP_TOL, (name, rank, vp, r["lp_diff"])
                assert r["samples"] == results[0][name][vp]["samples"]  # every rank draws the same tokens
                for k in ("logit_diff", "reload_diff", "lp_diff"):
                    worst[name, k] = max(worst.get((name, k), 0.0), r[k])
        if world == 4:
            assert res["kv_untouched"]
            assert res["kv_error"] and "num_heads=4 and num_kv_heads=2" in res["kv_error"], res["kv_error"]
            assert "TP size 4" in res["kv_error"] and "[1, 2]" in res["kv_error"], res["kv_error"]
    print(f"TP={world} max diffs: " + ", ".join(f"{n} {k} {v:.1e}" for (n, k), v in sorted(worst.items())))


def test_head_count_rule():
    from minihf.parallel.tp import tp_head_counts

    assert tp_head_counts(8, 4, 2) == (4, 2) and tp_head_counts(8, 2, 2) == (4, 1) and tp_head_counts(4, 4, 1) == (4, 4)
    with pytest.raises(ValueError, match=r"layers.0.self_attn: num_heads=16 and num_kv_heads=2 .* TP size 4 .*\[1, 2\]"):
        tp_head_counts(16, 2, 4, "layers.0.self_attn")
    with pytest.raises(ValueError, match="num_heads=6 and num_kv_heads=6.*TP size 4.*\\[1, 2, 3, 6\\]"):
        tp_head_counts(6, 6, 4)


def test_slicing_rule():
    assert tp_dim("model.layers.3.self_attn.q_proj.weight", (8, 8), 2) == 0
    assert tp_dim("model.layers.3.self_attn.k_proj.bias", (8, 8), 2) == 0
    assert tp_dim("model.layers.3.mlp.up_proj.weight", (8, 8), 2) == 0
    assert tp_dim("model.layers.3.self_attn.o_proj.weight", (8, 8), 2) == 1
    assert tp_dim("model.layers.3.self_attn.o_proj.bias", (8, 8), 2) is None
    assert tp_dim("model.layers.3.mlp.down_proj.weight", (8, 8), 2) == 1
    assert tp_dim("lm_head.weight", (64, 8), 2) == 0 and tp_dim("lm_head.weight", (65, 8), 2) is None
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "value_head.weight"):
        assert tp_dim(name, (8, 8), 2) is None, name
    w = torch.arange(24.0).view(4, 6)
    parts = [shard_tensor(w, 1, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts, 1), w) and parts[1].tolist() == [[2, 3], [8, 9], [14, 15], [20, 21]]
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(w, 0, 0, 3)
