"""``SFTWorker``: supervised fine-tuning of a causal LM on FSDP2 (loss on response tokens).

The driver (``minihf.trainer.sft``) owns the data and the loop; this worker runs
``train_step`` (one optimizer step on a global batch, exact token-mean over every rank's
response tokens), ``eval_step`` (summed NLL and token count, so the driver can form the
exact validation mean; it pads with loss-free rows) and checkpoints. Both dispatch
DP_COMPUTE_EXACT: a batch must split evenly over the DP ranks, no row is repeated.
"""

from __future__ import annotations

import torch

from minihf.algorithms import agg_loss
from minihf.controller import Dispatch, Worker, register
from minihf.protocol import Batch
from minihf.workers.optim import OptimConfig
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.engine import prefixed, tensors_of
from minihf.workers.forward import forward_token_log_probs
from minihf.workers.train_state import TrainState
from minihf.workers.train_step import all_reduce_, global_normalizer, plan_micro_batches, take_rows

KEYS = ("input_ids", "attention_mask", "position_ids", "loss_mask")


class SFTWorker(Worker):
    def __init__(self, model: ModelConfig, optim: OptimConfig, fsdp: FSDPConfig,
                 micro_batch_size_per_gpu: int | None, max_tokens_per_micro_batch: int | None):
        super().__init__()
        self.model_cfg, self.optim_cfg, self.fsdp_cfg = model, optim, fsdp
        self.micro, self.max_tokens = micro_batch_size_per_gpu, max_tokens_per_micro_batch
        self.state: TrainState | None = None
        self.model = None  # self.state.model

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        self.state = TrainState.build(self.model_cfg, self.fsdp_cfg, self.optim_cfg, head="lm",
                                      group=self.group, device=self.device,
                                      total_steps=total_training_steps)
        self.model = self.state.model

    def _data(self, batch: Batch) -> dict:
        data = tensors_of(batch, KEYS, self.device)
        data["loss_mask"] = data["loss_mask"][:, 1:] * data["attention_mask"][:, 1:]  # label t+1
        return data

    def _plan(self, data):
        return plan_micro_batches(data["attention_mask"], micro_batch_size=self.micro,
                                  max_tokens=self.max_tokens, group=self.group)

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO)
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the whole (global) batch; ``train/loss`` is its token-mean NLL."""
        data = self._data(batch)
        norm = global_normalizer(data["loss_mask"], "token-mean", self.group)
        rmpad = self.model_cfg.use_remove_padding

        def loss_fn(mb):
            nll = -forward_token_log_probs(self.model, mb, use_remove_padding=rmpad)  # [b, T-1]
            loss = agg_loss(nll, mb["loss_mask"], "token-mean", norm)
            return loss, {"loss": loss}
        stats = self.state.step([take_rows(data, p) for p in self._plan(data)], loss_fn)
        return prefixed(stats, "train")

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO)
    def eval_step(self, batch: Batch) -> dict[str, float]:
        """Summed response-token NLL and token count of the batch, over all ranks."""
        data = self._data(batch)
        total = torch.zeros(2, device=self.device)
        with torch.no_grad():
            for rows in self._plan(data):
                mb = take_rows(data, rows)
                nll = -forward_token_log_probs(self.model, mb,
                                               use_remove_padding=self.model_cfg.use_remove_padding)
                total += torch.stack([(nll * mb["loss_mask"]).sum(), mb["loss_mask"].sum().float()])
        all_reduce_(total, self.group)
        return {"nll_sum": float(total[0]), "tokens": float(total[1])}

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        return self.state.save(path, extra)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str) -> dict:
        return self.state.load(path)
