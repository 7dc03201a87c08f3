"""``LogProbWorker``: a frozen causal LM that scores the response tokens, inference only.

``compute_log_prob(batch) -> Batch{<role>_log_prob}`` (DP_COMPUTE): the log-probs ``[B, R]``
of each response token under this model, at ``batch.meta["temperature"]`` (default 1.0,
as the actor's), zero under the mask's pads; the key carries the role's name
(``teacher_log_prob`` for a role ``teacher``), so several such roles can score one batch.
It reads the actor's token ids, so it must share the actor's tokenizer. A recipe's role
section (``roles.<name>``, ``minihf.trainer.role_section.RoleSection``) builds it by default.
"""

from __future__ import annotations

from minihf.controller import Dispatch, register
from minihf.protocol import Batch
from minihf.workers.engine import run_micro_batches, tensors_of
from minihf.workers.frozen import FrozenModelWorker
from minihf.workers.forward import forward_log_probs

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class LogProbWorker(FrozenModelWorker):
    head = "lm"

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def compute_log_prob(self, batch: Batch) -> Batch:
        self.built()
        c = self.config
        data = tensors_of(batch, INPUT_KEYS, self.device)
        temperature = float(batch.meta.get("temperature", 1.0))
        share, rmpad = c.model.shares_prompt, c.model.use_remove_padding

        def fn(mb):
            return forward_log_probs(self.model, mb, use_remove_padding=rmpad, share_prompt=share,
                                     temperature=temperature, logits_chunk=c.logits_chunk_size)
        out = run_micro_batches(data, fn, micro_batch_size=c.log_prob_micro_batch_size_per_gpu,
                                max_tokens=c.max_tokens_per_micro_batch, group=self.group,
                                model=self.model, share_prompt=share)
        return Batch({f"{self.role}_log_prob": out["log_probs"].cpu()})
