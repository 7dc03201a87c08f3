"""What every FSDP role worker does the same way: build a sharded model, run inference
over micro-batches. Training (optimizer, updates, checkpoints) is ``train_state.TrainState``.

Role files (``actor.py``, ``critic.py``, ``reward_model.py``, ``sft_worker.py``) only say
which model, which loss and which outputs. Build order (CONTRIBUTING.md, rule 2): the model is
constructed on the meta device, sharded with ``apply_fsdp``, materialised, and each rank
reads only its own rows of every parameter from the safetensors files
(``minihf.parallel.fsdp.load_sharded``), so host memory does not grow with the rank count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from minihf.hub.peft import check_adapter, read_adapter_dir
from minihf.models import CheckpointReader, build_model, materialize
from minihf.models.model import compile_blocks
from minihf.models.lora import (ALL_LINEAR, adaptable, apply_lora, init_lora_state, is_lora_param,
                                module_names, target_list, trained_with_lora)
from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh, load_sharded, reshard
from minihf.parallel.ulysses import SeqParallel, seq_parallel
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.packing import response_prompt_groups
from minihf.workers.train_step import plan_micro_batches, take_rows


def build_fsdp_model(model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, *, head: str, group,
                     device: torch.device, trainable: bool = True, compile: bool = False) -> nn.Module:
    """``model_cfg.path`` with ``head``, sharded over ``group``'s ranks (meta -> LoRA ->
    compile -> FSDP -> materialise -> this rank's rows). ``group`` None: one process, the
    whole model. A trained model whose config sets ``lora_rank`` gets adapters
    (``minihf.models.lora``): its base weights are frozen, the adapters (and a value or
    score head) train. ``compile``: ``minihf.models.model.compile_blocks``."""
    if not model_cfg.path:
        raise ValueError("model.path is empty; set it to an HF checkpoint dir (e.g. one "
                         "written by `minihf init-model`)")
    reader = CheckpointReader(model_cfg.path, head)
    model = build_model(reader.args, head, device="meta", dtype=torch.float32)
    lora = trainable and getattr(model_cfg, "lora", False)
    if lora:
        apply_lora(model, model_cfg.lora_rank, model_cfg.lora_alpha,
                   module_names(model, model_cfg.target_modules, model_cfg.exclude_modules,
                                "model.target_modules"))
    model.requires_grad_(trainable and not lora)
    for name, p in model.named_parameters():
        if lora and trained_with_lora(name, head):
            p.requires_grad_(True)
    if compile:
        compile_blocks(model)
    if group is not None:
        shard_model(model, fsdp_cfg, group=group, device=device, trainable=trainable)
    materialize(model, "cpu" if fsdp_cfg.param_offload and group is not None else device)
    return load_sharded(model, reader, adapter_state(model_cfg, model) if lora else None)


def adapter_state(model_cfg, model: nn.Module, section: str = "model") -> dict[str, torch.Tensor]:
    """The adapters' starting values (full tensors): peft's initialisation (the adapted
    model starts equal to its base), or the PEFT dir ``model.lora_adapter_path``, checked
    (``minihf.hub.peft``: the dir itself, its fit to the model and to ``model.path`` as its
    base) and against the config (errors name the keys under ``section``)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}
    path = model_cfg.lora_adapter_path
    if path is None:
        return init_lora_state(shapes, seed=0)
    adapter = read_adapter_dir(path)
    check_adapter(adapter, model, f"{section}.path={model_cfg.path!r}", base_dir=model_cfg.path,
                  base_key=f"{section}.path")
    where = f"{section}.lora_adapter_path={path!r}"
    for key, ours, theirs in (("lora_rank", model_cfg.lora_rank, adapter.rank),
                              ("lora_alpha", model_cfg.lora_alpha, adapter.alpha)):
        if float(ours) != float(theirs):
            raise ValueError(f"{where} was trained with {key}={theirs!r} but {section}.{key}="
                             f"{ours!r}; set {section}.{key}={theirs!r}")
    if set(adapter.tensors) != set(shapes):
        theirs, ours = adapter.modules, sorted({n.rpartition(".")[0] for n in shapes})
        every = adaptable(model)
        fix = (ALL_LINEAR if sorted(theirs) == sorted(every)
               else target_list([n for n in every if n in theirs], every))
        raise ValueError(f"{where} adapts {len(theirs)} modules ({theirs[:3]}...) but "
                         f"{section}.target_modules / exclude_modules select {len(ours)} "
                         f"({ours[:3]}...); set {section}.target_modules={fix!r} (and no "
                         "exclude_modules)")
    return {n: t.float() for n, t in adapter.tensors.items()}


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
                      share_prompt: bool = False, sp: SeqParallel | None = None) -> dict[str, torch.Tensor]:
    """``fn`` over micro-batches of ``data`` (no grad), outputs back in row order.

    Every rank of ``group`` runs the same number of forwards (FSDP all-gathers per call).
    ``model`` (the FSDP model ``fn`` runs) is resharded afterwards. ``share_prompt``: ``fn``
    runs a shared prompt once, so a token budget plans the rows sharing one together.
    ``sp`` (Ulysses): the SP group's rows run together (``fn`` splits each micro-batch's
    tokens over the group, a budget of ``max_tokens x sp.size``); each rank returns its own.
    """
    own = None
    if sp is not None:
        data, own = sp.gather_rows(data)
        max_tokens = max_tokens * sp.size if max_tokens is not None else None
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
    return result if own is None else sp.own_rows(result, own)


def sp_layouts(*sizes: int) -> dict[str, int]:
    """The layouts a role declares for its sequence-parallel sizes: one per size over 1, whose
    TP groups serve as the SP groups (every rank creates them at launch)."""
    return {f"sp{n}": n for n in sizes if n > 1}


def sp_group(worker, size: int) -> SeqParallel | None:
    """``worker``'s SP group of ``size`` ranks (declared by :func:`sp_layouts`); None for 1."""
    return seq_parallel(worker.parallel(f"sp{size}").tp_group) if size > 1 else None


def prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}
