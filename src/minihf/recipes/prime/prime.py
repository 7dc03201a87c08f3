"""PRIME (Cui et al., 2025) as recipe files: process rewards from an implicit PRM trained online.

The PRM (``ImplicitPRM``, a ``TrainedRoleWorker``: a role with its own optimizer, checkpointed
and resumed with the run) is a causal LM ``pi_phi`` whose reference is the actor's
(``ref_log_prob``, the SFT warm start). At response token ``t`` its process reward is

    r_t = beta (log pi_phi(y_t) - log pi_ref(y_t)),

and ``sum_t r_t`` is its logit that the response is correct, trained with the cross-entropy
against the task's score (in [0, 1]; a soft label for partial credit). Each step the plug-in
(``ImplicitProcessRewards``, wrapping the ``adv`` phase):

1. updates the PRM on the step's samples (``prm/loss``, ``prm/acc``: the share whose logit's
   sign agrees with a score above 0.5);
2. scores the samples with the updated PRM (``prm_log_prob``) and forms ``r_t``. This is
   verl's PRIME default (``update: before``); ``update: after`` scores first, so the rewards
   come from a PRM that has not seen these samples' outcomes (one forward fewer);
3. lets the estimator (RLOO) make the outcome advantage, then adds ``process_coef`` x the
   process return ``sum_{s >= t} (r_s - b)``, where the leave-one-out baseline ``b`` is the
   mean over the prompt's other samples of their mean process reward per token.
"""

from dataclasses import dataclass

import numpy as np
import torch.nn.functional as F

from minihf.algorithms import compute_rloo_outcome_advantage, masked_mean
from minihf.trainer.phases import Plugin, wrap
from minihf.workers import TrainedRoleWorker


class ImplicitPRM(TrainedRoleWorker):
    update_keys = ("ref_log_prob", "token_level_scores")

    def loss(self, mb, log_prob, agg):
        beta = float(self.config.options.get("beta", 0.05))
        mask = mb["response_mask"].float()
        logit = beta * ((log_prob - mb["ref_log_prob"]) * mask).sum(-1)     # [b]
        label = mb["token_level_scores"].sum(-1).clamp(0, 1)
        ce = F.binary_cross_entropy_with_logits(logit, label, reduction="none")
        acc = ((logit > 0) == (label > 0.5)).float().mean()
        return agg(ce[:, None].expand_as(mask)), {"acc": acc, "logit": logit.mean()}


@dataclass
class PrimeConfig:
    process_coef: float = 1.0           # weight of the process advantage beside the outcome's
    update: str = "before"              # the PRM's update: before scoring the step's samples, or after

    def __post_init__(self):
        if self.update not in ("before", "after"):
            raise ValueError(f"update={self.update!r}; choose before or after")


class ImplicitProcessRewards(Plugin):
    name = "prime"
    Config = PrimeConfig

    def hooks(self):
        cfg = self.ctx.cfg
        prm = cfg.roles.get("prm")
        if prm is None or not prm.train.enable:
            raise ValueError("prime needs a trained roles.prm section (worker prime.py:ImplicitPRM, "
                             "train.enable: true)")
        if not cfg.use_ref:
            raise ValueError("prime reads the reference's log-probs: set actor_rollout_ref.actor.use_kl_loss "
                             "or algorithm.use_kl_in_reward")
        self.beta = float(prm.options.get("beta", 0.05))
        return [wrap("adv", self.process_advantage)]

    def process_advantage(self, ctx, batch, metrics, inner):
        prm = ctx.groups["prm"]
        for step in (("update", "score") if self.config.update == "before" else ("score", "update")):
            if step == "update":
                with ctx.timed("update_prm"):
                    metrics.update(prm.update(batch))
            else:
                with ctx.timed("prm"):
                    batch |= prm.compute_log_prob(batch)
        inner(ctx, batch, metrics)                                          # the outcome advantage
        mask = batch["response_mask"].float()
        r = self.beta * (batch["prm_log_prob"] - batch["ref_log_prob"]) * mask
        per_token = r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)   # [B, 1]
        # RLOO's advantage is x minus the mean of the prompt's other rows (x alone): b = x - A
        loo, _ = compute_rloo_outcome_advantage(per_token, per_token.new_ones(per_token.shape),
                                                np.asarray(batch.non_tensors["uid"], dtype=object))
        b = (per_token - loo)[:, 0]
        centred = (r - b[:, None]) * mask
        returns = centred.flip(-1).cumsum(-1).flip(-1)                      # sum_{s >= t} (r_s - b)
        batch.tensors["advantages"] = batch["advantages"] + self.config.process_coef * returns * mask
        metrics["prm/process_reward/mean"] = masked_mean(r, mask).item()
        metrics["prm/outcome_logit/mean"] = r.sum(-1).mean().item()
