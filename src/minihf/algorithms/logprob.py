"""Per-token log-probabilities and entropies from logits.

Both upcast to fp32 first: bf16 log-softmax loses the small differences PPO ratios are
made of. Pure tensor functions, no distributed code.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(label)`` under ``softmax(logits)``.

    logits: ``[..., V]``; labels: ``[...]`` long. Returns ``[...]`` fp32:
    ``logits[label] - logsumexp(logits)``.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim.

    logits: ``[..., V]``. Returns ``[...]`` fp32:
    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
