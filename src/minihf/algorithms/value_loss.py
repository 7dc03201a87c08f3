"""The clipped value loss of PPO critics (as in OpenAI baselines / verl)."""

from __future__ import annotations

import torch

from minihf.algorithms.loss_agg import agg_loss, masked_mean


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float,
                       loss_agg_mode: str = "token-mean",
                       normalizer: torch.Tensor | float | None = None):
    """Clipped squared error; every tensor is ``[B, T]``.

    ``v_clip = values + clip(vpreds - values, -c, c)``;
    ``l = 0.5 * max((vpreds - R)^2, (v_clip - R)^2)``, aggregated with :func:`agg_loss`.

    Returns ``(vf_loss, vf_clipfrac)``; the clip fraction is the token mean of
    ``(v_clip - R)^2 > (vpreds - R)^2`` where ``|vpreds - values| > c``. (verl omits the
    second condition; without it, ``values + (vpreds - values) != vpreds`` by rounding makes
    unclipped tokens count at random.)
    """
    delta = vpreds - values                                             # [B, T]
    vclipped = values + torch.clamp(delta, -cliprange_value, cliprange_value)
    err = (vpreds - returns) ** 2                                       # [B, T]
    err_clipped = (vclipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(err, err_clipped)
    clipped = torch.gt(err_clipped, err) & (delta.abs() > cliprange_value)
    vf_clipfrac = masked_mean(clipped.float(), response_mask)
    return agg_loss(loss_mat, response_mask, loss_agg_mode, normalizer), vf_clipfrac
