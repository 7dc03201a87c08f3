"""Auxiliary losses: extra terms of a trained actor's loss, written in a recipe.

``actor_rollout_ref.actor.aux_losses.<name>`` (an ``AuxLossConfig``) names a function
(``file.py:function``); the update adds ``coef x`` its value to the policy loss, in the same
forward and backward. Megatron and OpenRLHF call the MoE router's such term the "aux loss"; here
any recipe may add one (a distillation term, a logit regulariser). The function receives, by
the names of its parameters:

* ``log_prob`` ``[b, R]``: the student's log-probs of the sampled tokens (with gradient), at
  the rollout's temperature;
* ``log_probs_at`` ``[b, R, k]``: with ``log_probs_at: KEY`` set, the student's log-probs (the
  temperature-scaled log-softmax, with gradient) at the token ids the batch key ``KEY``
  ``[B, R, k]`` holds, from the same logits (no second forward; chunked with
  ``logits_chunk_size``);
* the micro-batch's own tensors (``response_mask``, ``responses``, ``advantages``,
  ``old_log_probs``, ...) and every key named in ``reads`` (e.g. a teacher role's outputs:
  the driver sends them to the actor for this);
* ``options``: its settings (a dict); ``loss_agg_mode`` and ``normalizer``: aggregate with
  ``minihf.algorithms.agg_loss(values, response_mask, loss_agg_mode, normalizer)`` as the
  policy loss does, so the term is exact across micro-batches and ranks.

It returns the loss term (a scalar tensor), or ``(loss, stats)`` with ``stats`` a dict of
named figures (this micro-batch's means, floats or scalar tensors). The metrics gain
``actor/<name>/loss`` and ``actor/<name>/<stat>`` (token-weighted over the mini-batch, averaged
over the update's optimizer steps). A parameter it asks for that nothing provides, a bad return
value or a non-scalar loss stop the run in one line naming the loss.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

PROVIDED = ("log_prob", "log_probs_at", "options", "loss_agg_mode", "normalizer")


@dataclass
class AuxLossConfig:
    """An extra term of the actor's loss (``minihf.workers.aux_loss``)."""
    fn: str = ""                         # file.py:function (a recipe's; paths from the recipe folder): the term
    coef: float = 1.0                    # its weight in the loss; 0: computed and logged, not trained
    reads: list[str] = field(default_factory=list)  # batch keys it reads beyond the update's own (a teacher's outputs)
    # a batch key of token ids [B, R, k]: the student's log-probs at them, from the update's forward, as log_probs_at
    log_probs_at: Optional[str] = None
    options: dict = field(default_factory=dict)  # its own settings, passed as options

    def __post_init__(self):
        from minihf.utils.imports import is_code_ref

        if not is_code_ref(self.fn):
            raise ValueError(f"fn={self.fn!r} must name the loss function as file.py:function "
                             f"(e.g. gkd.py:top_k_kl)")
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not math.isfinite(self.coef):
            raise ValueError(f"coef={self.coef!r} must be a finite number (its weight in the loss)")
        if not all(isinstance(k, str) and k for k in self.reads):
            raise ValueError(f"reads={self.reads!r} must be a list of batch keys (strings)")
        if self.log_probs_at is not None and (not isinstance(self.log_probs_at, str) or not self.log_probs_at):
            raise ValueError(f"log_probs_at={self.log_probs_at!r} must be a batch key of token ids, or null")


def aux_loss_reads(losses: dict[str, AuxLossConfig]) -> tuple[str, ...]:
    """Every batch key the losses read (their ``reads`` and ``log_probs_at`` keys), in order."""
    keys: list[str] = []
    for spec in losses.values():
        for k in [*spec.reads, *([spec.log_probs_at] if spec.log_probs_at else [])]:
            if k not in keys:
                keys.append(k)
    return tuple(keys)


def check_aux_reads(losses: dict[str, AuxLossConfig], batch, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The batch keys the losses read beyond ``keys``; one that ``batch`` lacks is named with
    the loss that reads it (a teacher's output no phase put there)."""
    for name, spec in losses.items():
        for k in [*spec.reads, *([spec.log_probs_at] if spec.log_probs_at else [])]:
            if k not in batch.tensors:
                raise ValueError(f"actor_rollout_ref.actor.aux_losses.{name} ({spec.fn}) reads batch key {k!r}, "
                                 f"which the step's batch does not hold ({sorted(batch.tensors)}); a phase or "
                                 f"a role's call must add it before update_actor")
    return tuple(k for k in aux_loss_reads(losses) if k not in keys)


class AuxLoss:
    """One configured loss, loaded and checked on the worker (``init_model``)."""

    def __init__(self, name: str, spec: AuxLossConfig, batch_keys: tuple[str, ...]):
        from minihf.utils.imports import load_ref

        self.name, self.spec = name, spec
        self.label = f"actor_rollout_ref.actor.aux_losses.{name} ({spec.fn})"
        self.fn: Callable = load_ref(spec.fn, "aux loss")
        params = inspect.signature(self.fn).parameters.values()
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ValueError(f"{self.label}: name each input as a parameter (no *args/**kwargs): "
                             f"it receives only what it names")
        self.wants = [p.name for p in params]
        self.required = {p.name for p in params if p.default is p.empty}
        available = set(PROVIDED) | set(batch_keys) | set(spec.reads)
        missing = [p.name for p in params if p.name not in available and p.default is p.empty]
        if "log_probs_at" in self.wants and not spec.log_probs_at:
            missing.append("log_probs_at (set log_probs_at: the batch key of the ids)")
        if missing:
            raise ValueError(f"{self.label}: nothing provides its parameter(s) {missing}; it may take "
                             f"{sorted(available)} (add a batch key to reads)")

    def __call__(self, mb: dict, out: dict, at: dict, *, loss_agg_mode: str, normalizer
                 ) -> tuple[torch.Tensor, dict]:
        given = {"log_prob": out["log_probs"], "options": dict(self.spec.options),
                 "loss_agg_mode": loss_agg_mode, "normalizer": normalizer}
        if self.spec.log_probs_at:
            given["log_probs_at"] = at[self.spec.log_probs_at]
        absent = sorted(k for k in self.required if k not in given and k not in mb)
        if absent:  # e.g. ref_log_prob in a job without a KL loss
            raise ValueError(f"{self.label}: the update's batch has no {absent} in this job; it holds "
                             f"{sorted(mb)} (add the key to reads, or give the parameter a default)")
        kwargs = {k: given[k] if k in given else mb[k] for k in self.wants if k in given or k in mb}
        result = self.fn(**kwargs)
        loss, stats = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"{self.label} returned {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; return the "
                             f"loss as a scalar tensor, or (loss, {{name: figure}})")
        if not isinstance(stats, dict) or not all(isinstance(k, str) for k in stats):
            raise ValueError(f"{self.label}: its statistics must be a dict of name -> number, got "
                             f"{type(stats).__name__}")
        return loss.reshape(()), stats


def policy_loss_terms(result, label: str, log_prob: torch.Tensor) -> tuple:
    """A policy loss's return, checked: ``(pg_loss, clipfrac, ppo_kl, clipfrac_lower, own)``
    with ``own`` its own figures (``{}`` when it gives none). A recipe's loss that returned
    something else failed deep in the update, or (a loss without gradient) trained silently
    on the other terms alone."""
    shape = "(scalar loss with grad, clipfrac, ppo_kl, clipfrac_lower[, {name: figure}])"
    if not isinstance(result, (tuple, list)) or len(result) not in (4, 5):
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ValueError(f"{label} returned {got}; return {shape}")
    loss, *figures = result[:4]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"{label} returned {type(loss).__name__}"
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''} as the loss; "
                         f"return {shape}")
    if log_prob.requires_grad and not loss.requires_grad:
        raise ValueError(f"{label} returned a loss without gradient (made from detached tensors, or "
                         f"a constant); compute it from log_prob so that it trains the policy")
    named = extra_stats(dict(zip(("clipfrac", "ppo_kl", "clipfrac_lower"), figures)), label)
    own = result[4] if len(result) == 5 else {}
    if not isinstance(own, dict):
        raise ValueError(f"{label}: its own figures (the 5th value) must be a dict of name -> number, "
                         f"got {type(own).__name__}")
    return (loss.reshape(()), *(named[k].to(loss.device) for k in ("clipfrac", "ppo_kl", "clipfrac_lower")),
            extra_stats(own, label))


def extra_stats(stats, label: str) -> dict:
    """A policy loss's or aux loss's own figures, checked: name -> scalar tensor (detached)."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = v.detach().float().reshape(())
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = torch.tensor(float(v))
        else:
            raise ValueError(f"{label}: statistic {k!r} is {type(v).__name__}; give a number or a "
                             f"scalar tensor (this micro-batch's mean)")
    return out


def build_aux_losses(losses: dict[str, AuxLossConfig], batch_keys: tuple[str, ...]) -> list[AuxLoss]:
    """The configured losses, loaded and checked (``batch_keys``: what the update's micro-batch holds)."""
    return [AuxLoss(name, spec, batch_keys) for name, spec in losses.items()]


def ids_keys(losses: list[AuxLoss]) -> list[str]:
    """The batch keys of ids whose log-probs the losses read, each once, in order."""
    return list(dict.fromkeys(x.spec.log_probs_at for x in losses if x.spec.log_probs_at))


def ids_for(losses: list[AuxLoss], mb: dict) -> torch.Tensor | None:
    """The ids to score in the update's forward ``[b, R, sum k]`` (every key's, side by side), or None."""
    parts = []
    for key in ids_keys(losses):
        ids = mb[key]
        if ids.dim() != 3 or ids.shape[:2] != mb["responses"].shape or ids.is_floating_point():
            raise ValueError(f"batch key {key!r} (an aux loss's log_probs_at) must hold integer token ids "
                             f"[B, R, k] with [B, R] = responses' {tuple(mb['responses'].shape)}; got "
                             f"{ids.dtype} {tuple(ids.shape)}")
        parts.append(ids.long())
    return torch.cat(parts, -1) if parts else None


def add_aux_terms(losses: list[AuxLoss], mb: dict, out: dict, stats: dict, *, share: torch.Tensor,
                  loss_agg_mode: str, normalizer) -> torch.Tensor | float:
    """The losses' weighted sum for this micro-batch; their figures join ``stats`` (``<name>/loss``
    summed as the policy loss is, ``<name>/<stat>`` weighted by the micro-batch's ``share``)."""
    at, start = {}, 0
    for key in ids_keys(losses):  # split the forward's [b, R, sum k] back per key
        k = mb[key].shape[-1]
        at[key] = out["log_probs_at"][..., start:start + k]
        start += k
    total = 0.0
    for x in losses:
        loss, figures = x(mb, out, at, loss_agg_mode=loss_agg_mode, normalizer=normalizer)
        if x.spec.coef != 0:
            total = total + x.spec.coef * loss
        stats[f"{x.name}/loss"] = loss.detach()
        for k, v in extra_stats(figures, x.label).items():
            stats[f"{x.name}/{k}"] = v.to(share.device) * share
    return total
