"""``CriticWorker``: the PPO value function (a ``ValueModel``), trained with the clipped
value loss.

* ``init_model`` (ONE_TO_ALL); ``compute_values(batch) -> Batch{values}`` (DP_COMPUTE);
* ``update_critic(batch) -> metrics`` (DP_COMPUTE_EXACT: no padded rows)
  (``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``,
  ``critic/lr``), needs ``values`` (old) and ``returns``;
* ``save_checkpoint`` / ``load_checkpoint`` (ONE_TO_ALL).

``model.path`` may be a causal-LM checkpoint: the backbone is loaded, the value head
initialised fresh (``load_hf`` warns once).
"""

from __future__ import annotations

from minihf.algorithms import compute_value_loss, masked_mean
from minihf.controller import Dispatch, Worker, register
from minihf.parallel.ulysses import check_sp_model
from minihf.protocol import Batch
from minihf.workers.config import CriticConfig
from minihf.workers.engine import prefixed, run_micro_batches, sp_group, sp_layouts, tensors_of
from minihf.workers.forward import forward_values
from minihf.workers.train_state import TrainState

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = INPUT_KEYS + ("response_mask", "values", "returns")


class CriticWorker(Worker):
    def __init__(self, config: CriticConfig):
        super().__init__()
        self.config = config
        self.state: TrainState | None = None
        self.critic = None  # self.state.model
        self.sp = None      # its Ulysses group (critic.ulysses_sequence_parallel_size)

    @classmethod
    def declare_layouts(cls, config: CriticConfig) -> dict[str, int]:
        return sp_layouts(config.ulysses_sequence_parallel_size)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        """``total_training_steps``: the run's optimizer steps (for a cosine schedule)."""
        c = self.config
        self.state = TrainState.build(c.model, c.fsdp, c.optim, head="value", group=self.group,
                                      device=self.device, total_steps=total_training_steps)
        self.critic = self.state.model
        check_sp_model(c.ulysses_sequence_parallel_size, self.critic.args,
                       "critic.ulysses_sequence_parallel_size", c.model.use_remove_padding)
        self.sp = sp_group(self, c.ulysses_sequence_parallel_size)

    def _model(self):
        if self.critic is None:
            raise RuntimeError("CriticWorker: call init_model() first")
        return self.critic

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def compute_values(self, batch: Batch) -> Batch:
        """V(s) before each response token, ``values`` [B, R] (zero under the mask's pads)."""
        c, model = self.config, self._model()
        data = tensors_of(batch, INPUT_KEYS, self.device)

        def fn(mb):
            v = forward_values(model, mb, use_remove_padding=c.model.use_remove_padding,
                               share_prompt=self.config.model.shares_prompt, sp=self.sp)
            return {"values": v}
        out = run_micro_batches(data, fn, micro_batch_size=c.forward_micro_batch_size_per_gpu,
                                max_tokens=c.max_tokens_per_micro_batch, group=self.group,
                                model=model, share_prompt=self.config.model.shares_prompt, sp=self.sp)
        return Batch({"values": out["values"].cpu()})

    def _loss_fn(self, norm, tokens):
        c, model = self.config, self.critic

        def loss_fn(mb):
            mask = mb["response_mask"]
            vpreds = forward_values(model, mb, use_remove_padding=c.model.use_remove_padding,
                                    share_prompt=self.config.model.shares_prompt, sp=self.sp)
            vf_loss, clipfrac = compute_value_loss(vpreds, mb["returns"], mb["values"], mask,
                                                   c.cliprange_value, c.loss_agg_mode, norm)
            share = mask.float().sum() / tokens
            return vf_loss, {"vf_loss": vf_loss, "vf_clipfrac": clipfrac * share,
                             "vpred_mean": masked_mean(vpreds, mask) * share}
        return loss_fn

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO, reads=UPDATE_KEYS)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update: ``ppo_epochs`` x mini-batches x micro-batches."""
        c = self.config
        self._model()
        data = tensors_of(batch, UPDATE_KEYS, self.device)
        stats = self.state.update(
            data, mini_batch_size=c.ppo_mini_batch_size,
            micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            max_tokens=c.max_tokens_per_micro_batch, epochs=c.ppo_epochs, shuffle=c.shuffle,
            seed=int(batch.meta.get("global_step", 0)), loss_agg_mode=c.loss_agg_mode,
            make_loss_fn=self._loss_fn, share_prompt=self.config.model.shares_prompt, sp=self.sp,
            scheduled_rows=batch.meta.get("scheduled_rows"))
        return prefixed(stats, "critic")

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        self._model()
        return self.state.save(path, extra)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str) -> dict:
        self._model()
        return self.state.load(path)
