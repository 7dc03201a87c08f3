"""Tensor parallelism for the Llama-family decoder, applied after construction (Megatron style).

Two steps (CONTRIBUTING.md, rule 2: the engine's model is built on the meta device, then filled):

* :func:`tp_rewrite` rewrites the module structure in place for one TP rank, on whatever
  device the model is (``meta`` included): q/k/v/gate/up -> :class:`ColumnParallelLinear`
  (weight and bias split on dim 0, no communication), o/down -> :class:`RowParallelLinear`
  (weight split on dim 1; partial outputs summed with one all-reduce; bias added once),
  ``lm_head`` -> :class:`VocabParallelLMHead` (logits all-gathered) when the vocabulary
  divides, attention ``num_heads``/``num_kv_heads`` divided. New parameters are allocated
  with their local shapes and not initialised.
* loaders fill the local shards: :func:`load_full_state_dict` slices full tensors;
  ``minihf.reshard`` writes gathered FSDP shards straight in.

:func:`apply_tp` does both for a model that holds full weights. What is sliced where is
``minihf.parallel.placement`` (shared with FSDP and the reshard planner). Parameter names
are unchanged (``...q_proj.weight``), so a TP model's state dict holds shards under the HF
keys. The layers are for inference (rollout): the collectives are not autograd-aware. The
same code runs on gloo (CPU) and NCCL (CUDA).

A LoRA layer (``minihf.models.lora``) keeps its adapter unmerged under TP: the column and
row layers then hold this rank's ``lora_A``/``lora_B`` slices (``placement``) and add
``(x A^T) B^T * scaling`` to their local product, before the row layer's all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minihf.models.linear import linear
from minihf.models.lora import lora_delta
from minihf.parallel.placement import COLUMN_PARALLEL, ROW_PARALLEL, tp_dim


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


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return nn.Parameter(t, requires_grad=False) if t is not None else None


class _Adapted(nn.Module):
    """A TP layer's optional LoRA adapter (this rank's slices) and its term."""

    def _set_lora(self, lora: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        self.lora_A = self.lora_B = None  # instance attributes: a class one would shadow the parameters
        if lora is not None:
            self.lora_A, self.lora_B = _frozen(lora[0]), _frozen(lora[1])
            self.scaling = lora[2]

    def _plus_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.lora_A is None:
            return y
        return y + lora_delta(x, self.lora_A, self.lora_B, self.scaling)


class ColumnParallelLinear(_Adapted):
    """``y_local = x @ W_local^T + b_local``: this rank's output features; input replicated.
    ``lora``: (A [r, in], B_local [out/t, r], scaling)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lora=None):
        super().__init__()
        self.weight, self.bias = _frozen(weight), _frozen(bias)
        self._set_lora(lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._plus_lora(linear(x, self.weight, self.bias), x)


class RowParallelLinear(_Adapted):
    """``y = all_reduce(x_local @ W_local^T) + b``: input split on features, output replicated.
    ``lora``: (A_local [r, in/t], B [out, r], scaling); each rank's adapter term is a partial
    sum too (``x A^T = sum of x_local A_local^T``), reduced with the product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, lora=None):
        super().__init__()
        self.weight, self.bias = _frozen(weight), _frozen(bias)
        self.group = group
        self._set_lora(lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._plus_lora(linear(x, self.weight), x)
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
        local = linear(x, self.weight).contiguous()
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


def _group_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def local_shape(name: str, shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """Shape of this rank's shard of parameter ``name`` (full ``shape``) at TP ``tp_size``."""
    dim = tp_dim(name, shape, tp_size)
    if dim is None or tp_size == 1:
        return tuple(shape)
    if shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(shape)} does not divide by the TP "
                         f"size {tp_size}; choose a TP size that divides it")
    return tuple(s // tp_size if d == dim else s for d, s in enumerate(shape))


def tp_rewrite(model: nn.Module, tp_group) -> nn.Module:
    """Rewrite ``model``'s modules in place for this rank of ``tp_group`` (structure only:
    sharded parameters are new, uninitialised, with local shapes, on the model's device,
    which may be ``meta``). Returns ``model``. Head counts are checked before anything
    changes; ``tp_group`` None or of size 1 leaves the model untouched."""
    world, _ = _group_size_rank(tp_group)
    if world == 1:
        return model
    attns = [(n, m) for n, m in model.named_modules() if hasattr(m, "num_heads") and hasattr(m, "num_kv_heads")]
    local = [tp_head_counts(m.num_heads, m.num_kv_heads, world, n) for n, m in attns]  # all checked first
    for (_, module), (heads, kv_heads) in zip(attns, local):
        module.num_heads, module.num_kv_heads = heads, kv_heads
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        wdim = tp_dim(f"{name}.weight", tuple(w.shape), world)
        if wdim is None:
            continue
        leaf = name.rpartition(".")[2]

        def empty(pname: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            try:
                shape = local_shape(pname, tuple(t.shape), world)
            except ValueError as e:
                raise ValueError(f"tp_rewrite: {e}") from None
            return torch.empty(shape, dtype=t.dtype, device=t.device)

        weight = empty(f"{name}.weight", w)
        lora = None
        if getattr(module, "lora_A", None) is not None:  # a LoRA layer: its adapter's slices
            lora = (empty(f"{name}.lora_A", module.lora_A), empty(f"{name}.lora_B", module.lora_B),
                    module.scaling)
        if leaf in COLUMN_PARALLEL:
            new = ColumnParallelLinear(weight, empty(f"{name}.bias", module.bias), lora)
        elif leaf in ROW_PARALLEL:
            bias = module.bias
            new = RowParallelLinear(weight, None if bias is None else torch.empty_like(bias), tp_group, lora)
        else:
            new = VocabParallelLMHead(weight, tp_group, world)
        _set_submodule(model, name, new)
    return model


def apply_tp(model: nn.Module, tp_group=None) -> nn.Module:
    """Shard ``model`` (holding full weights) in place over ``tp_group``; returns it.

    :func:`tp_rewrite`, then :func:`load_full_state_dict` from the weights it held.
    ``tp_group`` None or of size 1 leaves the model untouched. Raises ValueError naming the
    module when a head count or feature size does not divide by the TP size.
    """
    world, _ = _group_size_rank(tp_group)
    if world == 1:
        return model
    full = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    tp_rewrite(model, tp_group)
    load_full_state_dict(model, full, tp_group)
    return model


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], tp_group=None) -> None:
    """Copy full (unsharded) tensors ``state`` (HF keys) into a TP-sharded ``model``, slicing
    each by ``placement.tp_dim``.

    A tied checkpoint may omit ``lm_head.weight``; the embedding is used for it then.
    Raises KeyError naming the parameters ``state`` lacks.
    """
    world, rank = _group_size_rank(tp_group)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in state and not (n == "lm_head.weight" and "model.embed_tokens.weight" in state)]
    if missing:
        raise KeyError(f"load_full_state_dict: state lacks {missing[:8]}{'...' if len(missing) > 8 else ''}")
    for name, p in params.items():
        full = state.get(name, state.get("model.embed_tokens.weight") if name == "lm_head.weight" else None)
        dim = tp_dim(name, tuple(full.shape), world)
        p.copy_(shard_tensor(full, dim, rank, world).to(p.dtype))
