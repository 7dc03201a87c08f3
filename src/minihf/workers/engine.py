"""What every FSDP role worker does the same way: build a sharded model, run inference
over micro-batches, cut an update into mini-batches.

Role files (``actor.py``, ``critic.py``, ``reward_model.py``) only say which model, which
loss and which outputs. Deviation from the usual meta-device build (STYLE rule 2): every
rank loads the full checkpoint on the host and ``fully_shard`` then keeps its shard; simple
and fine for the small models this targets, at the cost of host memory x ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh, reshard
from minihf.trainer.optim import OptimConfig, build_lr_scheduler, build_optimizer
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.train_step import (LossFn, global_normalizer, global_token_count, group_size,
                                       mean_metrics, plan_micro_batches, take_rows,
                                       train_minibatch)


def build_fsdp_model(model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, *, head: str, group,
                     device: torch.device, trainable: bool = True) -> nn.Module:
    """Load ``model_cfg.path`` with ``head`` and shard it over ``group``'s ranks."""
    from minihf.models import load_hf

    if not model_cfg.path:
        raise ValueError("model.path is empty; set it to an HF checkpoint dir (e.g. one "
                         "written by `minihf init-model`)")
    model = load_hf(model_cfg.path, dtype=torch.float32, device="cpu", head=head)
    model.requires_grad_(trainable)
    return shard_model(model, fsdp_cfg, group=group, device=device, trainable=trainable)


def shard_model(model: nn.Module, fsdp_cfg: FSDPConfig, *, group, device: torch.device,
                trainable: bool = True) -> nn.Module:
    """``apply_fsdp`` with a role's FSDP section (activation checkpointing only if trained)."""
    return apply_fsdp(model, fsdp_mesh(group, device.type),
                      activation_checkpointing=fsdp_cfg.activation_checkpointing and trainable,
                      cpu_offload=fsdp_cfg.param_offload,
                      mixed_precision=fsdp_cfg.mixed_precision,
                      reshard_after_forward=fsdp_cfg.reshard_after_forward)


def build_optim(model: nn.Module, cfg: OptimConfig, total_steps: int | None = None):
    """AdamW + LR scheduler for ``model``; ``total_steps`` (optimizer steps of the run, from
    the driver) fills ``cfg.total_training_steps`` when the config leaves it unset."""
    if total_steps is not None and cfg.total_training_steps is None:
        cfg = dataclasses.replace(cfg, total_training_steps=total_steps)
    optimizer = build_optimizer(model.parameters(), cfg)
    return optimizer, build_lr_scheduler(optimizer, cfg)


def move_optimizer_state(optimizer, device: torch.device | str) -> None:
    """Move every tensor of ``optimizer``'s state (e.g. AdamW moments, DTensor shards) to
    ``device``: the actor parks it on the host while the rollout engine needs the GPU."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = value.to(device, non_blocking=True)


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
                      group, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """``fn`` over micro-batches of ``data`` (no grad), outputs back in row order.

    Every rank of ``group`` runs the same number of forwards (FSDP all-gathers per call).
    ``model`` (the FSDP model ``fn`` runs) is resharded afterwards.
    """
    plan = plan_micro_batches(data["attention_mask"], micro_batch_size=micro_batch_size,
                              max_tokens=max_tokens, group=group)
    outs = [fn(take_rows(data, rows)) for rows in plan]
    order = torch.tensor([i for rows in plan for i in rows])
    result = {}
    for k in outs[0]:
        cat = torch.cat([o[k] for o in outs])
        result[k] = torch.empty_like(cat).index_copy_(0, order.to(cat.device), cat)
    if model is not None:
        reshard(model)
    return result


def mini_batch_rows(num_rows: int, mini_batch_size: int, group, *, epochs: int,
                    shuffle: bool, seed: int) -> list[list[int]]:
    """Row lists of the optimizer steps of one update call (epochs x mini-batches).

    ``mini_batch_size`` is global; each of the ``dp`` ranks holds ``mini_batch_size / dp``
    rows of every mini-batch. ``shuffle`` permutes rows per epoch from ``seed`` (the same
    on every rank, so ranks stay in step).
    """
    dp = group_size(group)
    if mini_batch_size % dp:
        raise ValueError(f"ppo_mini_batch_size={mini_batch_size} is not divisible by the "
                         f"{dp} data-parallel ranks; use a multiple of {dp}")
    local = mini_batch_size // dp
    steps = []
    for epoch in range(epochs):
        order = list(range(num_rows))
        if shuffle:
            g = torch.Generator().manual_seed(seed * 1000 + epoch)
            order = torch.randperm(num_rows, generator=g).tolist()
        steps += [order[i:i + local] for i in range(0, num_rows, local)]
    return steps


def run_update(model: nn.Module, optimizer, lr_scheduler, data: dict[str, torch.Tensor], *,
               mini_batch_size: int, micro_batch_size: int | None, max_tokens: int | None,
               epochs: int, shuffle: bool, seed: int, loss_agg_mode: str,
               make_loss_fn: Callable[[torch.Tensor, torch.Tensor], LossFn], clip_grad: float,
               group) -> dict[str, float]:
    """One update call of a PPO role: epochs x mini-batches x micro-batches.

    For each mini-batch the global loss normaliser and token count (over all DP ranks) are
    computed first; ``make_loss_fn(norm, tokens)`` builds the micro-batch loss that divides
    by them (exact accumulation, see ``train_step``). Returns the per-step metrics averaged.
    """
    steps = []
    num_rows = len(next(iter(data.values())))
    for rows in mini_batch_rows(num_rows, mini_batch_size, group, epochs=epochs,
                                shuffle=shuffle, seed=seed):
        mini = take_rows(data, rows)
        norm = global_normalizer(mini["response_mask"], loss_agg_mode, group)
        tokens = global_token_count(mini["response_mask"], group)
        plan = plan_micro_batches(mini["attention_mask"], micro_batch_size=micro_batch_size,
                                  max_tokens=max_tokens, group=group)
        steps.append(train_minibatch(model, optimizer, lr_scheduler,
                                     [take_rows(mini, p) for p in plan],
                                     make_loss_fn(norm, tokens), clip_grad=clip_grad, group=group))
    return mean_metrics(steps)


def prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}
