"""Turning a per-token loss matrix into one scalar: ``agg_loss`` and its normaliser.

Modes (verl's names):

* ``token-mean``: every response token in the mini-batch weighs the same,
  ``sum_{i,t} m_it l_it / N_tokens``.
* ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences,
  ``sum_i (sum_t m_it l_it) / N_seqs``.
* ``seq-mean-token-mean``: mean over each sequence's tokens, mean over sequences,
  ``sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs``.

``N_seqs`` counts sequences with at least one response token. Gradient accumulation is
exact when every micro-batch divides by the normaliser of the *whole* mini-batch (over all
micro-batches and data-parallel ranks) instead of its own: pass it as ``normalizer``
(see :func:`loss_normalizer`, whose local counts the caller sums across ranks).
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported; "
                         f"choose one of {list(LOSS_AGG_MODES)}")


def loss_normalizer(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The local count ``agg_loss`` divides by: tokens (token-mean) or non-empty sequences.

    loss_mask: ``[B, T]``. Returns a 0-d fp32 tensor; sum it over micro-batches and ranks
    to get the global normaliser of a mini-batch.
    """
    _check_mode(loss_agg_mode)
    mask = loss_mask.float()
    if loss_agg_mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).float().sum()


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[B, T]`` under ``loss_mask`` ``[B, T]`` into a scalar.

    ``normalizer`` defaults to this batch's own :func:`loss_normalizer` (a plain mean);
    it is clamped to at least 1 so an all-masked batch gives 0, not NaN.
    """
    _check_mode(loss_agg_mode)
    mask = loss_mask.to(loss_mat.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, loss_agg_mode)
    normalizer = torch.clamp(torch.as_tensor(normalizer, dtype=loss_mat.dtype,
                                             device=loss_mat.device), min=1.0)
    if loss_agg_mode in ("token-mean", "seq-mean-token-sum"):
        total = (loss_mat * mask).sum()   # they differ only in the normaliser
    else:  # seq-mean-token-mean
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        total = per_seq.sum()
    return total / normalizer


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)`` over all elements."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
