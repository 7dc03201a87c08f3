"""The reshard plan (pure) and the strided rollout layout's arithmetic: no processes."""

import pytest

from minihf.controller.layout import RoleLayout
from minihf.hybrid.plan import plan_reshard, plan_tensor, traffic

# a 1-block Llama-style model: hidden 32, 4 heads x 8 (2 KV heads), intermediate 64, vocab 48
SHAPES = {
    "model.embed_tokens.weight": (48, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.layers.0.self_attn.v_proj.weight": (16, 32),
    "model.layers.0.self_attn.o_proj.weight": (32, 32),
    "model.layers.0.mlp.gate_proj.weight": (64, 32),
    "model.layers.0.mlp.up_proj.weight": (64, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 64),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.norm.weight": (32,),
    "lm_head.weight": (48, 32),
}


def by_name(buckets):
    return {t.name: (b.over, t) for b in buckets for t in b.tensors}


def test_strided_layout_arithmetic():
    # N = 4, t = 2: TP rank j on ranks 2j, 2j+1; a replica is {i, i + 2}
    lay = RoleLayout("actor", (0, 1, 2, 3), 2, tp_strided=True, name="rollout")
    assert [lay.tp_rank(i) for i in range(4)] == [0, 0, 1, 1]
    assert [lay.dp_rank(i) for i in range(4)] == [0, 1, 0, 1]
    assert lay.tp_groups() == [(0, 2), (1, 3)] and lay.dp_groups() == [(0, 1), (2, 3)]
    # N = 8 on global ranks 8..15, t = 4: gather groups of 2 contiguous ranks
    lay = RoleLayout("a", tuple(range(8, 16)), 4, tp_strided=True)
    assert lay.tp_groups() == [(8, 10, 12, 14), (9, 11, 13, 15)]
    assert lay.dp_groups() == [(8, 9), (10, 11), (12, 13), (14, 15)]
    assert lay.tp_group_ranks(5) == (9, 11, 13, 15) and lay.dp_group_ranks(5) == (12, 13)
    # the default (TP innermost) layout is unchanged
    lay = RoleLayout("a", (0, 1, 2, 3), 2)
    assert lay.tp_groups() == [(0, 1), (2, 3)] and lay.dp_groups() == [(0, 2), (1, 3)]
    for lay in (RoleLayout("a", tuple(range(6)), 3, True), RoleLayout("a", tuple(range(6)), 3)):
        for i in range(6):
            assert lay.role_rank(lay.dp_rank(i), lay.tp_rank(i)) == i


def test_plan_hybrid_gathers_tp_slices_in_groups():
    plan = by_name(plan_reshard(SHAPES, world=4, tp=2))
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "gate_proj.weight"):
        over, t = plan[f"model.layers.0.self_attn.{name}" if "proj" in name and "gate" not in name
                       else f"model.layers.0.mlp.{name}"]
        assert over == "gather" and t.fsdp_dim == 0, name
    over, t = plan["model.layers.0.mlp.down_proj.weight"]
    assert over == "gather" and t.fsdp_dim == 1 and t.chunk == 16 and t.local_shape == (32, 16)
    assert plan["lm_head.weight"][0] == "gather"  # 48 divides by 4
    for name in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        over, t = plan[name]
        assert over == "all" and t.targets == ((name, None),), name


def test_plan_fallbacks_and_modes():
    # vocab 50 over t=2 is vocab-parallel but does not divide by N=4: gathered whole, sliced
    shapes = dict(SHAPES, **{"lm_head.weight": (50, 32)})
    over, t = by_name(plan_reshard(shapes, 4, 2))["lm_head.weight"]
    assert over == "all" and t.targets == (("lm_head.weight", 0),) and t.chunk == 13
    # vocab 49 does not divide by t=2: a replicated head
    shapes = dict(SHAPES, **{"lm_head.weight": (49, 32)})
    assert by_name(plan_reshard(shapes, 4, 2))["lm_head.weight"][1].targets == (("lm_head.weight", None),)
    # a row-parallel weight FSDP had to shard on dim 0 (dim 1 = 30 does not divide by 4)
    t = plan_tensor("model.layers.0.mlp.down_proj.weight", (32, 30), 4, 2)
    assert t.over == "all" and t.fsdp_dim == 0 and t.targets == (("model.layers.0.mlp.down_proj.weight", 1),)
    # tied embeddings: the engine's vocab-parallel head is a slice of the gathered embedding
    t = plan_tensor("model.embed_tokens.weight", (48, 32), 4, 2, tied_lm_head=True)
    assert t.over == "all" and t.targets == (("model.embed_tokens.weight", None), ("lm_head.weight", 0))
    # t = 1: every tensor gathered whole over the N ranks
    assert {over for over, _ in by_name(plan_reshard(SHAPES, 4, 1)).values()} == {"gather"}
    # naive: everything whole, then sliced
    naive = by_name(plan_reshard(SHAPES, 4, 2, mode="naive"))
    assert {over for over, _ in naive.values()} == {"all"}
    assert naive["model.layers.0.mlp.down_proj.weight"][1].targets[0][1] == 1
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=3 must divide the actor's 4 ranks; use one of \[1, 2, 4\]"):
        plan_reshard(SHAPES, 4, 3)
    with pytest.raises(ValueError, match=r"rollout.reshard='fast'; choose one of \['hybrid', 'naive'\]"):
        plan_reshard(SHAPES, 4, 2, mode="fast")


def test_buckets_and_traffic_formula():
    # each bucket's gathered size stays under the limit unless one tensor alone is larger
    limit = 4096
    buckets = plan_reshard(SHAPES, 4, 2, bucket_bytes=limit)
    sizes = {"gather": 2, "all": 4}
    for b in buckets:
        assert len({t.over for t in b.tensors}) == 1
        assert len(b.tensors) == 1 or b.local_numel * sizes[b.over] * 4 <= limit
    assert sum(len(b.tensors) for b in buckets) == len(SHAPES)
    one = plan_reshard(SHAPES, 4, 2)  # default 32 MB: one bucket per group kind
    assert len(one) == 2 and traffic(one, 4, 2, 4)["collectives"] == 2
    # traffic per rank: sharded tensors (N/t - 1)/(N/t) x (their size / t); replicated
    # ones (N - 1)/N x their size
    numel = {n: s[0] * (s[1] if len(s) > 1 else 1) for n, s in SHAPES.items()}
    replicated = sum(numel[n] for n in ("model.embed_tokens.weight", "model.norm.weight",
                                        "model.layers.0.input_layernorm.weight"))
    sharded = sum(numel.values()) - replicated
    expect = 4 * ((2 - 1) / 2 * sharded / 2 + (4 - 1) / 4 * replicated)
    assert traffic(one, 4, 2, 4)["bytes_received"] == expect
    naive = plan_reshard(SHAPES, 4, 2, mode="naive")
    assert traffic(naive, 4, 2, 4)["bytes_received"] == 4 * 3 / 4 * sum(numel.values())
