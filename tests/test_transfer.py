"""The weight sync to a standalone rollout, planned (``minihf.hybrid.transfer``): executed in
memory on full tensors sharded as FSDP shards them, every rollout rank's engine parameters
equal its TP slices exactly, every element is written once, and the bytes a rollout rank
receives are its slice's, whatever the training and rollout sizes (uneven FSDP shards,
dim-1 shards, a tied vocab-parallel LM head, several replicas)."""

import pytest
import torch

from minihf.hybrid.plan import EMBED, LM_HEAD
from minihf.hybrid.transfer import _view, plan_transfer, received_bytes, sent_bytes
from minihf.parallel.placement import chunk_rows, fsdp_dim, tp_dim

SHAPES = {EMBED: (50, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
          "model.layers.0.self_attn.k_proj.weight": (4, 8),
          "model.layers.0.self_attn.o_proj.weight": (8, 8),
          "model.layers.0.mlp.down_proj.weight": (8, 12),   # dim 1 of 12: FSDP dim 1 only when it divides
          "model.layers.0.input_layernorm.weight": (8,), "model.norm.weight": (8,)}


def fsdp_shards(full, world):
    """Each training rank's local shard, as FSDP2 holds it (torch.chunk on the FSDP dim)."""
    out = []
    for i in range(world):
        shard = {}
        for n, t in full.items():
            d = fsdp_dim(n, t.shape, world)
            c = chunk_rows(t.shape[d], world)
            shard[n] = t.narrow(d, min(i * c, t.shape[d]), max(0, min(c, t.shape[d] - i * c)))
        out.append(shard)
    return out


def expected_slice(full, name, shape, tp, j):
    d = tp_dim(name, shape, tp) if tp > 1 else None
    return full if d is None else full.narrow(d, j * shape[d] // tp, shape[d] // tp)


# (training ranks, rollout ranks, rollout TP size, tied LM head); 5 ranks shard the
# row-parallel down_proj (dim 1 of 12) on dim 0, across its TP dim
@pytest.mark.parametrize("world,rollout,tp,tied", [(2, 1, 1, False), (3, 2, 2, True), (2, 4, 2, True),
                                                   (4, 3, 1, False), (1, 2, 2, False), (5, 2, 2, False)])
def test_plan_fills_each_slice_exactly_once(world, rollout, tp, tied):
    torch.manual_seed(0)
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    train_ranks = list(range(world))
    rollout_ranks = list(range(world, world + rollout))
    d = len(rollout_ranks) // tp
    tp_ranks = {r: i // d for i, r in enumerate(rollout_ranks)}  # strided: TP outermost
    rounds = plan_transfer(SHAPES, train_ranks, tp_ranks, tp, tied_lm_head=tied, bucket_bytes=64)
    assert all(len({(m.src, m.dst) for m in r}) == len(r) for r in rounds)  # one message a pair a round
    shards = fsdp_shards(full, world)
    targets = {n: [(n, tp_dim(n, s, tp) if tp > 1 else None)] for n, s in SHAPES.items()}
    if tied and tp > 1:
        targets[EMBED].append((LM_HEAD, 0))
    for dst, j in tp_ranks.items():
        dest, hits = {}, {}
        for n, s in SHAPES.items():
            for target, _ in targets[n]:
                want = expected_slice(full[n], n, s, tp, j) if target == n else full[n].narrow(
                    0, j * s[0] // tp, s[0] // tp)
                dest[target] = torch.full_like(want, float("nan"))
                hits[target] = torch.zeros_like(want)
        for messages in rounds:
            for m in messages:
                if m.dst != dst:
                    continue
                for p in m.pieces:
                    src = _view(shards[train_ranks.index(m.src)][p.name], p.box, p.src_origin)
                    _view(dest[p.target], p.box, p.dst_origin).copy_(src)
                    _view(hits[p.target], p.box, p.dst_origin).add_(1)
        for n, s in SHAPES.items():
            for target, _ in targets[n]:
                want = expected_slice(full[n], n, s, tp, j) if target == n else full[n].narrow(
                    0, j * s[0] // tp, s[0] // tp)
                assert torch.equal(dest[target], want), (dst, target)
                assert torch.all(hits[target] == 1), (dst, target)
        assert received_bytes(rounds, dst, 4) == 4 * sum(h.numel() for h in hits.values())
    total = sum(sent_bytes(rounds, r, 4) for r in train_ranks)
    assert total == sum(received_bytes(rounds, r, 4) for r in tp_ranks)
