"""Turning a per-token loss matrix into one scalar: ``agg_loss`` and its normaliser; and
the masked statistics (mean, variance, whitening) the losses and advantages share.

Modes (verl's names):

* ``token-mean``: every response token in the mini-batch weighs the same,
  ``sum_{i,t} m_it l_it / N_tokens``.
* ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences,
  ``sum_i (sum_t m_it l_it) / N_seqs``.
* ``seq-mean-token-mean``: mean over each sequence's tokens, mean over sequences,
  ``sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs``.
* ``seq-mean-token-sum-norm`` (Dr.GRPO, Liu et al. 2025): token sums over every sequence
  divided by a *fixed* length, ``sum_{i,t} m_it l_it / (B * L)``, so a sequence's weight
  does not depend on its length. ``L`` is ``loss_scale_factor`` (default: the mask's
  ``T``); ``B`` counts every row, empty or not.

``N_seqs`` counts sequences with at least one response token. Gradient accumulation is
exact when every micro-batch divides by the normaliser of the *whole* mini-batch (over all
micro-batches and data-parallel ranks) instead of its own: pass it as ``normalizer``
(see :func:`loss_normalizer`, whose local counts the caller sums across ranks).
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported; "
                         f"choose one of {list(LOSS_AGG_MODES)}")


def loss_normalizer(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The local count ``agg_loss`` divides by: tokens (token-mean), all rows
    (seq-mean-token-sum-norm, which ``agg_loss`` further multiplies by the fixed length) or
    non-empty sequences (the other modes).

    loss_mask: ``[B, T]``. Returns a 0-d fp32 tensor; sum it over micro-batches and ranks
    to get the global normaliser of a mini-batch.
    """
    _check_mode(loss_agg_mode)
    mask = loss_mask.float()
    if loss_agg_mode == "token-mean":
        return mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return torch.tensor(float(loss_mask.shape[0]), device=loss_mask.device)
    return (mask.sum(-1) > 0).float().sum()


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             normalizer: torch.Tensor | float | None = None, *,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[B, T]`` under ``loss_mask`` ``[B, T]`` into a scalar.

    ``normalizer`` defaults to this batch's own :func:`loss_normalizer` (a plain mean);
    it is clamped to at least 1 so an all-masked batch gives 0, not NaN.
    ``loss_scale_factor`` is the fixed length ``L`` of ``seq-mean-token-sum-norm`` (default
    ``T = loss_mask.shape[-1]``; set it to the max response length so that it does not
    change with the batch's padding); the other modes ignore it.
    """
    _check_mode(loss_agg_mode)
    if loss_scale_factor is not None and not loss_scale_factor > 0:
        raise ValueError(f"loss_scale_factor={loss_scale_factor} must be > 0 (the fixed "
                         "generation length, e.g. the max response length), or None for T")
    mask = loss_mask.to(loss_mat.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, loss_agg_mode)
    normalizer = torch.clamp(torch.as_tensor(normalizer, dtype=loss_mat.dtype,
                                             device=loss_mat.device), min=1.0)
    if loss_agg_mode in ("token-mean", "seq-mean-token-sum"):
        total = (loss_mat * mask).sum()   # they differ only in the normaliser
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        total = per_seq.sum()
    else:  # seq-mean-token-sum-norm: normalizer counts rows, times the fixed length
        length = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (loss_mat * mask).sum() / (normalizer * length)
    return total / normalizer


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last nonzero entry of ``mask`` [B, T] (-1 for an empty row): a
    response's last token, also when a multi-turn mask has gaps (observations)."""
    T = mask.shape[-1]
    return torch.where(mask.bool(), torch.arange(T, device=mask.device), -1).max(-1).values


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)`` over all elements."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the elements where ``mask`` is 1.

    ``mean((v - mean(v))^2)`` over the mask, times ``n / (n - 1)`` when ``unbiased``
    (Bessel's correction, as verl and ``torch.var``), ``n = sum(mask)``.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask)
    if unbiased:
        n = float(mask.sum())
        if n < 2:
            raise ValueError(f"masked_var needs at least 2 unmasked elements for an unbiased "
                             f"variance, got {n:g}; check the response_mask (all padding?) "
                             "or pass unbiased=False")
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(v - mean) / sqrt(var + 1e-8)`` with the masked mean and unbiased variance.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised).
    Masked-out elements are transformed too; callers multiply by the mask.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean
