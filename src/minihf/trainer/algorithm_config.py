"""The RL job's ``algorithm`` section (verl's names): the advantage estimator, discount,
in-reward KL and its controller, DAPO's dynamic sampling, Safe-RLHF's constraint, rollout
correction, and a recipe's plug-ins with their settings. ``PPOConfig`` holds it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from minihf.algorithms.kl import KL_PENALTIES


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"  # fixed | adaptive (in-reward KL coefficient)
    kl_coef: float = 0.001               # initial in-reward KL coefficient
    target_kl: float = 0.1               # adaptive only
    horizon: int = 10000                 # adaptive only

    def __post_init__(self):
        if not self.kl_coef >= 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef={self.kl_coef} must be >= 0")
        if not self.target_kl > 0 or self.horizon < 1:
            raise ValueError(f"algorithm.kl_ctrl: target_kl={self.target_kl} must be > 0 and "
                             f"horizon={self.horizon} >= 1")
        if self.type == "adaptive" and self.kl_coef == 0:
            raise ValueError("algorithm.kl_ctrl.type=adaptive with kl_coef=0 never moves (each update "
                             "multiplies the coefficient); start it above 0 (e.g. 0.001), or use type=fixed")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: keep only prompts whose samples do not all score the same
    (their GRPO advantages would be 0), generating more rounds until ``train_batch_size``
    prompts remain."""
    enable: bool = False                 # drop groups whose n sequence scores are all equal
    max_num_gen_batches: int = 10        # generation rounds per step at most (then an error); 0: no limit

    def __post_init__(self):
        if self.max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches} "
                             "must be >= 0 (0: no limit)")


@dataclass
class SafeConfig:
    """Safe-RLHF (Dai et al., 2023): maximise the reward subject to ``mean episode cost <=
    cost_limit``, with a cost model or function, a cost critic and a Lagrange multiplier
    (``minihf.algorithms.safe``; the plug-in ``minihf.trainer.plugins.safe``). Needs an
    estimator that reads values (``gae``)."""
    enable: bool = False                 # score costs, train a cost critic, combine advantages with lambda
    cost_limit: float = 0.0              # bound on the mean episode cost (Safe-RLHF's threshold)
    lambda_init: float = 1.0             # the Lagrange multiplier's start
    lambda_lr: float = 0.1               # lambda += lambda_lr * (mean cost - cost_limit), each step
    lambda_max: Optional[float] = None   # cap on lambda; null: none
    lambda_update_delay_steps: int = 0   # steps before lambda starts to move

    def __post_init__(self):
        from minihf.algorithms import LagrangeMultiplier

        LagrangeMultiplier(self.lambda_init, self.lambda_lr, self.cost_limit, self.lambda_max)  # checks
        if self.lambda_update_delay_steps < 0:
            raise ValueError(f"lambda_update_delay_steps={self.lambda_update_delay_steps} must be >= 0")


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` (decoupled mode: the trainer's recomputed old
    log-probs against the engine's), formulas in ``minihf.algorithms.rollout_correction``.
    Off unless ``rollout_is`` or ``rollout_rs`` is set; the ``rollout_corr/*`` off-policy
    figures are logged whenever the old log-probs are recomputed."""
    rollout_is: Optional[str] = None     # importance weights: null (off) | token | sequence
    rollout_is_threshold: Union[float, str] = 2.0  # cap C: min(w, C); or 'lower_upper': zero outside (IcePop)
    rollout_is_batch_normalize: bool = False  # divide the capped weights by their batch mean
    rollout_rs: Optional[str] = None     # rejection: null | token_k1 | seq_mean_k1 | seq_max_k3 | ... (comma-separated)
    rollout_rs_threshold: Optional[str] = None  # per option: 'lower_upper' for k1 (e.g. 0.5_2.0), an upper bound for k2/k3

    def __post_init__(self):
        from minihf.algorithms.rollout_correction import IS_LEVELS, parse_is_threshold, parse_rs_options

        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is={self.rollout_is!r}; choose one of {list(IS_LEVELS)} "
                             "or null (off)")
        parse_is_threshold(self.rollout_is_threshold)                   # raises naming the value
        if self.rollout_rs_threshold is not None:
            self.rollout_rs_threshold = str(self.rollout_rs_threshold)
        parse_rs_options(self.rollout_rs, self.rollout_rs_threshold)   # raises naming the value
        unused = [(key, "rollout_is") for key in ("rollout_is_threshold", "rollout_is_batch_normalize")
                  if self.rollout_is is None and getattr(self, key) != getattr(RolloutCorrectionConfig, key)]
        if self.rollout_rs is None and self.rollout_rs_threshold is not None:
            unused.append(("rollout_rs_threshold", "rollout_rs"))
        for key, switch in unused:
            warnings.warn(f"algorithm.rollout_correction.{key} is set but {switch} is null (off), so it does "
                          f"nothing; set algorithm.rollout_correction.{switch} to use it", stacklevel=2)

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"           # gae | grpo | rloo | reinforce_plus_plus | ... (registry)
    gamma: float = 1.0                   # discount (GAE, REINFORCE++)
    lam: float = 1.0                     # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # divide group advantages by their std (false: Dr.GRPO)
    use_kl_in_reward: bool = False       # subtract kl_ctrl * KL(policy || ref) from the token rewards
    kl_penalty: str = "kl"               # estimator of the in-reward KL
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    safe: SafeConfig = field(default_factory=SafeConfig)  # Safe-RLHF's cost constraint
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    plugins: list[str] = field(default_factory=list)  # a recipe's plug-ins: file.py:Class (minihf.trainer.phases.Plugin)
    plugin_config: dict[str, dict] = field(default_factory=dict)  # plug-in name -> its settings (checked against its Config)

    def __post_init__(self):
        from minihf.algorithms import get_adv_estimator_fn
        from minihf.utils.imports import check_name_or_ref, check_ref

        check_name_or_ref(self.adv_estimator, get_adv_estimator_fn, "advantage estimator")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algorithm.{name}={getattr(self, name)} must be in [0, 1]")
        for i, ref in enumerate(self.plugins):
            try:
                check_ref(ref, "plug-in class")
            except (FileNotFoundError, AttributeError, ValueError) as e:
                raise ValueError(f"algorithm.plugins[{i}]={ref!r}: {e}") from None
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(f"algorithm.kl_penalty={self.kl_penalty!r}; choose one of "
                             f"{list(KL_PENALTIES)}")
