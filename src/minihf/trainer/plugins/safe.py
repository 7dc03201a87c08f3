"""Safe-RLHF as a plug-in (``algorithm.safe``; ``minihf.algorithms.safe`` has the math).

Roles: ``cost_critic`` (a ``CriticWorker`` that reads ``cost_values`` / ``cost_returns`` as
its ``values`` / ``returns`` and answers ``cost_values`` and ``cost_critic/*``, through the
role table's renaming) and, with ``cost_model.enable``, ``cost_model``. Each step:

    costs: the cost model's score (or the rule cost function) at the last token -> cost (after reward)
    cost values: the cost critic                                                -> cost_values (alongside values)
    cost advantages: GAE on the costs (+ the in-reward KL, see ``advantages``)  -> in adv (wraps it)
    lambda: one projected step on ``mean episode cost - cost_limit``            -> in adv
    advantages = whiten((A_r - lambda A_c) / (1 + lambda)) for the actor update (A unwhitened)
    cost critic update on the cost returns                                    -> update_cost_critic (alongside update_critic)

Metrics: ``safe/lambda`` (the value the step's advantages used), ``safe/cost/mean`` (mean
episode cost, what the constraint bounds), ``safe/cost_violation`` (mean cost - limit),
``cost_critic/*``; validation adds ``val-core/<source>/cost/mean@k`` and ``val-core/cost``
from the rule cost function. State: the Lagrange multiplier.
"""

from __future__ import annotations

from minihf.algorithms import (LagrangeMultiplier, combine_safe_advantages, compute_gae_advantage_return,
                               masked_whiten)
from minihf.protocol import Batch
from minihf.trainer.phases import Call, Phase, Plugin, StepContext, after, alongside, wrap
from minihf.trainer.reward import RuleReward
from minihf.roles import SAFE_ROLES


class SafeRLHF(Plugin):
    """Costs, the cost critic and the Lagrange multiplier."""
    name = "safe_rlhf"
    roles = SAFE_ROLES  # declared in minihf.roles, where the planner sees them too

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.algorithm.safe.enable

    @classmethod
    def check_config(cls, cfg) -> None:
        """The cost critic runs with algorithm.safe (its model: the reward critic's by default);
        the cost sections need the switch, and Safe-RLHF needs a critic-reading estimator."""
        safe = cfg.algorithm.safe.enable
        if cfg.cost_critic.enable is None:
            cfg.cost_critic.enable = safe
        for key, on in (("cost_model.enable", cfg.cost_model.enable),
                        ("cost_critic.enable", cfg.cost_critic.enable)):
            if on and not safe:
                raise ValueError(f"{key}=true needs algorithm.safe.enable=true")
        if not safe:
            return
        if cfg.algorithm.adv_estimator != "gae":
            raise ValueError(f"algorithm.safe combines the reward's and the cost's GAE advantages (a reward "
                             f"critic beside the cost critic) before whitening them: set adv_estimator=gae, not "
                             f"{cfg.algorithm.adv_estimator!r}")
        if not cfg.cost_critic.enable:
            raise ValueError("algorithm.safe needs the cost critic; drop cost_critic.enable=false")
        if cfg.cost_model.enable and not cfg.cost_model.model.path:
            raise ValueError("cost_model.enable=true needs cost_model.model.path (a score-head "
                             "model dir from `minihf rm` on cost pairs)")
        if not cfg.cost_critic.model.path:
            cfg.cost_critic.model.path = cfg.critic.model.path

    def __init__(self, ctx: StepContext):
        from minihf.data import default_cost_fn, load_reward_fn

        super().__init__(ctx)
        self.cfg, self.s = ctx.cfg, ctx.cfg.algorithm.safe
        c = ctx.cfg.custom_cost_function
        self.rule = RuleReward(load_reward_fn(c.path, c.name) if c.path else default_cost_fn,
                               ctx.tokenizer, c.skip_special_tokens, c.timeout_s, c.on_timeout)
        self.lagrange = LagrangeMultiplier(self.s.lambda_init, self.s.lambda_lr, self.s.cost_limit,
                                           self.s.lambda_max)

    def hooks(self):
        return [after("reward", Phase("cost", self.score)),
                alongside("values", Call("cost_values", "cost_critic", "compute_values")),
                wrap("adv", self.combine),
                alongside("update_critic", Call("update_cost_critic", "cost_critic", "update_critic"))]

    def score(self, ctx: StepContext, batch: Batch, m: dict) -> None:
        """Token-level costs ``[B, R]`` (cost model, else the rule) into ``batch``."""
        model = ctx.groups.get("cost_model")
        if model is not None:
            batch.tensors["token_level_costs"] = model.compute_rm_score(batch)["rm_scores"]  # [B, R]
            return
        batch.tensors["token_level_costs"], metrics, _ = self.rule(batch)
        m.update({k.replace("reward_extra/", "cost_extra/"): v for k, v in metrics.items()})

    def combine(self, ctx: StepContext, batch: Batch, m: dict, inner) -> None:
        inner(ctx, batch, m)
        m.update(self.advantages(batch, ctx.step))

    def advantages(self, batch: Batch, step: int) -> dict:
        """Replace ``batch["advantages"]`` (the reward's GAE, whitened) by the combined ones;
        add ``cost_advantages`` / ``cost_returns``; step lambda.

        The reward's and the cost's GAE advantages are combined as they are, in the units of
        reward and cost, and the result whitened once (Safe-RLHF combines unwhitened ones).
        Whitening each first would weigh the cost by ``lambda * std_r / std_c``: lambda would
        no longer be the constraint's multiplier. With the in-reward KL the costs get
        ``+ beta * kl`` (the reward got ``- beta * kl``), as in Safe-RLHF, so the combined
        advantage carries the KL penalty at ``beta`` whatever lambda is."""
        costs = batch["token_level_costs"]
        if self.cfg.algorithm.use_kl_in_reward:
            costs = costs + (batch["token_level_scores"] - batch["token_level_rewards"])  # + beta*kl
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        reward_adv, _ = compute_gae_advantage_return(batch["token_level_rewards"], batch["values"], mask,
                                                     alg.gamma, alg.lam, whiten=False)
        cost_adv, cost_ret = compute_gae_advantage_return(costs, batch["cost_values"], mask, alg.gamma, alg.lam,
                                                          whiten=False)
        batch.tensors["cost_advantages"], batch.tensors["cost_returns"] = cost_adv, cost_ret
        mean_cost = batch["token_level_costs"].sum(-1).mean().item()
        lam = self.lagrange.value
        if step > self.s.lambda_update_delay_steps:
            self.lagrange.update(mean_cost)
        combined = combine_safe_advantages(reward_adv, cost_adv, lam)
        batch.tensors["advantages"] = masked_whiten(combined, mask.to(combined.dtype)) * mask
        return {"safe/lambda": lam, "safe/cost/mean": mean_cost,
                "safe/cost_violation": mean_cost - self.s.cost_limit}

    def validate(self, out: Batch) -> dict[str, list[float]]:
        """The rule costs of validation responses (one per row)."""
        return {"cost": self.rule(out)[2]}

    def state_dict(self) -> dict:
        return {"lagrange": self.lagrange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.lagrange.load_state_dict(state["lagrange"])
