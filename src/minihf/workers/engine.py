"""What every FSDP role worker does the same way: build a sharded model, run inference
over micro-batches. Training (optimizer, updates, checkpoints) is ``train_state.TrainState``.

Role files (``actor.py``, ``critic.py``, ``reward_model.py``, ``sft_worker.py``) only say
which model, which loss and which outputs. Build order (STYLE rule 2): the model is
constructed on the meta device, sharded with ``apply_fsdp``, materialised, and each rank
reads only its own rows of every parameter from the safetensors files
(``minihf.parallel.fsdp.load_sharded``), so host memory does not grow with the rank count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from minihf.models import CheckpointReader, build_model, load_hf, materialize
from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh, load_sharded, reshard
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.packing import response_prompt_groups
from minihf.workers.train_step import plan_micro_batches, take_rows


def build_fsdp_model(model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, *, head: str, group,
                     device: torch.device, trainable: bool = True) -> nn.Module:
    """``model_cfg.path`` with ``head``, sharded over ``group``'s ranks (meta -> FSDP ->
    materialise -> this rank's rows). ``group`` None: one process, the whole model."""
    if not model_cfg.path:
        raise ValueError("model.path is empty; set it to an HF checkpoint dir (e.g. one "
                         "written by `minihf init-model`)")
    if group is None:
        return load_hf(model_cfg.path, dtype=torch.float32, device=device,
                       head=head).requires_grad_(trainable)
    reader = CheckpointReader(model_cfg.path, head)
    model = build_model(reader.args, head, device="meta", dtype=torch.float32)
    model.requires_grad_(trainable)
    shard_model(model, fsdp_cfg, group=group, device=device, trainable=trainable)
    materialize(model, "cpu" if fsdp_cfg.param_offload else device)  # offload: shards on the host
    return load_sharded(model, reader)


def shard_model(model: nn.Module, fsdp_cfg: FSDPConfig, *, group, device: torch.device,
                trainable: bool = True) -> nn.Module:
    """``apply_fsdp`` with a role's FSDP section (activation checkpointing only if trained)."""
    return apply_fsdp(model, fsdp_mesh(group, device.type),
                      activation_checkpointing=fsdp_cfg.activation_checkpointing and trainable,
                      cpu_offload=fsdp_cfg.param_offload,
                      mixed_precision=fsdp_cfg.mixed_precision,
                      reshard_after_forward=fsdp_cfg.reshard_after_forward,
                      wrap_blocks=fsdp_cfg.wrap_blocks)


def tensors_of(batch, keys: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The named tensors of a Batch, on ``device``; a clear error lists missing keys."""
    missing = [k for k in keys if k not in batch.tensors]
    if missing:
        raise KeyError(f"Batch lacks {missing} (has {sorted(batch.tensors)}); the driver must "
                       "add them before this call")
    return {k: batch.tensors[k].to(device) for k in keys}


@torch.no_grad()
def run_micro_batches(data: dict[str, torch.Tensor], fn: Callable[[dict], dict],
                      *, micro_batch_size: int | None, max_tokens: int | None,
                      group, model: nn.Module | None = None,
                      share_prompt: bool = False) -> dict[str, torch.Tensor]:
    """``fn`` over micro-batches of ``data`` (no grad), outputs back in row order.

    Every rank of ``group`` runs the same number of forwards (FSDP all-gathers per call).
    ``model`` (the FSDP model ``fn`` runs) is resharded afterwards. ``share_prompt``: ``fn``
    runs a shared prompt once, so a token budget plans the rows sharing one together.
    """
    groups = response_prompt_groups(data) if share_prompt and max_tokens is not None else None
    plan = plan_micro_batches(data["attention_mask"], micro_batch_size=micro_batch_size,
                              max_tokens=max_tokens, group=group, groups=groups)
    outs = [fn(take_rows(data, rows)) for rows in plan]
    order = torch.tensor([i for rows in plan for i in rows])
    result = {}
    for k in outs[0]:
        cat = torch.cat([o[k] for o in outs])
        result[k] = torch.empty_like(cat).index_copy_(0, order.to(cat.device), cat)
    if model is not None:
        reshard(model)
    return result


def prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}
