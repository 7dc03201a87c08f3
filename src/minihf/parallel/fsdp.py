"""FSDP2 for minihf models: ``fully_shard`` each decoder block, then the root.

``wrap_blocks=False`` shards the root only: the whole model is one FSDP unit, gathered
with one all-gather per forward and reduced with one reduce-scatter per backward instead
of one per block. A block's gather can no longer overlap the previous block's compute and
the whole model is unsharded at once, which suits small models, where a step is made of
collectives' latency more than of their bytes (the 0.9M main-job model on 2 CPU ranks:
an optimizer step 165 -> 129 ms, medians measured in one process alternating the two).

Shard placement follows the weight's tensor-parallel role so that the resharding engine
(training FSDP layout -> generation TP layout) can gather a TP shard from a small group:
column-parallel weights (q/k/v, gate/up, lm_head) are sharded on dim 0 and row-parallel
weights (o_proj, down_proj) on dim 1; the rule is ``minihf.parallel.placement.fsdp_dim``,
the same table ``apply_tp`` and the reshard planner read.

Mixed precision: bf16 parameters for compute with fp32 gradient reduction on CUDA; plain
fp32 on CPU (bf16 matmul is orders of magnitude slower on most CPUs). The sharded master
weights and optimizer state stay fp32 in both cases.

Activation checkpointing wraps each block's ``forward`` (instance attribute, so parameter
names and state-dict keys stay HF's) with non-reentrant ``torch.utils.checkpoint``; FSDP's
pre-backward hook unshards the block before the recomputation runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from minihf.parallel.placement import chunk_rows, fsdp_dim


def default_mixed_precision(device_type: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)``: (bf16, fp32) on CUDA, (None, None) = fp32 elsewhere."""
    if device_type == "cuda":
        return torch.bfloat16, torch.float32
    return None, None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``model.model.layers``) that get their own FSDP unit."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `model.layers` ModuleList; apply_fsdp "
                        "expects minihf's HF-style layout (model.model.layers[i])")
    return list(layers)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    for block in decoder_blocks(model):
        if not isinstance(block.forward, functools.partial):
            block.forward = functools.partial(_checkpointed, block.forward)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, activation_checkpointing: bool = False,
               cpu_offload: bool = False, reshard_after_forward: bool = True,
               mixed_precision: str = "auto", wrap_blocks: bool = True) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``mesh`` and return it.

    ``mixed_precision="auto"`` picks :func:`default_mixed_precision` for the mesh's device
    (explicit ``param_dtype``/``reduce_dtype`` win); ``"none"`` keeps fp32 everywhere.
    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state on the host
    (pinned only when CUDA is present). Parameters and buffers move to the mesh's device.
    ``wrap_blocks``: one FSDP unit per decoder block (else the root only, see above).
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp expects a 1-D data-parallel mesh, got {mesh.ndim}-D {mesh}")
    if mixed_precision not in ("auto", "none"):
        raise ValueError(f"mixed_precision={mixed_precision!r}; use 'auto' or 'none'")
    if mixed_precision == "auto":
        auto_param, auto_reduce = default_mixed_precision(mesh.device_type)
        param_dtype = param_dtype or auto_param
        reduce_dtype = reduce_dtype or auto_reduce
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload
               else OffloadPolicy())
    world = mesh.size()
    names = {id(p): n for n, p in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        return Shard(fsdp_dim(names.get(id(param), ""), tuple(param.shape), world))

    if activation_checkpointing:
        enable_activation_checkpointing(model)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, shard_placement_fn=placement)
    blocks = decoder_blocks(model) if wrap_blocks else []
    for i, block in enumerate(blocks):
        # The last block is resharded right after forward only to be gathered again at
        # the start of backward; keeping it saves one all-gather (torchtitan does this).
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kw)
    # alone (wrap_blocks=False) the root is that last unit: kept gathered for backward too
    fully_shard(model, reshard_after_forward=reshard_after_forward and bool(blocks), **kw)
    return model


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter (e.g. the last block, kept unsharded after a no-grad
    forward), so all parameters are DTensor shards again, as resharding expects."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_mesh(group, device_type: str) -> DeviceMesh:
    """A 1-D mesh over an existing process group (a role's group from the controller)."""
    return DeviceMesh.from_group(group, device_type)


def local_range(param: DTensor) -> tuple[int, int, int]:
    """``(dim, start, end)``: the rows of the full tensor this rank's FSDP shard holds
    (FSDP2 chunks like ``torch.chunk``; a trailing rank may hold none)."""
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        raise TypeError(f"expected a Shard placement, got {placement}")
    dim, size = placement.dim, param.shape[placement.dim]
    rows = chunk_rows(size, param.device_mesh.size())
    start = min(param.device_mesh.get_local_rank() * rows, size)
    return dim, start, min(start + rows, size)


@torch.no_grad()
def load_sharded(model: nn.Module, reader, extra: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Fill ``model`` (built on meta, sharded by :func:`apply_fsdp` or not, then materialised
    with ``to_empty``) from ``reader`` (``minihf.models.CheckpointReader``): each rank reads
    only its own rows of each parameter from the files. ``extra``: full tensors for
    parameters the checkpoint does not hold (LoRA adapters), sliced alike. Returns ``model``."""
    extra = extra or {}
    params = dict(model.named_parameters())  # tied weights once
    reader.check({n: tuple(p.shape) for n, p in params.items() if n not in extra})

    def read(name: str, dim: int | None = None, start: int = 0, end: int | None = None):
        if name not in extra:
            return reader.read(name, dim, start, end)
        full = extra[name]
        return full if dim is None else full.narrow(dim, start, end - start)

    for name, p in params.items():
        if not isinstance(p, DTensor):
            p.copy_(read(name))
            continue
        dim, start, end = local_range(p)
        local = p.to_local()
        if local.shape[dim] != end - start:
            raise RuntimeError(f"{name}: FSDP holds {local.shape[dim]} rows on this rank, "
                               f"expected {end - start} (rows {start}:{end} of {p.shape[dim]})")
        if end > start:
            local.copy_(read(name, dim, start, end))
    return model
