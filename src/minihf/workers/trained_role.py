"""``TrainedRoleWorker``: the base of a recipe role that trains (``roles.<name>.train.enable``),
e.g. an implicit process reward model updated online (PRIME) or a second policy.

It is a ``LogProbWorker`` whose model trains: ``init_model`` builds a ``TrainState`` (the
FSDP model, AdamW and the LR schedule of ``train.optim``), ``compute_log_prob`` scores the
response tokens with the current weights, and ``save_checkpoint`` / ``load_checkpoint`` keep
model, optimizer, schedule and RNG with the run's checkpoints (the role table checkpoints and
resumes the role as it does the critic). A subclass says what it learns:

* ``loss(mb, log_prob, agg) -> loss | (loss, figures)``: ``mb`` a micro-batch (its tensors
  on the device), ``log_prob`` ``[b, R]`` the response tokens' log-probs under the role's
  model with gradient (temperature-scaled as the rollout's), ``agg(token_losses)`` the
  ``[b, R]`` losses aggregated by ``train.loss_agg_mode`` over the whole mini-batch (exact
  across micro-batches and ranks: sum the micro-batches' results). ``figures`` are scalars
  logged as ``<role>/<name>`` (token-weighted means over the step);
* ``update_keys``: the batch keys the loss reads beyond the rows' tokens and
  ``response_mask`` (e.g. ``ref_log_prob``, ``token_level_scores``).

The driver calls ``update(batch)`` (a plug-in's phase, ``ctx.groups[name].update(batch)``):
``train.ppo_epochs`` x mini-batches of ``train.ppo_mini_batch_size`` rows x micro-batches,
as the critic's update; it returns ``<role>/loss``, ``<role>/grad_norm``, ``<role>/lr`` and
the figures. LoRA and sequence parallelism are the actor's and critic's only.
"""

from __future__ import annotations

from typing import Callable

import torch

from minihf.algorithms import agg_loss
from minihf.controller import Dispatch, register
from minihf.protocol import Batch
from minihf.workers.engine import prefixed, tensors_of
from minihf.workers.forward import forward_log_probs
from minihf.workers.log_prob import INPUT_KEYS, LogProbWorker
from minihf.workers.train_state import TrainState

UPDATE_KEYS = INPUT_KEYS + ("response_mask",)


class TrainedRoleWorker(LogProbWorker):
    update_keys: tuple[str, ...] = ()  # batch keys ``loss`` reads beyond UPDATE_KEYS

    def __init__(self, config):
        super().__init__(config)
        self.state: TrainState | None = None

    @classmethod
    def declare_reads(cls, config) -> dict[str, tuple[str, ...]]:
        return {"update": tuple(cls.update_keys)}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        """``total_training_steps``: the role's optimizer steps over the run (its LR schedule)."""
        if type(self).loss is TrainedRoleWorker.loss:
            raise TypeError(f"{type(self).__name__} ({self.role}) trains but defines no "
                            "loss(self, mb, log_prob, agg); define it (docs/writing-a-recipe.md)")
        c = self.config
        self.state = TrainState.build(c.model, c.fsdp, c.train.optim, head=self.head, group=self.group,
                                      device=self.device, total_steps=total_training_steps)
        self.model = self.state.model

    def loss(self, mb: dict, log_prob: torch.Tensor, agg: Callable[[torch.Tensor], torch.Tensor]):
        """The micro-batch's share of the mini-batch loss (see the module docstring)."""
        raise NotImplementedError

    def _loss_fn(self, temperature: float):
        c, t = self.config, self.config.train

        def make(norm, tokens):
            def loss_fn(mb):
                mask = mb["response_mask"]
                out = forward_log_probs(self.model, mb, use_remove_padding=c.model.use_remove_padding,
                                        temperature=temperature, logits_chunk=c.logits_chunk_size)
                result = self.loss(mb, out["log_probs"],
                                   lambda losses: agg_loss(losses, mask, t.loss_agg_mode, norm))
                loss, figures = result if isinstance(result, tuple) else (result, {})
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    raise TypeError(f"{type(self).__name__}.loss returned {type(loss).__name__}"
                                    f"{tuple(getattr(loss, 'shape', ()))}; return a scalar tensor")
                share = mask.float().sum() / tokens
                return loss, {"loss": loss, **{k: torch.as_tensor(v).detach().float() * share
                                               for k, v in figures.items()}}
            return loss_fn
        return make

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO, reads=UPDATE_KEYS)
    def update(self, batch: Batch) -> dict[str, float]:
        """One update of the role on the step's rows; its metrics under ``<role>/``."""
        self.built()
        t = self.config.train
        missing = [k for k in UPDATE_KEYS + tuple(self.update_keys) if k not in batch.tensors]
        if missing:
            raise ValueError(f"{type(self).__name__} ({self.role}).update: the batch has no {missing} "
                           f"(it has {sorted(batch.tensors)}); call it after the phase that adds them")
        data = tensors_of(batch, UPDATE_KEYS + tuple(self.update_keys), self.device)
        stats = self.state.update(
            data, mini_batch_size=t.ppo_mini_batch_size, micro_batch_size=t.ppo_micro_batch_size_per_gpu,
            max_tokens=t.max_tokens_per_micro_batch, epochs=t.ppo_epochs, shuffle=t.shuffle,
            seed=int(batch.meta.get("global_step", 0)), loss_agg_mode=t.loss_agg_mode,
            make_loss_fn=self._loss_fn(float(batch.meta.get("temperature", 1.0))),
            scheduled_rows=batch.meta.get("scheduled_rows"))
        return prefixed(stats, self.role)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        self.built()
        return self.state.save(path, extra)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str) -> dict:
        self.built()
        return self.state.load(path)
