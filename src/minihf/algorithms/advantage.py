"""Advantage estimators for RL on language models, and their registry (verl's names).

Every estimator is a pure tensor function under ``torch.no_grad`` taking ``[B, T]``
response-aligned tensors (``token_level_rewards``: usually one nonzero entry, the score,
on the last response token) and returning ``(advantages, returns)``, both ``[B, T]``.
Advantages are zero outside ``response_mask``; ``returns`` outside it are meaningless
(the value loss masks them). The group estimators take ``index``, one group id (the
prompt uid) per row, as a numpy array or list.

Masked positions *inside* a response (e.g. tool output in a multi-turn rollout) are
skipped, not treated as the end of the episode: the recursions carry their running value
over them (as verl's newer GAE does; verl's REINFORCE++ resets instead, which is the same
for right padding but cuts the return at an inner masked span).

The estimators take different inputs, so the trainer calls the one named in config
with keyword arguments: ``get_adv_estimator_fn(name)(token_level_rewards=..., ...)``.

An estimator's spec is what it needs from the batch beyond what every step has
(``adv_estimator_needs``): ``values`` (so a critic runs) and ``reward_baselines`` (so the
baseline rollout runs, a greedy sample per prompt, scored). By default it is read from the
signature: the parameters without a default among ``PRODUCED_BY``; ``register_adv_est(name,
needs=...)`` states it instead. A ``file.py:function`` estimator's spec comes from its
signature, read from the file's syntax tree (config checks run no recipe code). The driver
decides which roles and plug-ins run from the spec, never from the estimator's name.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np
import torch

from minihf.algorithms.loss_agg import masked_whiten
from minihf.algorithms.registry import lookup, register_in

ADV_ESTIMATORS: dict[str, Callable] = {}
ADV_ESTIMATOR_NEEDS: dict[str, frozenset[str]] = {}  # name -> its spec (see the module docstring)
# batch inputs a step produces only when something runs for them -> what produces them
PRODUCED_BY = {"values": "a critic (critic.enable=true)",
               "reward_baselines": "the baseline rollout (a greedy sample per prompt, scored; "
                                   "it runs for estimators that take reward_baselines)"}


class AdvantageEstimator:
    """The registered estimator names (string constants, usable as config values)."""
    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"


def register_adv_est(name: str, needs: Sequence[str] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register an advantage estimator under ``name`` (error if the name is
    taken), with its spec: ``needs``, the inputs of ``PRODUCED_BY`` it reads (default: its
    parameters without a default among them)."""
    unknown = sorted(set(needs or ()) - set(PRODUCED_BY))
    if unknown:
        raise ValueError(f"register_adv_est({name!r}, needs=...): {unknown} are not inputs a step "
                         f"can produce on request; choose among {sorted(PRODUCED_BY)}")
    add = register_in(ADV_ESTIMATORS, name, "advantage estimator")

    def decorator(fn: Callable) -> Callable:
        add(fn)
        ADV_ESTIMATOR_NEEDS[name] = (frozenset(needs) if needs is not None
                                     else needs_from_params(inspect.signature(fn).parameters.items()))
        return fn
    return decorator


def needs_from_params(params) -> frozenset[str]:
    """The spec read from a signature: ``(name, parameter)`` pairs whose parameter has no
    default, among ``PRODUCED_BY``."""
    return frozenset(p for p, v in params if p in PRODUCED_BY
                     and getattr(v, "default", inspect.Parameter.empty) is inspect.Parameter.empty)


def adv_estimator_needs(name: str) -> frozenset[str]:
    """The spec of the estimator ``name`` (registered, or a ``file.py:function`` read
    without running the file)."""
    from minihf.utils.imports import is_code_ref, ref_required_params

    if is_code_ref(name):
        return frozenset(ref_required_params(name) & set(PRODUCED_BY))
    get_adv_estimator_fn(name)  # unknown names list the registered ones
    return ADV_ESTIMATOR_NEEDS[name]


def get_adv_estimator_fn(name: str) -> Callable:
    """The estimator registered as ``name``; a ValueError listing the known names if none."""
    return lookup(ADV_ESTIMATORS, name, "advantage estimator", "register_adv_est")


def _group_ids(index: Sequence, bsz: int) -> torch.Tensor:
    """Dense group ids ``[B]`` (0, 1, ... in order of first appearance) from any hashables,
    or a tensor or array of ids (an element of which hashes by identity, not value: every
    row would be a group of its own)."""
    if isinstance(index, (torch.Tensor, np.ndarray)):
        index = index.tolist()
    if len(index) != bsz:
        raise ValueError(f"index has {len(index)} entries but the batch has {bsz} rows; "
                         "pass one group id (the prompt uid) per row")
    ids: dict = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in index], dtype=torch.long)


def _group_mean_std(scores: torch.Tensor, index: Sequence):
    """Per-row ``(mean, std, count)`` of the row's group, each ``[B]``.

    ``std`` is unbiased (``torch.std``). A group of one sample gets mean 0 and std 1, so its
    score passes through unchanged (verl's convention).
    """
    gid = _group_ids(index, scores.shape[0]).to(scores.device)          # [B]
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, gid, torch.ones_like(scores))            # [G]
    mean = zeros.index_add(0, gid, scores) / count                      # [G]
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]).square())     # [G]
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], count[gid]


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float, lam: float, whiten: bool = True):
    """Generalised advantage estimation (Schulman et al., 2016), backwards over the response.

    ``delta_t = r_t + gamma V_{t+1} - V_t``; ``A_t = delta_t + gamma lam A_{t+1}``, where
    ``t+1`` is the next *unmasked* position (0 past the end). ``returns = A + V`` before
    whitening; the advantages are then whitened over the mask (``whiten=False``: not, for a
    caller that combines several first) and zeroed outside it.
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)                           # [B, T]
        next_value = torch.zeros_like(values[:, 0])                     # [B]
        last_gae = torch.zeros_like(values[:, 0])                       # [B]
        advs = []
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            m = mask[:, t]
            next_value = m * values[:, t] + (1 - m) * next_value       # skip masked steps
            last_gae = m * gae + (1 - m) * last_gae
            advs.append(last_gae)
        advantages = torch.stack(advs[::-1], dim=-1)                    # [B, T]
        returns = advantages + values
        advantages = (masked_whiten(advantages, mask) if whiten else advantages) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: Sequence, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True):
    """GRPO (Shao et al., 2024): the sequence score normalised within its prompt's group.

    ``s_i = sum_t r_it``; ``A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)`` with the
    unbiased std of group ``g = index[i]``, or ``A_i = s_i - mean_g(s)`` when
    ``norm_adv_by_std_in_grpo=False`` (Dr.GRPO, Liu et al. 2025). A group of one has mean 0,
    std 1. ``A_i`` is broadcast over the response tokens; returns are the same tensor.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)                            # [B]
        mean, std, _ = _group_mean_std(scores, index)                   # [B]
        adv = scores - mean
        if norm_adv_by_std_in_grpo:
            adv = adv / (std + epsilon)
        advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)   # [B, T]
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index: Sequence, epsilon: float = 1e-6):
    """RLOO (Ahmadian et al., 2024): the score minus the mean score of the *other* samples.

    For a group of ``n > 1``: ``A_i = s_i - (sum_{j != i} s_j) / (n - 1)
    = (s_i - mean_g) n / (n - 1)``; a group of one has baseline 0 (``A_i = s_i``).
    ``epsilon`` is unused (kept for verl's signature). Returns ``(A, A)``.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)                            # [B]
        mean, _, count = _group_mean_std(scores, index)                 # [B]
        scale = count / (count - 1).clamp(min=1)
        adv = torch.where(count > 1, (scores - mean) * scale, scores)
        advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)   # [B, T]
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor,
                                                  response_mask: torch.Tensor, gamma: float):
    """REINFORCE++ (Hu, 2025): discounted return-to-go, whitened over the batch.

    ``G_t = r_t + gamma G_{t+1}`` over unmasked positions (masked ones are skipped);
    ``A = whiten_mask(G) * mask``. Returns ``(A, G)``.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)              # [B, T]
        running = torch.zeros_like(token_level_rewards[:, 0])           # [B]
        rets = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            m = mask[:, t]
            running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
            rets.append(running)
        returns = torch.stack(rets[::-1], dim=-1)                       # [B, T]
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
        epsilon: float = 1e-6):
    """REINFORCE++ with a group baseline: ``A = whiten_mask((s_i - mean_g(s)) * mask) * mask``.

    A group of one has mean 0. ``epsilon`` is unused (kept for verl's signature).
    Returns ``(A, A)``.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)                            # [B]
        mean, _, _ = _group_mean_std(scores, index)                     # [B]
        mask = response_mask.to(scores.dtype)                           # [B, T]
        adv = (scores - mean).unsqueeze(-1) * mask                      # [B, T]
        advantages = masked_whiten(adv, mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor):
    """ReMax (Li et al., 2024): return-to-go minus the greedy response's reward.

    ``G_t = sum_{t' >= t} m_t' r_t'``; ``A_t = (G_t - b) m_t`` with ``b = reward_baselines``
    ``[B]`` (the score of the greedy sample for the same prompt). Returns ``(A, G)``.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)              # [B, T]
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, T]
        advantages = (returns - reward_baselines.unsqueeze(-1)) * mask
    return advantages, returns
