"""On-policy distillation (Agarwal et al., 2024, GKD; Lu et al., 2025) as recipe files only.

The student samples; a teacher role (``roles.teacher``, a ``LogProbWorker`` on the
teacher's checkpoint) scores the student's own tokens; each token's reward is the
negative reverse-KL estimate ``log p_teacher(y_t) - log p_student(y_t)``, optionally
plus the task's score (``task_coef``) on the last token. The advantage of a token is its
own reward (no return-to-go: the teacher already judged every token, discount 0).

``OnPolicyDistill`` is the plug-in: the teacher's call goes alongside the reference's,
the rewards are set before the estimator runs (it wraps ``adv``); metrics
``distill/reverse_kl`` (mean over response tokens) and ``distill/teacher_log_prob``.
"""

from dataclasses import dataclass

import torch

from minihf.algorithms import masked_mean
from minihf.trainer.phases import Call, Plugin, alongside, wrap


@dataclass
class DistillConfig:
    kl_coef: float = 1.0                 # weight of the per-token teacher signal
    task_coef: float = 0.0               # weight of the task's score (on each response's last token)

    def __post_init__(self):
        if self.kl_coef < 0 or self.task_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} and task_coef={self.task_coef} must be >= 0")


class OnPolicyDistill(Plugin):
    name = "distill"
    Config = DistillConfig

    def hooks(self):
        return [alongside("ref", Call("teacher", "teacher", "compute_log_prob")),
                wrap("adv", self.rewards)]

    def rewards(self, ctx, batch, m, inner):
        if "teacher" not in ctx.groups:
            raise ValueError("OnPolicyDistill needs a roles.teacher section (its model.path: the teacher)")
        mask = batch["response_mask"]
        # the student's log-probs: the recomputed old ones, else the engine's (equal to ~1e-6 in fp32)
        student = batch["old_log_probs"] if "old_log_probs" in batch.tensors else batch["rollout_log_probs"]
        teacher = batch["teacher_log_prob"]
        reverse_kl = (student - teacher) * mask
        scores = batch["token_level_scores"]
        batch.tensors["token_level_scores"] = (self.config.task_coef * scores
                                               - self.config.kl_coef * reverse_kl)
        m["distill/reverse_kl"] = masked_mean(reverse_kl, mask).item()
        m["distill/teacher_log_prob"] = masked_mean(teacher, mask).item()
        inner(ctx, batch, m)
        batch.tensors["token_level_scores"] = scores  # the task's, for the logged score metrics


def per_token(token_level_rewards: torch.Tensor, response_mask: torch.Tensor):
    """Each token's advantage is its own reward (discount 0); returns ``(A, A)``."""
    adv = token_level_rewards * response_mask
    return adv, adv
