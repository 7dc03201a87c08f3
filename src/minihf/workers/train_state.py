"""``TrainState``: a trained FSDP model with its optimizer and LR schedule, shared by every
role that trains (actor, critic, SFT; the reward-model trainer next).

One object owns what an optimizer step depends on, so the roles say only which model,
which loss and which rows:

* :meth:`TrainState.build`: the model built on the meta device, sharded, then filled with
  this rank's rows of the checkpoint (``minihf.workers.engine.build_fsdp_model``); AdamW
  and the warmup/cosine schedule (``minihf.workers.optim``).
* :meth:`step`: one optimizer step over micro-batches (``train_step.train_minibatch``:
  exact normalisation across micro-batches and ranks).
* :meth:`update`: a PPO-style update call, ``epochs`` x mini-batches x micro-batches.
* :meth:`save` / :meth:`load`: the sharded checkpoint (model, optimizer, schedule, RNG and
  the caller's ``extra``; ``minihf.utils.checkpoint``). A LoRA model's checkpoint holds
  its adapters, and its settings in ``meta.json``; resuming with other settings is refused.
* :meth:`optimizer_on_host`: park the optimizer state on the host while something else
  (the rollout engine) needs the accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from minihf.models.lora import adaptable, lora_modules, target_list
from minihf.parallel.ulysses import SeqParallel
from minihf.utils import checkpoint as ckpt
from minihf.utils.files import read_json
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.engine import build_fsdp_model
from minihf.workers.optim import OptimConfig, build_lr_scheduler, build_optimizer
from minihf.workers.packing import response_prompt_groups
from minihf.workers.train_step import (LossFn, advance_schedule, global_normalizer, global_token_count, group_size,
                                       mean_metrics, plan_micro_batches, take_rows,
                                       train_minibatch)


class TrainState:
    def __init__(self, model: nn.Module, optim: OptimConfig, *, group=None,
                 total_steps: int | None = None, hf_source: str | None = None,
                 lora: dict | None = None):
        """``total_steps`` (the run's optimizer steps, from the driver) fills
        ``optim.total_training_steps`` when the config leaves it unset (cosine needs it).
        ``group`` None: one unsharded process, no collectives. ``lora``: a LoRA model's
        settings (:func:`lora_meta`), kept in the checkpoint's ``meta.json``."""
        if total_steps is not None and optim.total_training_steps is None:
            optim = dataclasses.replace(optim, total_training_steps=total_steps)
        self.model, self.optim, self.group, self.hf_source = model, optim, group, hf_source
        self.lora = lora
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim)

    @classmethod
    def build(cls, model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, optim: OptimConfig, *,
              head: str, group, device: torch.device,
              total_steps: int | None = None, compile: bool = False) -> "TrainState":
        model = build_fsdp_model(model_cfg, fsdp_cfg, head=head, group=group, device=device, compile=compile)
        return cls(model, optim, group=group, total_steps=total_steps, hf_source=model_cfg.path,
                   lora=lora_meta(model_cfg, model))

    def step(self, micro_batches: Sequence[dict], loss_fn: LossFn, count_stats: bool = True) -> dict[str, float]:
        """One optimizer step; metrics summed over micro-batches and ranks (+ grad_norm, lr).
        ``count_stats`` False: this rank's statistics are another rank's copy (SP), left out."""
        return train_minibatch(self.model, self.optimizer, self.lr_scheduler, micro_batches,
                               loss_fn, clip_grad=self.optim.clip_grad, group=self.group,
                               count_stats=count_stats)

    def update(self, data: dict[str, torch.Tensor], *, mini_batch_size: int,
               micro_batch_size: int | None, max_tokens: int | None, epochs: int, shuffle: bool,
               seed: int, loss_agg_mode: str,
               make_loss_fn: Callable[[torch.Tensor, torch.Tensor], LossFn],
               share_prompt: bool = False, sp: SeqParallel | None = None,
               scheduled_rows: int | None = None) -> dict[str, float]:
        """One update call of a PPO role: epochs x mini-batches x micro-batches.

        For each mini-batch the global loss normaliser and token count (over all DP ranks)
        are computed first; ``make_loss_fn(norm, tokens)`` builds the micro-batch loss that
        divides by them (exact accumulation, see ``train_step``). Returns the per-step
        metrics averaged over the call's optimizer steps, and ``skipped_updates`` (how many
        had a non-finite gradient and did not update) when any did. ``share_prompt``: the
        loss runs a shared prompt once (a token budget keeps the rows sharing one together).

        ``sp`` (Ulysses, ``minihf.parallel.ulysses``): the ranks of an SP group unite their rows
        and run each micro-batch together, a piece of its tokens each, so a mini-batch holds
        ``sp.size`` times this rank's share and a micro-batch's token budget is
        ``max_tokens x sp.size`` (verl's rules). Every SP rank computes the same loss from the
        whole outputs; its gradient flows through its own tokens only, so FSDP's sum over all
        ranks (the ``x dp`` of ``train_step``) is the mini-batch's gradient. The normaliser,
        token count and statistics count each row once: on the group's leader alone.

        ``scheduled_rows``: the rows a step holds as the run was planned (``data.train_batch_size
        x rollout.n``; the LR schedule allots them ``scheduled_rows // mini_batch_size x
        epochs`` optimizer steps). When a plug-in dropped rows before the update, the call
        takes fewer optimizer steps (mini-batches keep their size) and the schedule then moves
        past the steps not taken, so it still follows the run's progress and ends with it;
        the metrics gain ``trained_rows`` and ``schedule_skipped_steps`` (negative: more rows
        than planned, the schedule ran ahead). With the planned rows nothing changes.
        """
        steps = []
        dp = group_size(self.group)
        if sp is not None:
            data, _ = sp.gather_rows(data)
            max_tokens = max_tokens * sp.size if max_tokens is not None else None
            dp //= sp.size
        counted = sp is None or sp.leader
        num_rows = len(next(iter(data.values())))
        for rows in mini_batch_rows(num_rows, mini_batch_size, dp, epochs=epochs,
                                    shuffle=shuffle, seed=seed):
            mini = take_rows(data, rows)
            # an SP group's rows count once, on its leader (seq-mean-token-sum-norm counts rows,
            # empty or not: a zeroed mask on the other ranks still counted them)
            norm = global_normalizer(mini["response_mask"], loss_agg_mode, self.group, counted)
            tokens = global_token_count(mini["response_mask"], self.group, counted)
            groups = response_prompt_groups(mini) if share_prompt and max_tokens is not None else None
            plan = plan_micro_batches(mini["attention_mask"], micro_batch_size=micro_batch_size,
                                      max_tokens=max_tokens, group=self.group, groups=groups)
            steps.append(self.step([take_rows(mini, p) for p in plan], make_loss_fn(norm, tokens), counted))
        skipped = sum(s.pop("skipped", 0.0) for s in steps)
        out = mean_metrics(steps)
        if skipped:
            out["skipped_updates"] = skipped
        if scheduled_rows is not None and num_rows * dp != scheduled_rows:
            planned = scheduled_rows // mini_batch_size * epochs
            out["trained_rows"], out["schedule_skipped_steps"] = float(num_rows * dp), float(planned - len(steps))
            self.advance_schedule(planned - len(steps))
        return out

    def advance_schedule(self, steps: int) -> None:
        """Move the LR schedule ``steps`` optimizer steps on without taking them (the steps a
        step's dropped rows would have taken)."""
        advance_schedule(self.lr_scheduler, steps)

    def save(self, path: str, extra: dict | None = None) -> str:
        """Sharded model + optimizer + schedule + RNG (+ ``extra``) under ``path``; every
        rank of the group calls it."""
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.lr_scheduler,
                             group=self.group, extra=dict(extra or {}), hf_source=self.hf_source,
                             meta={"lora": self.lora} if self.lora else None)
        return str(path)

    def load(self, path: str) -> dict:
        """Restore what :meth:`save` wrote; returns the saved ``extra``. The learning rate of
        the next step comes from this run's schedule at the saved step, not from the saved
        optimizer: a resumed run with a changed length (``total_epochs``) is on its new
        schedule from its first step (with an unchanged one, the two are the same numbers)."""
        self._check_lora(path)
        extra = ckpt.load_checkpoint(path, self.model, self.optimizer, self.lr_scheduler,
                                     group=self.group)
        sched = self.lr_scheduler
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
        return extra

    def _check_lora(self, path: str) -> None:
        """One clear error when the checkpoint's LoRA settings differ from this model's."""
        meta = Path(path) / "meta.json"
        if not meta.is_file():
            return  # load_checkpoint explains
        saved = read_json(meta, "the checkpoint was not written completely; resume an earlier "
                          "global_step_N").get("lora")

        def settings(lora):  # alpha too: the adapters' scale alpha / rank would jump at the resume
            return (lora["rank"], lora.get("alpha"), list(lora["modules"])) if lora else None

        if settings(saved) == settings(self.lora):
            return

        def said(lora):
            return (f"lora_rank={lora['rank']}, lora_alpha={lora.get('alpha')} on {len(lora['modules'])} modules"
                    if lora else "full parameters (lora_rank=0)")
        raise ValueError(f"checkpoint {path} was trained with {said(saved)}, this run has "
                         f"{said(self.lora)}; set model.lora_rank / lora_alpha / target_modules / "
                         "exclude_modules as they were, or start a new run")

    @contextlib.contextmanager
    def optimizer_on_host(self, enabled: bool = True):
        """Inside: the optimizer state (AdamW moments) lives on the host; moved back after."""
        device = next(self.model.parameters()).device
        if not enabled or device.type == "cpu":
            yield
            return
        move_optimizer_state(self.optimizer, "cpu")
        try:
            yield
        finally:
            move_optimizer_state(self.optimizer, device)


def lora_meta(model_cfg, model: nn.Module) -> dict | None:
    """A LoRA model's settings for its checkpoints (None without LoRA): rank, alpha, the
    adapted modules, ``target_modules`` for a PEFT adapter config, the base model dir."""
    if not getattr(model_cfg, "lora", False):
        return None
    names = list(lora_modules(model))
    return {"rank": model_cfg.lora_rank, "alpha": model_cfg.lora_alpha, "modules": names,
            "target_modules": target_list(names, adaptable(model)),
            "base": str(Path(model_cfg.path).resolve())}


def move_optimizer_state(optimizer, device: torch.device | str) -> None:
    """Move every tensor of ``optimizer``'s state (AdamW moments, DTensor shards) to ``device``."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = value.to(device, non_blocking=True)


def mini_batch_rows(num_rows: int, mini_batch_size: int, dp: int, *, epochs: int,
                    shuffle: bool, seed: int) -> list[list[int]]:
    """Row lists of the optimizer steps of one update call (epochs x mini-batches).

    ``mini_batch_size`` is global; each of the ``dp`` data-parallel ranks (or SP groups)
    holds ``mini_batch_size / dp`` rows of every mini-batch. ``shuffle`` permutes rows per
    epoch from ``seed`` (the same on every rank, so ranks stay in step).
    """
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
