"""Executing a reshard plan: FSDP2 shards -> the rollout engine's TP shards, in place.

For each bucket of ``plan.plan_reshard``: concatenate this rank's (padded, cast) FSDP
shards into one flat buffer, all-gather it over the bucket's ranks (the gather group or
all N), and write each tensor's part into the engine's parameters: a ``gather`` tensor's
gathered rows are its TP slice; an ``all`` tensor is whole and each target takes its TP
slice. A bucket of one dim-0 ``gather`` tensor whose engine parameter is contiguous is
gathered straight into that parameter (no buffer: the common case on GPU for the large
q/k/v/gate/up/lm_head weights). Peak extra memory is one bucket's gathered buffer.

The FSDP model must be resharded (every parameter a DTensor shard) before this runs:
``minihf.parallel.fsdp.reshard`` after a no-grad forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minihf.hybrid.plan import Bucket, TensorPlan

# torch >= 2.12 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This rank's FSDP shard of ``p`` (a DTensor), or ``p`` itself when it is not sharded."""
    return p.to_local() if hasattr(p, "to_local") else p


def _padded(shard: torch.Tensor, t: TensorPlan, dtype: torch.dtype) -> torch.Tensor:
    """The shard cast to ``dtype`` and zero-padded to ``t.local_shape`` (uneven last shards)."""
    shard = shard.detach().to(dtype)
    rows = shard.shape[t.fsdp_dim]
    if rows == t.chunk:
        return shard
    out = shard.new_zeros(t.local_shape)
    out.narrow(t.fsdp_dim, 0, rows).copy_(shard)
    return out


def _assemble(piece: torch.Tensor, t: TensorPlan, g: int) -> torch.Tensor:
    """``piece`` [g * local_numel] (the group's shards in rank order) -> the tensor they form
    along the FSDP dim (a view when the dim is 0)."""
    parts = piece.view(g, *t.local_shape)
    if t.fsdp_dim == 0:
        return parts.view(g * t.chunk, *t.local_shape[1:])
    return torch.cat(list(parts.unbind(0)), dim=t.fsdp_dim)


def _write(t: TensorPlan, whole: torch.Tensor, dest: dict[str, torch.Tensor], tp_rank: int,
           tp: int) -> None:
    if t.over == "gather":  # the rows gathered are this rank's TP slice (t == 1: the tensor)
        dest[t.name].copy_(whole.narrow(t.fsdp_dim, 0, t.shape[t.fsdp_dim] // tp))
        return
    whole = whole.narrow(t.fsdp_dim, 0, t.shape[t.fsdp_dim])
    for name, dim in t.targets:
        if dim is None:
            dest[name].copy_(whole)
        else:
            size = t.shape[dim] // tp
            dest[name].copy_(whole.narrow(dim, tp_rank * size, size))


@torch.no_grad()
def reshard_into(fsdp_model: nn.Module, buckets: list[Bucket], dest: dict[str, torch.Tensor], *,
                 gather_group, all_group, tp_rank: int, tp: int, dtype: torch.dtype
                 ) -> dict[str, int]:
    """Fill the engine's parameters ``dest`` (name -> tensor) from ``fsdp_model``'s shards.

    ``gather_group``: this rank's N/t ranks sharing its TP rank (the rollout layout's DP
    group); ``all_group``: the role's N ranks. Returns what this rank did: ``collectives``,
    ``bytes_received`` (from the other ranks of each all-gather) and ``peak_buffer`` (bytes
    of the largest temporary buffer).
    """
    params = dict(fsdp_model.named_parameters())
    groups = {"gather": gather_group, "all": all_group}
    peak = received = calls = 0
    for bucket in buckets:
        group = groups[bucket.over]
        g = dist.get_world_size(group) if group is not None else 1
        shards = [_padded(local_shard(params[t.name]), t, dtype) for t in bucket.tensors]
        if g > 1:
            calls += 1
            received += (g - 1) * sum(s.numel() for s in shards) * shards[0].element_size()
        if g == 1:  # this rank's shards are the whole group's: nothing to gather
            for t, shard in zip(bucket.tensors, shards):
                _write(t, shard, dest, tp_rank, tp)
            continue
        if len(bucket.tensors) == 1:
            t = bucket.tensors[0]
            target = dest[t.name]
            if (t.over == "gather" and t.fsdp_dim == 0 and target.is_contiguous()
                    and target.numel() == g * t.local_numel and target.dtype == dtype):
                _all_gather(target.view(-1), shards[0].reshape(-1), group=group)  # in place
                continue
        flat = torch.cat([s.reshape(-1) for s in shards])
        out = flat.new_empty(g * flat.numel())
        _all_gather(out, flat, group=group)
        peak = max(peak, (out.numel() + flat.numel()) * out.element_size())
        out = out.view(g, -1)
        offset = 0
        for t in bucket.tensors:
            piece = out[:, offset:offset + t.local_numel].reshape(-1)
            offset += t.local_numel
            _write(t, _assemble(piece, t, g), dest, tp_rank, tp)
    return {"collectives": calls, "bytes_received": received, "peak_buffer": peak}


def rollout_groups(tp: int, timeout=None):
    """``(gather_group, tp_group, tp_rank)`` of this rank in the strided rollout layout over
    the whole default group, for code that runs outside the controller (tests, benchmarks;
    the controller makes these groups itself at launch). Every rank must call it."""
    from minihf.controller.layout import RoleLayout

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = RoleLayout("actor", tuple(range(world)), tp, tp_strided=True, name="rollout")
    kw = {} if timeout is None else {"timeout": timeout}
    mine = {}
    for kind, groups in (("tp", layout.tp_groups()), ("gather", layout.dp_groups())):
        for ranks in groups:
            g = dist.new_group(list(ranks), **kw) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = g
    return mine["gather"], mine["tp"], layout.tp_rank(rank)
