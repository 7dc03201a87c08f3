"""Logits over the sampling temperature, the same bits wherever they are made.

The rollout samples from ``logits / temperature`` and the trainer scores the same tokens
under it; the decode step's captured graph divides by a per-row temperature tensor, the
eager sampler and the trainer by one number. An elementwise IEEE division gives the same
bits on every device, but a tensor divided by a *Python float* is not always one: on CUDA
(and on CPU for bf16/fp16) torch multiplies by the divisor's reciprocal instead, which may
be one ulp off the quotient. So every path divides by a tensor on the logits' device.
"""

from __future__ import annotations

import torch


def over_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` as one correctly rounded division per element on every device
    (``temperature`` a number, or a tensor broadcasting against ``logits``); at temperature 1,
    ``logits`` itself."""
    if isinstance(temperature, torch.Tensor):
        return logits / temperature.to(device=logits.device)
    if temperature == 1.0:
        return logits
    return logits / logits.new_full((), temperature)
