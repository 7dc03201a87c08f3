"""``RewardModelWorker``: a learned reward model (``ScoreModel``), inference only.

``compute_rm_score(batch) -> Batch{rm_scores}`` (DP_COMPUTE): the score head's output at
the last real token of each sequence, placed at the last response token of a ``[B, R]``
tensor (zeros elsewhere), verl's ``rm_scores`` layout; the driver adds it to (or uses it
as) ``token_level_scores``. The RM reads the actor's token ids, so it must share the
actor's tokenizer.
"""

from __future__ import annotations

from minihf.controller import Dispatch, register
from minihf.protocol import Batch
from minihf.workers.engine import run_micro_batches, tensors_of
from minihf.workers.frozen import FrozenModelWorker
from minihf.workers.forward import forward_scores

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


class RewardModelWorker(FrozenModelWorker):
    head = "score"

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def compute_rm_score(self, batch: Batch) -> Batch:
        self.built()
        c = self.config
        data = tensors_of(batch, INPUT_KEYS, self.device)

        share = c.model.shares_prompt

        def fn(mb):
            return {"rm_scores": forward_scores(self.model, mb, share_prompt=share,
                                                use_remove_padding=c.model.use_remove_padding)}
        out = run_micro_batches(data, fn, micro_batch_size=c.micro_batch_size_per_gpu,
                                max_tokens=c.max_tokens_per_micro_batch, group=self.group,
                                model=self.model, share_prompt=share)
        return Batch({"rm_scores": out["rm_scores"].cpu()})
