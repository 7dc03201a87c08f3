"""minihf.algorithms: pure tensor functions for RL losses (no distributed code).

Names and argument order follow verl's ``core_algos`` so recipes read the same.
"""

from minihf.algorithms.advantage import (
    ADV_ESTIMATOR_NEEDS, ADV_ESTIMATORS, PRODUCED_BY, AdvantageEstimator, adv_estimator_needs, compute_gae_advantage_return,
    compute_grpo_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage, get_adv_estimator_fn, register_adv_est)
from minihf.algorithms.kl import kl_penalty
from minihf.algorithms.kl_ctrl import (AdaptiveKLController, FixedKLController, KLController,
                                       apply_kl_penalty)
from minihf.algorithms.logprob import (LOGPROB_ROUNDING_MULTIPLE, entropy_from_logits,
                                       logit_abs_scale, logprob_rounding_bound,
                                       logprobs_from_logits)
from minihf.algorithms.loss_agg import (LOSS_AGG_MODES, agg_loss, last_index, loss_normalizer, masked_mean,
                                        masked_var, masked_whiten)
from minihf.algorithms.policy_loss import (POLICY_LOSSES, compute_policy_loss,
                                           compute_policy_loss_gspo, get_policy_loss_fn,
                                           register_policy_loss, vanilla_policy_loss)
from minihf.algorithms.safe import LagrangeMultiplier, combine_safe_advantages
from minihf.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_NEEDS", "ADV_ESTIMATORS", "PRODUCED_BY", "adv_estimator_needs", "AdaptiveKLController", "LOGPROB_ROUNDING_MULTIPLE", "AdvantageEstimator", "FixedKLController",
    "KLController", "LOSS_AGG_MODES", "LagrangeMultiplier", "POLICY_LOSSES", "agg_loss",
    "apply_kl_penalty", "combine_safe_advantages", "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage", "compute_policy_loss", "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_value_loss", "entropy_from_logits",
    "get_adv_estimator_fn", "get_policy_loss_fn", "kl_penalty", "logit_abs_scale", "logprob_rounding_bound", "logprobs_from_logits",
    "last_index", "loss_normalizer", "masked_mean", "masked_var", "masked_whiten", "register_adv_est",
    "register_policy_loss", "vanilla_policy_loss",
]
