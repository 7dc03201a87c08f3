"""Safe-RLHF's pieces (Dai et al., 2023, "Safe RLHF: Safe Reinforcement Learning from Human
Feedback"): the Lagrange multiplier of the cost constraint and the combined advantage.

The problem is ``max_theta J_r(theta)`` subject to ``J_c(theta) <= d``: the expected reward
under a bound ``d`` (``cost_limit``) on the expected episode cost. Its Lagrangian
``J_r - lambda (J_c - d)`` is maximised over the policy and minimised over ``lambda >= 0``;
the policy step follows ``(A_r - lambda A_c) / (1 + lambda)`` (the division keeps the
advantage's scale as lambda grows), and lambda takes a projected gradient step on the
constraint violation of the latest episodes (PPO-Lagrangian, Ray et al., 2019).
"""

from __future__ import annotations

from typing import Optional

import torch


def combine_safe_advantages(reward_advantages: torch.Tensor, cost_advantages: torch.Tensor,
                            lam: float) -> torch.Tensor:
    """``(A_r - lam * A_c) / (1 + lam)``, elementwise (tensors of one shape, ``lam >= 0``)."""
    if lam < 0:
        raise ValueError(f"lambda={lam} must be >= 0")
    return (reward_advantages - lam * cost_advantages) / (1.0 + lam)


class LagrangeMultiplier:
    """``lambda >= 0`` of the constraint ``E[episode cost] <= limit``, by projected gradient
    ascent: ``lambda <- clip(lambda + lr * (mean_cost - limit), 0, max_value)``. Plain
    Python with ``state_dict`` for checkpoints (like the KL controllers)."""

    def __init__(self, init: float, lr: float, limit: float, max_value: Optional[float] = None):
        if init < 0:
            raise ValueError(f"lambda_init={init} must be >= 0")
        if lr < 0:
            raise ValueError(f"lambda_lr={lr} must be >= 0 (0 keeps lambda fixed)")
        if max_value is not None and max_value < init:
            raise ValueError(f"lambda_max={max_value} is below lambda_init={init}")
        self.value, self.lr, self.limit, self.max_value = float(init), float(lr), float(limit), max_value

    def update(self, mean_cost: float) -> float:
        """One step on the violation ``mean_cost - limit``; returns the new lambda."""
        value = max(0.0, self.value + self.lr * (float(mean_cost) - self.limit))
        self.value = value if self.max_value is None else min(value, float(self.max_value))
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if "value" not in state:
            raise ValueError(f"Lagrange multiplier state {state!r} has no 'value'")
        self.value = float(state["value"])
