"""``RMTrainWorker``: Bradley-Terry training of a score-head model on FSDP2.

A batch holds one row per preference pair (``chosen_*`` and ``rejected_*`` tensors, see
``minihf.data.PairDataset``), so DP chunks and micro-batches never split a pair. Each
micro-batch runs the model on its chosen and its rejected sequences and adds
``-log sigmoid(r_chosen - r_rejected)`` for each pair, divided by the number of pairs in
the whole global batch (exact over any micro-batching and rank count). Sides with a sign
label (``<side>_sign`` = +1 / -1, Safe-RLHF's cost-model safety labels) add
``-log sigmoid(sign * r)``, which fixes the score's zero: positive means costly. ``eval_step``
returns sums (loss, correct pairs, margin, pairs) so the driver forms exact means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minihf.controller import Dispatch, Worker, register
from minihf.protocol import Batch
from minihf.workers.config import FSDPConfig, ModelConfig
from minihf.workers.engine import prefixed, tensors_of
from minihf.workers.forward import last_token_scores
from minihf.workers.optim import OptimConfig
from minihf.workers.train_state import TrainState
from minihf.workers.train_step import all_reduce_, plan_micro_batches, take_rows

SIDES = ("chosen", "rejected")
KEYS = tuple(f"{side}_{k}" for side in SIDES for k in ("input_ids", "attention_mask", "position_ids")) \
    + ("chosen_sign", "rejected_sign", "weight")  # weight: 1 per pair, 0 on fill rows (driver)


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, mb: dict) -> dict[str, torch.Tensor]:
    """Per-batch sums over the micro-batch's weighted pairs: ``loss`` (Bradley-Terry + the
    sign terms), ``correct``, ``margin``, ``sign_correct`` and ``signed`` (labeled sides)."""
    w, diff = mb["weight"].float(), chosen - rejected
    loss = -(F.logsigmoid(diff) * w).sum()
    sign_correct, signed = diff.new_zeros(()), diff.new_zeros(())
    for score, sign in ((chosen, mb["chosen_sign"]), (rejected, mb["rejected_sign"])):
        labeled = (sign != 0).float() * w
        loss = loss - (F.logsigmoid(sign * score) * labeled).sum()
        sign_correct = sign_correct + ((sign * score > 0).float() * labeled).sum()
        signed = signed + labeled.sum()
    return {"loss": loss, "correct": ((diff > 0).float() * w).sum(), "margin": (diff * w).sum(),
            "sign_correct": sign_correct, "signed": signed}


def pair_scores(model, mb: dict, use_remove_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_chosen, r_rejected)`` [b] for a micro-batch of pairs."""
    out = []
    for side in SIDES:
        side_mb = {k: mb[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "position_ids")}
        out.append(last_token_scores(model, side_mb, use_remove_padding=use_remove_padding))
    return out[0], out[1]


class RMTrainWorker(Worker):
    def __init__(self, model: ModelConfig, optim: OptimConfig, fsdp: FSDPConfig,
                 micro_batch_size_per_gpu: int | None, max_tokens_per_micro_batch: int | None):
        super().__init__()
        self.model_cfg, self.optim_cfg, self.fsdp_cfg = model, optim, fsdp
        self.micro, self.max_tokens = micro_batch_size_per_gpu, max_tokens_per_micro_batch
        self.state: TrainState | None = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        """The score model: from a reward-model checkpoint, or a causal LM with a fresh head."""
        self.state = TrainState.build(self.model_cfg, self.fsdp_cfg, self.optim_cfg, head="score",
                                      group=self.group, device=self.device,
                                      total_steps=total_training_steps)

    def _plan(self, data: dict):
        both = torch.cat([data["chosen_attention_mask"], data["rejected_attention_mask"]], dim=1)
        return plan_micro_batches(both, micro_batch_size=self.micro, max_tokens=self.max_tokens,
                                  group=self.group)

    def _pairs(self, data: dict) -> torch.Tensor:
        """Pairs in the global batch (every rank's rows, fill rows excluded)."""
        return all_reduce_(data["weight"].float().sum(), self.group)

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO)
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step: ``train/loss`` (per pair: BT loss + sign terms), ``train/accuracy``
        (pairs with r_chosen > r_rejected), ``train/margin`` (mean r_chosen - r_rejected)."""
        data = tensors_of(batch, KEYS, self.device)
        norm = self._pairs(data)
        rmpad = self.model_cfg.use_remove_padding

        def loss_fn(mb):
            sums = pair_loss(*pair_scores(self.state.model, mb, rmpad), mb)
            loss = sums["loss"] / norm
            return loss, {"loss": loss, "accuracy": sums["correct"] / norm,
                          "margin": sums["margin"] / norm}
        stats = self.state.step([take_rows(data, rows) for rows in self._plan(data)], loss_fn)
        return prefixed(stats, "train")

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO)
    def eval_step(self, batch: Batch) -> dict[str, float]:
        """Sums over the batch's pairs: ``loss_sum``, ``correct``, ``margin_sum``, ``pairs``,
        ``sign_correct``, ``signed``."""
        data = tensors_of(batch, KEYS, self.device)
        names = ("loss", "correct", "margin", "sign_correct", "signed")
        total = torch.zeros(len(names) + 1, device=self.device)
        with torch.no_grad():
            for rows in self._plan(data):
                mb = take_rows(data, rows)
                sums = pair_loss(*pair_scores(self.state.model, mb, self.model_cfg.use_remove_padding), mb)
                total += torch.stack([sums[k] for k in names] + [mb["weight"].float().sum()])
        all_reduce_(total, self.group)
        return dict(zip(("loss_sum", "correct", "margin_sum", "sign_correct", "signed", "pairs"),
                        total.tolist()))

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        return self.state.save(path, extra)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str) -> dict:
        return self.state.load(path)
