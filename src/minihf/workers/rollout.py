"""``RolloutWorker``: the rollout engine alone, on ranks of its own (standalone placement).

``controller.placement.rollout`` names its ranks (disjoint from the actor's); the actor
then trains on its ranks while this role generates (docs/async.md). The engine is the
hybrid engine's (``minihf.hybrid.StandaloneEngine``): TP size
``actor_rollout_ref.rollout.tensor_model_parallel_size`` over strided groups of this role's
ranks, the same sampling and output format, so the same weights give the same samples.
It holds no trained model: its weights arrive from the actor (``receive_weights``, sent
by the actor's ``send_weights`` at the same time; ``minihf.hybrid.transfer``), each rank
exactly its TP slice, and stay between calls.

Methods the driver calls:

* ``init_model`` (ONE_TO_ALL): build the engine (meta weights, no checkpoint read);
* ``receive_weights(train_ranks, adapters_only)`` (ONE_TO_ALL): ``{"bytes": received,
  "seconds": ...}``; a LoRA actor's base weights come once, its adapters every sync;
* ``generate_sequences(batch)`` (rollout layout): as the actor's.
"""

from __future__ import annotations

import time

import torch

from minihf.controller import Dispatch, Worker, register
from minihf.hybrid import collect_rollout
from minihf.protocol import Batch
from minihf.workers.actor import GENERATE_KEYS, engine_tokens
from minihf.workers.config import ActorRolloutRefConfig


class RolloutWorker(Worker):
    linked_roles = ("actor",)

    def __init__(self, config: ActorRolloutRefConfig):
        super().__init__()
        if self.tp_size != 1:
            raise ValueError(f"controller.placement.{self.role}.tp_size={self.tp_size}: set the rollout's TP "
                             "size with actor_rollout_ref.rollout.tensor_model_parallel_size instead")
        self.config = config
        self.engine = None
        self.shapes = None
        self.plans: dict = {}  # (train ranks, adapters only) -> the transfer plan

    @classmethod
    def declare_layouts(cls, config: ActorRolloutRefConfig) -> dict[str, int]:
        return {"rollout": config.rollout.tensor_model_parallel_size}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from minihf.hybrid.engine import StandaloneEngine
        from minihf.models import CheckpointReader

        from minihf.models import build_model
        from minihf.models.lora import apply_lora, module_names

        cfg = self.config
        self.args = CheckpointReader(cfg.model.path, "lm").args
        # the trained model's parameters as the actor names them (a LoRA actor's adapters too)
        model = build_model(self.args, "lm", device="meta", dtype=torch.float32)
        lora = None
        if cfg.model.lora:
            m = cfg.model
            lora = (m.lora_rank, m.lora_alpha, module_names(model, m.target_modules, m.exclude_modules,
                                                              "actor_rollout_ref.model.target_modules"))
            apply_lora(model, *lora)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        info = self.parallel("rollout")
        self.engine = StandaloneEngine(self.args, cfg.rollout, tp_group=info.tp_group, tp_rank=info.tp_rank,
                                       device=self.device, lora=lora,
                                       **engine_tokens(cfg, self.args.hf_config, info))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def receive_weights(self, train_ranks: list[int], adapters_only: bool = False) -> dict[str, float]:
        """This rank's TP slice of every weight (``adapters_only``: of a LoRA actor's
        adapters) from the actor's ranks (``train_ranks``: the global rank of each FSDP
        shard, in shard order)."""
        from minihf.hybrid.transfer import plan_transfer
        from minihf.models.lora import is_lora_param

        if self.engine is None:
            raise RuntimeError("RolloutWorker.receive_weights before init_model()")
        if adapters_only and not self.engine.loaded:
            raise RuntimeError("receive_weights(adapters_only=True) before the base weights arrived")
        e = self.engine
        key = (tuple(train_ranks), adapters_only)
        if key not in self.plans:  # the same every sync
            shapes = {n: s for n, s in self.shapes.items() if not adapters_only or is_lora_param(n)}
            self.plans[key] = plan_transfer(
                shapes, list(train_ranks), self.parallel("rollout").layout.tp_ranks(), e.tp,
                tied_lm_head=bool(self.args.tie_word_embeddings),
                itemsize=torch.empty((), dtype=e.dtype).element_size(),
                bucket_bytes=self.config.rollout.reshard_bucket_mb << 20)
        rounds = self.plans[key]
        t0 = time.perf_counter()
        received = e.receive(rounds, self.link("actor"))
        return {"bytes": received, "seconds": time.perf_counter() - t0}

    @register(dispatch=Dispatch.DP_COMPUTE, collect=collect_rollout, layout="rollout",
              reads=GENERATE_KEYS)
    def generate_sequences(self, batch: Batch) -> Batch:
        """Sample responses with the weights last received (generate -> free the KV cache)."""
        if self.engine is None:
            raise RuntimeError("RolloutWorker.generate_sequences before init_model()")
        return self.engine.generate_sequences(batch, int(batch.meta.get("global_step", 0)))
