"""Policy-gradient losses and their registry (verl's ``register_policy_loss`` pattern).

``compute_policy_loss`` is the PPO clipped surrogate (Schulman et al., 2017) with optional
dual clip, with explicit clip arguments. The registry holds losses with one signature,
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, normalizer,
config) -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, where ``config`` has
``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c`` (an
``ActorConfig``), so the actor can call the one its config names: ``"vanilla"`` (PPO) or
``"gspo"`` (sequence-level ratio).
"""

from __future__ import annotations

from typing import Callable

import inspect

import torch

from minihf.algorithms.loss_agg import agg_loss, masked_mean
from minihf.algorithms.registry import lookup, register_in

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a policy loss under ``name`` (error if the name is taken)."""
    return register_in(POLICY_LOSSES, name, "policy loss")


def get_policy_loss_fn(name: str) -> Callable:
    """The policy loss registered as ``name``; a ValueError listing the known names if none."""
    return lookup(POLICY_LOSSES, name, "policy loss", "register_policy_loss")


def check_takes_is_weights(name: str) -> None:
    """Raise a ValueError unless the policy loss ``name`` takes ``rollout_is_weights``."""
    fn = get_policy_loss_fn(name)
    params = inspect.signature(fn).parameters
    if "rollout_is_weights" not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"policy loss {name!r} does not take rollout_is_weights, which "
                         "algorithm.rollout_correction.rollout_is passes: add a keyword "
                         "argument rollout_is_weights=None and multiply the per-token losses "
                         "by it before aggregating, or set rollout_is to null")


def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, response_mask: torch.Tensor,
                        cliprange: float = 0.2, cliprange_low: float | None = None,
                        cliprange_high: float | None = None, clip_ratio_c: float | None = None,
                        loss_agg_mode: str = "token-mean",
                        normalizer: torch.Tensor | float | None = None,
                        rollout_is_weights: torch.Tensor | None = None):
    """PPO-clip loss over response tokens; every tensor is ``[B, T]``.

    ``r = exp(log_prob - old_log_prob)``;
    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    with ``clip_ratio_c = c`` (dual clip, Ye et al. 2020) tokens with ``A < 0`` use
    ``min(l, -A c)``. With ``rollout_is_weights`` ``w`` (rollout correction), ``l w``. The
    matrix is aggregated with :func:`agg_loss` (``normalizer`` as there).

    Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the loss; the fraction
    of tokens where the clipped term was active; the mean of ``old_log_prob - log_prob``
    (the k1 estimate of KL(old || new)); the fraction where the dual clip was active.
    The three statistics are token means over this batch (not normalised globally).
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    neg_kl = log_prob - old_log_prob                                   # [B, T]
    neg_kl = torch.clamp(neg_kl, min=-20.0, max=20.0)  # exp() stays finite
    ratio = torch.exp(neg_kl)                                          # [B, T]
    ppo_kl = masked_mean(-neg_kl, response_mask)

    loss_unclipped = -advantages * ratio                               # [B, T]
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    pg_clipfrac_lower = torch.zeros((), device=loss_mat.device)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip lower bound "
                             "c * |A|); use e.g. 3.0, or None to disable")
        loss_dual = -advantages * clip_ratio_c
        dual = torch.minimum(loss_mat, loss_dual)
        pg_clipfrac_lower = masked_mean(
            (torch.gt(loss_mat, loss_dual) & (advantages < 0)).float(), response_mask)
        loss_mat = torch.where(advantages < 0, dual, loss_mat)

    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, normalizer)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _clip_bounds(config) -> tuple[float, float]:
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    return (config.clip_ratio if low is None else low, config.clip_ratio if high is None else high)


@register_policy_loss("vanilla")
def vanilla_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, response_mask: torch.Tensor, *,
                        loss_agg_mode: str = "token-mean",
                        normalizer: torch.Tensor | float | None = None, config,
                        rollout_is_weights: torch.Tensor | None = None):
    """:func:`compute_policy_loss` with its clip ranges read from ``config``."""
    low, high = _clip_bounds(config)
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                               cliprange=config.clip_ratio, cliprange_low=low, cliprange_high=high,
                               clip_ratio_c=getattr(config, "clip_ratio_c", None),
                               loss_agg_mode=loss_agg_mode, normalizer=normalizer,
                               rollout_is_weights=rollout_is_weights)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                             advantages: torch.Tensor, response_mask: torch.Tensor, *,
                             loss_agg_mode: str = "seq-mean-token-mean",
                             normalizer: torch.Tensor | float | None = None, config,
                             rollout_is_weights: torch.Tensor | None = None):
    """GSPO (Zheng et al., 2025): PPO-clip with a sequence-level importance ratio.

    ``s_i = exp((1/|y_i|) sum_t m_it (log_prob_it - old_log_prob_it))``; per token
    ``s_it = sg[s_i] * exp(log_prob_it - sg[log_prob_it])``, equal to ``s_i`` in value but
    with gradient ``s_i grad log_prob_it`` (sg = stop-gradient);
    ``l_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))``, aggregated
    with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` is (as verl). ``eps_low/high``
    are ``config.clip_ratio_low/high`` (falling back to ``clip_ratio``); the paper uses
    3e-4 and 4e-4, far below PPO's 0.2, since a sequence ratio moves much less.

    ``normalizer`` (for exact micro-batching) must count non-empty sequences, i.e. come
    from ``loss_agg_mode`` ``seq-mean-token-mean`` or ``seq-mean-token-sum``; a token
    count would silently rescale the loss, so that is an error.
    Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` as
    :func:`compute_policy_loss` (no dual clip: ``pg_clipfrac_lower`` is 0).
    """
    if normalizer is not None and loss_agg_mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"gspo aggregates with 'seq-mean-token-mean', but the normalizer was "
                         f"counted for loss_agg_mode={loss_agg_mode!r}; set the actor's "
                         "loss_agg_mode to 'seq-mean-token-mean' when using gspo")
    low, high = _clip_bounds(config)
    mask = response_mask.to(log_prob.dtype)                            # [B, T]
    neg_kl = log_prob - old_log_prob                                   # [B, T]
    seq_log_ratio = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    seq_log_ratio = torch.clamp(seq_log_ratio.detach(), min=-20.0, max=20.0)
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + log_prob - log_prob.detach())  # [B, T]
    ppo_kl = masked_mean(-neg_kl, response_mask)

    loss_unclipped = -advantages * ratio                               # [B, T]
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    if rollout_is_weights is not None:  # rollout correction, as in the vanilla loss
        loss_mat = loss_mat * rollout_is_weights
    pg_loss = agg_loss(loss_mat, response_mask, "seq-mean-token-mean", normalizer)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), device=loss_mat.device)
