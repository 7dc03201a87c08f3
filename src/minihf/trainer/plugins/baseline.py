"""ReMax's baseline rollout (Li et al., 2024), for any estimator whose spec reads
``reward_baselines`` (``minihf.algorithms.adv_estimator_needs``).

Before each round's ``gen``, phase ``gen_max``: one greedy response per prompt, scored as
the samples are (the ``reward`` phase with its wrappers, e.g. DAPO's overlong penalty).
Each of the prompt's ``rollout.n`` samples carries that score as ``reward_baselines``.
"""

from __future__ import annotations

from minihf.protocol import Batch
from minihf.trainer.phases import Phase, Plugin, StepContext, before


class RewardBaseline(Plugin):
    name = "reward_baseline"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return "reward_baselines" in cfg.adv_needs

    def hooks(self):
        return [before("gen", Phase("gen_max", self.greedy_scores))]

    @staticmethod
    def greedy_scores(ctx: StepContext, prompts: Batch, metrics: dict) -> None:
        """``reward_baselines`` [P] on the prompts; ``gen`` repeats it with the prompts."""
        greedy, _ = ctx.generate(prompts, {"global_step": ctx.step, "do_sample": False})
        prompts.tensors["reward_baselines"] = ctx.score(greedy)[0].sum(-1)
