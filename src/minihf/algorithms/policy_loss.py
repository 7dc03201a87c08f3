"""The PPO clipped surrogate policy loss (Schulman et al., 2017), with optional dual clip.

Pure tensor function; the algorithms issue adds more policy losses next to it.
"""

from __future__ import annotations

import torch

from minihf.algorithms.loss_agg import agg_loss, masked_mean


def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, response_mask: torch.Tensor,
                        cliprange: float = 0.2, cliprange_low: float | None = None,
                        cliprange_high: float | None = None, clip_ratio_c: float | None = None,
                        loss_agg_mode: str = "token-mean",
                        normalizer: torch.Tensor | float | None = None):
    """PPO-clip loss over response tokens; every tensor is ``[B, T]``.

    ``r = exp(log_prob - old_log_prob)``;
    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    with ``clip_ratio_c = c`` (dual clip, Ye et al. 2020) tokens with ``A < 0`` use
    ``min(l, -A c)``. The matrix is aggregated with :func:`agg_loss` (``normalizer`` as
    there).

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

    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, normalizer)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower
