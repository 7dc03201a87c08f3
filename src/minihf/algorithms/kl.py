"""Per-token KL estimators between the policy and the reference (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
               kl_penalty: str = "low_var_kl") -> torch.Tensor:
    """Estimate ``KL(pi || pi_ref)`` per token from sampled-token log-probs ``[B, T]``.

    With ``d = log_prob - ref_log_prob``: ``kl``/``k1`` = d; ``abs`` = |d|;
    ``mse``/``k2`` = d^2 / 2; ``low_var_kl``/``k3`` = exp(-d) - 1 + d, clamped to [-10, 10]
    as verl does (unbiased, non-negative, low variance).
    """
    dtype = torch.promote_types(torch.promote_types(log_prob.dtype, ref_log_prob.dtype), torch.float32)
    d = log_prob.to(dtype) - ref_log_prob.to(dtype)                      # [B, T] fp32 (float64 stays)
    if kl_penalty in ("kl", "k1"):
        return d
    if kl_penalty == "abs":
        return d.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * d.square()
    if kl_penalty in ("low_var_kl", "k3"):
        d = torch.clamp(d, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(-d) - 1.0 + d, min=-10.0, max=10.0)
    raise ValueError(f"kl_penalty={kl_penalty!r} is not supported; choose one of {list(KL_PENALTIES)}")
