"""Top-k logit distillation (GKD-style, Agarwal et al., 2024) as recipe files only.

The student samples. A teacher role (``TopKTeacher``, a ``LogProbWorker`` with one more
method) returns, at each of the student's response positions, its ``top_k`` most likely
tokens and their log-probs (``teacher_top_k_ids``, ``teacher_top_k_log_probs``
``[B, R, k]``). The actor's auxiliary loss ``top_k_kl`` reads the student's log-probs at those
ids from the update's own forward (``aux_losses.gkd.log_probs_at``) and minimises the forward
KL from the teacher's distribution, restricted to its top k and renormalised there:

    KL_t = sum_i q_i (log q_i - log s_i),   q = softmax(teacher log-probs over the k ids),
                                           s = softmax(student log-probs over the same ids)

per response token, aggregated as the policy loss is (``agg_loss``). No reward drives the
student: ``no_advantage`` gives zero advantages, so the policy-gradient term is zero and the
update is pure distillation on the student's own samples (on-policy).
"""

import torch

from minihf.algorithms import agg_loss, masked_mean
from minihf.controller import Dispatch, register
from minihf.protocol import Batch
from minihf.trainer.phases import Call, Plugin, alongside
from minihf.workers import LogProbWorker
from minihf.workers.engine import run_micro_batches, tensors_of
from minihf.workers.forward import forward_log_probs

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class TopKTeacher(LogProbWorker):
    """The teacher's ``options.top_k`` most likely tokens at each response position."""

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def compute_top_k(self, batch: Batch) -> Batch:
        self.built()
        c, k = self.config, int(self.config.options.get("top_k", 8))
        temperature = float(batch.meta.get("temperature", 1.0))

        def fn(mb):
            out = forward_log_probs(self.model, mb, use_remove_padding=c.model.use_remove_padding,
                                    temperature=temperature, logits_chunk=c.logits_chunk_size, top_k=k)
            return {"top_k_ids": out["top_k_ids"], "top_k_log_probs": out["top_k_log_probs"]}
        out = run_micro_batches(tensors_of(batch, INPUT_KEYS, self.device), fn,
                                micro_batch_size=c.log_prob_micro_batch_size_per_gpu,
                                max_tokens=c.max_tokens_per_micro_batch, group=self.group, model=self.model)
        return Batch({f"{self.role}_top_k_ids": out["top_k_ids"].cpu(),
                      f"{self.role}_top_k_log_probs": out["top_k_log_probs"].cpu()})


class TopKDistill(Plugin):
    """Asks the teacher alongside the reference (before the update)."""
    name = "gkd"

    def hooks(self):
        if "teacher" not in self.ctx.cfg.roles:
            raise ValueError("gkd needs a roles.teacher section (worker gkd.py:TopKTeacher, model.path)")
        return [alongside("ref", Call("teacher", "teacher", "compute_top_k"))]


def top_k_kl(log_probs_at, teacher_top_k_log_probs, response_mask, loss_agg_mode, normalizer, options):
    """The forward KL over the teacher's top k (renormalised on both sides), per token."""
    teacher = torch.log_softmax(teacher_top_k_log_probs, -1)        # [b, R, k]
    student = torch.log_softmax(log_probs_at, -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)              # [b, R]
    covered = teacher_top_k_log_probs.exp().sum(-1)                 # the teacher's mass in its top k
    return (agg_loss(kl, response_mask, loss_agg_mode, normalizer),
            {"kl": masked_mean(kl.detach(), response_mask), "teacher_mass": masked_mean(covered, response_mask)})


def no_advantage(response_mask):
    """Zero advantages: the task's reward is only logged."""
    zero = torch.zeros_like(response_mask, dtype=torch.float32)
    return zero, zero
