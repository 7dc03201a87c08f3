"""minihf.algorithms: pure tensor functions for RL losses (no distributed code).

Names and argument order follow verl's ``core_algos`` so recipes read the same.
"""

from minihf.algorithms.kl import kl_penalty
from minihf.algorithms.logprob import entropy_from_logits, logprobs_from_logits
from minihf.algorithms.loss_agg import LOSS_AGG_MODES, agg_loss, loss_normalizer, masked_mean
from minihf.algorithms.policy_loss import compute_policy_loss
from minihf.algorithms.value_loss import compute_value_loss

__all__ = [
    "LOSS_AGG_MODES", "agg_loss", "compute_policy_loss", "compute_value_loss",
    "entropy_from_logits", "kl_penalty", "logprobs_from_logits", "loss_normalizer",
    "masked_mean",
]
