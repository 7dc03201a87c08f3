"""The in-reward KL penalty to the reference policy and its coefficient controllers.

PPO-style RLHF subtracts ``beta * KL`` from every response token's reward
(:func:`apply_kl_penalty`); ``beta`` is fixed or adapted towards a target KL
(Ziegler et al., 2019). The controllers are plain Python objects with a
``state_dict`` so a trainer can checkpoint ``beta`` with the rest of its state.
(GRPO instead puts the KL in the actor's loss; see ``ActorConfig.use_kl_loss``.)
"""

from __future__ import annotations

import torch

from minihf.algorithms.kl import kl_penalty as kl_estimate


class KLController:
    """The interface: ``value`` (beta), ``update(current_kl, n_steps)``, checkpoint state."""
    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict) -> None:
        if "value" not in state:
            raise ValueError(f"KL controller state {state!r} has no 'value'; pass the dict "
                             "that state_dict() returned")
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant coefficient: ``value = kl_coef``; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0 (0 disables the penalty)")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController(KLController):
    """Adapt ``beta`` towards ``target_kl`` (Ziegler et al., 2019, "Fine-Tuning Language
    Models from Human Preferences").

    ``e = clip(KL / target_kl - 1, -0.2, 0.2)``; ``beta <- beta (1 + e n_steps / horizon)``,
    where ``n_steps`` is the number of samples the KL was measured on.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0")
        if not target_kl > 0:
            raise ValueError(f"target_kl={target_kl} must be > 0 (the KL the controller steers "
                             "to, the batch mean of each sequence's mean token KL, e.g. 0.1); use "
                             "FixedKLController for a constant coefficient")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon} must be > 0 (samples over which the "
                             "coefficient may change by up to 20%, e.g. 10000)")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor,
                     ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     kl_ctrl: KLController, kl_penalty: str = "kl"):
    """Subtract the KL to the reference from the token rewards, then update ``kl_ctrl``.

    ``kl_t = m_t * k(log_prob_t, ref_log_prob_t)`` (``k`` the ``kl_penalty`` estimator of
    :func:`minihf.algorithms.kl.kl_penalty`); ``rewards = scores - beta * kl``, ``beta =
    kl_ctrl.value`` before the update. ``current_kl`` is the mean over sequences of each
    sequence's masked token mean of ``kl`` (an empty row counts as 0), and the controller
    is updated with ``(current_kl, n_steps=B)``. All tensors are ``[B, T]``.

    Returns ``(token_level_rewards, metrics)`` with ``actor/reward_kl_penalty`` (current_kl)
    and ``actor/reward_kl_penalty_coeff`` (beta) as floats.
    """
    mask = response_mask.to(torch.float32)                               # [B, T]
    kld = kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * mask     # [B, T]
    beta = float(kl_ctrl.value)
    token_level_rewards = token_level_scores - beta * kld.to(token_level_scores.dtype)
    per_seq = kld.sum(-1) / mask.sum(-1).clamp(min=1.0)                  # [B]
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
