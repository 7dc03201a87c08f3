"""Tensor parallelism for the Llama-family decoder, applied after construction (Megatron style).

``apply_tp(model, tp_group)`` rewrites a full (unsharded) model in place, keeping this rank's
slice of every weight:

* q/k/v/gate/up projections -> :class:`ColumnParallelLinear` (weight and bias split on dim 0;
  each rank computes its own heads / intermediate features, no communication);
* o/down projections -> :class:`RowParallelLinear` (weight split on dim 1; partial outputs
  are summed with one explicit all-reduce; the bias is added once, after the reduction);
* attention modules' ``num_heads`` / ``num_kv_heads`` are divided by the TP size (the model
  reads its head counts from these attributes, so its reshapes follow);
* ``lm_head`` -> :class:`VocabParallelLMHead` (rows split on dim 0, logits all-gathered) when
  the vocabulary divides evenly, else left replicated; the embedding stays replicated.

The slicing rule is the pure function :func:`tp_shard_dim` of a parameter's name, shared
with the resharding code. Parameter names are unchanged (``...q_proj.weight``), so a TP
model's state dict holds shards under the HF keys. The layers are for inference (rollout):
the collectives are not autograd-aware. The same code runs on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("lm_head",)


def tp_shard_dim(name: str, vocab_parallel: bool = True) -> int | None:
    """Dim along which TP shards the parameter called ``name`` (HF key), or None if replicated.

    >>> tp_shard_dim("model.layers.0.self_attn.q_proj.bias"), tp_shard_dim("model.layers.0.mlp.down_proj.weight")
    (0, 1)
    """
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1 if leaf == "weight" else None  # row-parallel bias is added once, replicated
    if module in VOCAB_PARALLEL and vocab_parallel and leaf == "weight":
        return 0
    return None


def shard_tensor(t: torch.Tensor, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of ``t`` along ``dim`` (a copy); ``t`` itself if dim is None."""
    if dim is None or world_size == 1:
        return t
    size = t.shape[dim]
    if size % world_size:
        raise ValueError(
            f"cannot shard a tensor of shape {tuple(t.shape)} on dim {dim} over {world_size} TP ranks: "
            f"{size} is not divisible by {world_size}; choose a TP size that divides it"
        )
    step = size // world_size
    return t.narrow(dim, rank * step, step).clone()


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local^T + b_local``: this rank's output features; input replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: input split on features, output replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelLMHead(nn.Module):
    """Each rank scores its slice of the vocabulary; logits are all-gathered to full width."""

    def __init__(self, weight: torch.Tensor, group, world_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def tp_head_counts(num_heads: int, num_kv_heads: int, tp_size: int, where: str = "attention") -> tuple[int, int]:
    """Per-rank (query heads, KV heads) when ``tp_size`` ranks split the heads.

    Both counts must divide by ``tp_size``: KV heads are split, never replicated (as vLLM does
    when ``num_kv_heads < tp_size``), so e.g. 2 KV heads allow TP 1 or 2 only.

    >>> tp_head_counts(8, 4, 2)
    (4, 2)
    """
    if num_heads % tp_size or num_kv_heads % tp_size:
        ok = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0 and num_heads % d == 0]
        raise ValueError(
            f"{where}: num_heads={num_heads} and num_kv_heads={num_kv_heads} must both divide by the "
            f"TP size {tp_size} (KV-head replication is not implemented); use a TP size in {ok}"
        )
    return num_heads // tp_size, num_kv_heads // tp_size


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)


def apply_tp(model: nn.Module, tp_group=None, vocab_parallel: bool | None = None) -> nn.Module:
    """Shard ``model`` (holding full weights) in place over ``tp_group``; returns it.

    ``tp_group`` None or of size 1 leaves the model untouched. ``vocab_parallel`` None means
    "when the vocabulary size divides by the TP size". Raises ValueError naming the module
    when a head count or feature size does not divide by the TP size.
    """
    world = dist.get_world_size(tp_group) if tp_group is not None or dist.is_initialized() else 1
    if tp_group is None or world == 1:
        return model
    rank = dist.get_rank(tp_group)
    attns = [(n, m) for n, m in model.named_modules() if hasattr(m, "num_heads") and hasattr(m, "num_kv_heads")]
    local = [tp_head_counts(m.num_heads, m.num_kv_heads, world, n) for n, m in attns]  # all checked first
    for (_, module), (heads, kv_heads) in zip(attns, local):
        module.num_heads, module.num_kv_heads = heads, kv_heads
    lm_head = getattr(model, "lm_head", None)
    if vocab_parallel is None:
        vocab_parallel = isinstance(lm_head, nn.Linear) and lm_head.out_features % world == 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        wdim = tp_shard_dim(f"{name}.weight", vocab_parallel)
        if wdim is None:
            continue
        bias = module.bias.detach() if module.bias is not None else None
        leaf = name.rpartition(".")[2]
        try:
            weight = shard_tensor(module.weight.detach(), wdim, rank, world)
            if leaf in COLUMN_PARALLEL:
                new = ColumnParallelLinear(weight, shard_tensor(bias, 0, rank, world) if bias is not None else None)
            elif leaf in ROW_PARALLEL:
                new = RowParallelLinear(weight, bias, tp_group)
            else:
                new = VocabParallelLMHead(weight, tp_group, world)
        except ValueError as e:
            raise ValueError(f"apply_tp: {name}: {e}") from None
        _set_submodule(model, name, new)
    return model


def is_vocab_parallel(model: nn.Module) -> bool:
    """Whether ``apply_tp`` made this model's LM head vocab-parallel."""
    return isinstance(getattr(model, "lm_head", None), VocabParallelLMHead)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], tp_group=None) -> None:
    """Copy full (unsharded) tensors ``state`` (HF keys) into a TP-sharded ``model``, slicing
    each by :func:`tp_shard_dim` (e.g. fresh actor weights into the rollout engine's copy).

    A tied checkpoint may omit ``lm_head.weight``; the embedding is used for it then.
    Raises KeyError naming the parameters ``state`` lacks.
    """
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_parallel = is_vocab_parallel(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in state and not (n == "lm_head.weight" and "model.embed_tokens.weight" in state)]
    if missing:
        raise KeyError(f"load_full_state_dict: state lacks {missing[:8]}{'...' if len(missing) > 8 else ''}")
    for name, p in params.items():
        full = state.get(name, state.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        p.copy_(shard_tensor(full, tp_shard_dim(name, vocab_parallel), rank, world).to(p.dtype))
