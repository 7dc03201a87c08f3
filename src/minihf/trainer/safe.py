"""The driver's Safe-RLHF part (``algorithm.safe``; ``minihf.algorithms.safe`` has the math).

Next to the reward path of the PPO loop, each step:

    costs: the cost model's score (or the rule cost function) at the last token -> cost
    cost values: the cost critic (a ``CriticWorker`` reading cost keys)          -> cost_values
    cost advantages: GAE on the costs (+ the in-reward KL, see ``advantages``)  -> in adv
    lambda: one projected step on ``mean episode cost - cost_limit``            -> in adv
    advantages = (A_r - lambda A_c) / (1 + lambda) for the actor update
    cost critic update on the cost returns                                    -> update_cost_critic

Metrics: ``safe/lambda`` (the value the step's advantages used), ``safe/cost/mean`` (mean
episode cost, what the constraint bounds), ``safe/cost_violation`` (mean cost - limit),
``cost_critic/*``; validation adds ``val-core/<source>/cost/mean@k`` and ``val-core/cost``
from the rule cost function. The cost critic's ``values`` / ``returns`` keys are renamed
on the way in and out, so the critic worker is the reward critic's class unchanged.
"""

from __future__ import annotations

from minihf.algorithms import LagrangeMultiplier, combine_safe_advantages, compute_gae_advantage_return
from minihf.protocol import Batch
from minihf.trainer.reward import RuleReward


class _Mapped:
    """A future whose result goes through ``fn``."""

    def __init__(self, future, fn):
        self.future, self.fn = future, fn

    def result(self):
        return self.fn(self.future.result())


class _CostCall:
    """A cost-critic method called on the batch with ``cost_values`` / ``cost_returns`` as
    the critic's ``values`` / ``returns``; ``out`` maps the result back. Callable like a
    remote method, with ``.future``."""

    def __init__(self, method, out):
        self.method, self.out = method, out

    @staticmethod
    def _in(batch: Batch) -> Batch:
        tensors = dict(batch.tensors)
        for key in ("values", "returns"):
            tensors.pop(key, None)
            if f"cost_{key}" in tensors:
                tensors[key] = tensors[f"cost_{key}"]
        return Batch(tensors, batch.non_tensors, batch.meta)

    def __call__(self, batch: Batch):
        return self.out(self.method(self._in(batch)))

    def future(self, batch: Batch) -> _Mapped:
        return _Mapped(self.method.future(self._in(batch)), self.out)


class SafeRLHF:
    """Costs, the cost critic and the Lagrange multiplier for ``PPOTrainer``."""

    def __init__(self, cfg, groups: dict, tokenizer):
        from minihf.data import default_cost_fn, load_reward_fn

        self.cfg, self.s = cfg, cfg.algorithm.safe
        self.critic = groups["cost_critic"]
        self.model = groups.get("cost_model")
        c = cfg.custom_cost_function
        self.rule = RuleReward(load_reward_fn(c.path, c.name) if c.path else default_cost_fn,
                               tokenizer, c.skip_special_tokens, c.timeout_s, c.on_timeout)
        self.lagrange = LagrangeMultiplier(self.s.lambda_init, self.s.lambda_lr, self.s.cost_limit,
                                           self.s.lambda_max)

    def init_model(self, critic_optimizer_steps: int) -> None:
        self.critic.init_model(critic_optimizer_steps)
        if self.model is not None:
            self.model.init_model()

    def score(self, batch: Batch) -> dict:
        """Token-level costs ``[B, R]`` (cost model, else the rule) into ``batch``; metrics."""
        if self.model is not None:
            batch.tensors["token_level_costs"] = self.model.compute_rm_score(batch)["rm_scores"]  # [B, R]
            return {}
        batch.tensors["token_level_costs"], metrics, _ = self.rule(batch)
        return {k.replace("reward_extra/", "cost_extra/"): v for k, v in metrics.items()}

    def values_call(self) -> tuple[str, _CostCall]:
        return "cost_values", _CostCall(self.critic.compute_values,
                                        lambda out: Batch({"cost_values": out["values"]}))

    def update_call(self) -> tuple[str, _CostCall]:
        return "update_cost_critic", _CostCall(
            self.critic.update_critic,
            lambda out: {k.replace("critic/", "cost_critic/", 1): v for k, v in out.items()})

    def advantages(self, batch: Batch, step: int) -> dict:
        """Replace ``batch["advantages"]`` (the reward's) by the combined ones; add
        ``cost_advantages`` / ``cost_returns``; step lambda. With the in-reward KL the costs
        get ``+ beta * kl`` (the reward got ``- beta * kl``), as in Safe-RLHF, so the combined
        advantage carries the KL penalty at ``beta`` whatever lambda is."""
        costs = batch["token_level_costs"]
        if self.cfg.algorithm.use_kl_in_reward:
            costs = costs + (batch["token_level_scores"] - batch["token_level_rewards"])  # + beta*kl
        alg = self.cfg.algorithm
        cost_adv, cost_ret = compute_gae_advantage_return(costs, batch["cost_values"], batch["response_mask"],
                                                          alg.gamma, alg.lam)
        batch.tensors["cost_advantages"], batch.tensors["cost_returns"] = cost_adv, cost_ret
        mean_cost = batch["token_level_costs"].sum(-1).mean().item()
        lam = self.lagrange.value
        if step > self.s.lambda_update_delay_steps:
            self.lagrange.update(mean_cost)
        batch.tensors["advantages"] = combine_safe_advantages(batch["advantages"], cost_adv, lam)
        return {"safe/lambda": lam, "safe/cost/mean": mean_cost,
                "safe/cost_violation": mean_cost - self.s.cost_limit}

    def validate(self, out: Batch) -> list[float]:
        """The rule costs of validation responses (one per row)."""
        return self.rule(out)[2]

    def save(self, path) -> None:
        self.critic.save_checkpoint(str(path / "cost_critic"))

    def load(self, path) -> None:
        self.critic.load_checkpoint(str(path / "cost_critic"))
