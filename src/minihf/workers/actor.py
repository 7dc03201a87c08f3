"""``ActorRolloutRefWorker``: the policy (trained), its rollout engine and the frozen
reference, in one process (HybridFlow's hybrid worker).

Two layouts of the role's N ranks (``minihf.controller.layout``): training and scoring use
the default one (all N ranks data-parallel, FSDP over all of them); ``generate_sequences``
uses ``rollout`` (N/t replicas of TP size t = ``rollout.tensor_model_parallel_size``, TP
groups strided), through the ``HybridEngine`` (``minihf.hybrid``).

Methods the driver calls (dispatch ``DP_COMPUTE`` unless noted):

* ``init_model`` (ONE_TO_ALL): build the actor's ``TrainState`` (sharded model, optimizer,
  schedule) and the reference;
  plan the reshard and build the (sleeping) rollout engine.
* ``generate_sequences(batch) -> Batch`` (rollout layout; see ``HybridEngine``): prompts ->
  ``prompts, responses, input_ids, attention_mask, position_ids, response_mask,
  rollout_log_probs``; ``batch.meta["global_step"]`` seeds the samples.
* ``compute_log_prob(batch) -> Batch{old_log_probs[, entropys][, log_prob_bound]}``
* ``compute_ref_log_prob(batch) -> Batch{ref_log_prob}``: under a model of its own, or
  (``reference="adapters_off"``, a LoRA actor's) under the actor's own model with its
  adapters switched off: the base model, with no second copy of its weights.
* ``update_actor(batch) -> metrics`` (DP_COMPUTE_EXACT) (``actor/pg_loss``, ``actor/pg_clipfrac``,
  ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss``, ``actor/grad_norm``,
  ``actor/lr``), reduced over ranks, from DP rank 0.
* ``save_checkpoint(path, extra)`` / ``load_checkpoint(path)`` (ONE_TO_ALL).
* ``send_weights(rollout_tp_ranks)`` (ONE_TO_ALL): with a standalone rollout
  (``RolloutWorker`` on ranks of its own), this rank's pieces of each rollout rank's TP
  slices (``minihf.hybrid.transfer``), sent while the rollout runs ``receive_weights``.

``batch.meta["old_log_probs"] == "update"`` (the driver's choice when the update is one
on-policy optimizer step, see ``PPOConfig.old_log_prob_source``): the batch has no
``old_log_probs``; the update's own log-probs, detached, take their place (exact: the ratio
is 1 at that step), so the separate forward pass is saved.

Log-probs are computed at ``batch.meta["temperature"]`` (default 1.0), the temperature the
rollout sampled with (``generate_sequences`` puts it in its output's meta).
The reference may keep its shards on the host (``ref.fsdp.param_offload``); FSDP then
moves each block to the device only while it runs.

Update batches must hold a multiple of the DP size rows: DP_COMPUTE would pad uneven
batches by repeating rows, which an update counts twice, so DP_COMPUTE_EXACT refuses
them on the driver. Training shards over all the role's ranks whatever the rollout TP
size: no rank computes another's rows.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from minihf.algorithms import (agg_loss, get_policy_loss_fn, kl_penalty, logprob_rounding_bound,
                               masked_mean)
from minihf.algorithms.policy_loss import check_takes_is_weights
from minihf.controller import Dispatch, Worker, register
from minihf.hybrid import HybridEngine, collect_rollout
from minihf.multi_turn.loop import ENV_ROW_KEYS
from minihf.hybrid.engine import rollout_dtype
from minihf.models.lora import adapters_disabled, is_lora_param
from minihf.models.moe import MoEStep, RouterStats
from minihf.parallel.fsdp import default_mixed_precision
from minihf.protocol import Batch
from minihf.rollout.llm import eos_ids_from_dir
from minihf.workers.actor_checks import check_actor_sp, check_router_replay, reference_source, shard_ranks, sp_sizes
from minihf.workers.aux_loss import (add_aux_terms, aux_loss_reads, build_aux_losses, check_aux_reads, ids_for,
                                     policy_loss_terms)
from minihf.workers.config import ActorRolloutRefConfig
from minihf.workers.engine import build_fsdp_model, prefixed, run_micro_batches, sp_group, sp_layouts, tensors_of
from minihf.workers.forward import forward_log_probs
from minihf.workers.train_state import TrainState
from minihf.workers.train_step import group_size

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = INPUT_KEYS + ("response_mask", "old_log_probs", "advantages")
GENERATE_KEYS = ("input_ids", "attention_mask", "position_ids", "sample_index", "uid") + ENV_ROW_KEYS


REFERENCES = ("model", "adapters_off")


def engine_tokens(cfg: ActorRolloutRefConfig, hf_config: dict, info) -> dict:
    """The rollout engine's ``eos_token_ids``, ``pad_token_id`` and ``multi_turn`` (a
    ``MultiTurn`` whose environments run on each replica's first TP rank, or None) for this
    rank's place ``info`` in the rollout layout."""
    r = cfg.rollout
    eos = eos_ids_from_dir(cfg.model.path, hf_config)
    pad = hf_config.get("pad_token_id")
    multi_turn = None
    if r.multi_turn.enable:
        from minihf.data import load_tokenizer
        from minihf.multi_turn import MultiTurn

        multi_turn = MultiTurn(r.multi_turn, load_tokenizer(cfg.model.path), eos,
                               tp_group=info.tp_group if r.tensor_model_parallel_size > 1 else None,
                               leader=info.tp_rank == 0)
    return {"eos_token_ids": eos, "pad_token_id": pad if pad is not None else (eos[0] if eos else 0),
            "multi_turn": multi_turn, "record_routes": cfg.actor.router_replay == "R3"}


class ActorRolloutRefWorker(Worker):
    linked_roles = ("rollout",)  # a standalone rollout receives the weights from these ranks

    def __init__(self, config: ActorRolloutRefConfig, with_ref: bool = True,
                 reference: str | None = None, generates: bool = True):
        """``reference``: ``model`` (a frozen copy loaded from ``model.path``) or
        ``adapters_off`` (LoRA); None: :func:`reference_source` of the config.
        ``generates``: False when a standalone rollout (``RolloutWorker``) generates
        instead: no engine is built here, and the weights go out by ``send_weights``."""
        super().__init__()
        if self.tp_size != 1:
            raise ValueError(f"controller.placement.{self.role}.tp_size={self.tp_size}: the actor trains "
                             "over all its ranks; set the generation TP size with "
                             "actor_rollout_ref.rollout.tensor_model_parallel_size instead")
        reference = reference or reference_source(config.model)
        if reference not in REFERENCES or (reference == "adapters_off") != (
                reference_source(config.model) == "adapters_off"):
            raise ValueError(f"reference={reference!r}: use 'adapters_off' with a LoRA actor "
                             "(model.lora_rank > 0) and 'model' without")
        self.config = config
        self.with_ref = with_ref
        self.reference = reference
        self.generates = generates
        self.state: TrainState | None = None  # the trained policy (model, optimizer, schedule)
        self.actor = self.ref = None           # self.actor is self.state.model
        self.rollout: HybridEngine | None = None
        self.sp = self.ref_sp = None  # Ulysses groups of the update/old log-probs and the reference
        self.transfer_plans: dict = {}  # a standalone rollout's sync plans (send_weights)

    @classmethod
    def declare_layouts(cls, config: ActorRolloutRefConfig, with_ref: bool = True,
                        reference: str | None = None, generates: bool = True) -> dict[str, int]:
        return {"rollout": config.rollout.tensor_model_parallel_size if generates else 1,
                **sp_layouts(*sp_sizes(config))}

    @classmethod
    def declare_reads(cls, config: ActorRolloutRefConfig, *args, **kwargs) -> dict[str, tuple[str, ...]]:
        return {"update_actor": aux_loss_reads(config.actor.aux_losses)}  # what its aux losses read

    # -- set-up ---------------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        """``total_training_steps``: the run's optimizer steps (for a cosine schedule)."""
        cfg = self.config
        get_policy_loss_fn(cfg.actor.policy_loss.loss_mode)  # an unknown name fails here
        self.aux_losses = build_aux_losses(cfg.actor.aux_losses, UPDATE_KEYS + ("ref_log_prob", "rollout_is_weights"))
        check_router_replay(cfg)
        self.state = TrainState.build(cfg.model, cfg.actor.fsdp, cfg.actor.optim, head="lm",
                                      group=self.group, device=self.device,
                                      total_steps=total_training_steps, compile=cfg.actor.use_torch_compile)
        self.actor = self.state.model
        check_actor_sp(cfg, self.actor.args)
        self.sp, self.ref_sp = (sp_group(self, n) for n in sp_sizes(cfg))
        if self.with_ref and self.reference == "adapters_off":
            self.ref = self.actor
        elif self.with_ref:
            self.ref = build_fsdp_model(cfg.model, cfg.ref.fsdp, head="lm", group=self.group,
                                        device=self.device, trainable=False)
        r = cfg.rollout
        if r.prompt_length is None or r.response_length is None or not self.generates:
            return  # a scoring/training-only actor (generate_sequences explains what to set)
        info = self.parallel("rollout")
        self.rollout = HybridEngine(
            self.actor, cfg.rollout, all_group=self.group, gather_group=info.dp_group,
            tp_group=info.tp_group, tp_rank=info.tp_rank, device=self.device,
            **engine_tokens(cfg, self.actor.args.hf_config, info))

    # -- generation -----------------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE, collect=collect_rollout, layout="rollout",
              reads=GENERATE_KEYS)
    def generate_sequences(self, batch: Batch) -> Batch:
        """Sample responses with the current weights (reshard -> generate -> sleep). With
        ``actor.fsdp.optimizer_offload`` on CUDA the optimizer state waits on the host."""
        self._require("rollout")
        with self.state.optimizer_on_host(self.config.actor.fsdp.optimizer_offload):
            return self.rollout.generate_sequences(batch, int(batch.meta.get("global_step", 0)))

    def _require(self, name: str):
        model = getattr(self, name)
        if model is None:
            hint = {"ref": "construct the worker with with_ref=True",
                    "rollout": "the standalone rollout role generates in this job (controller."
                               "placement.rollout)" if not self.generates else
                               "set rollout.prompt_length and rollout.response_length (the PPO "
                               "trainer takes them from data.max_prompt_length/"
                               "max_response_length) and call init_model()"
                    }.get(name, "call init_model() first")
            raise RuntimeError(f"{type(self).__name__}.{name} is not built; {hint}")
        return model

    # -- inference ------------------------------------------------------------------------
    def _log_probs(self, model, batch: Batch, micro: int | None, max_tokens: int | None,
                   calc_entropy: bool, calc_logit_scale: bool = False, chunk: int | None = None,
                   routes: str | None = None, sp=None) -> dict:
        data = tensors_of(batch, INPUT_KEYS + (("routed_experts",) if routes == "replay" else ()), self.device)
        temperature = float(batch.meta.get("temperature", 1.0))
        use_rmpad, share = self.config.model.use_remove_padding, self.config.model.shares_prompt

        def fn(mb):
            return forward_log_probs(model, mb, use_remove_padding=use_rmpad, share_prompt=share,
                                     temperature=temperature, calc_entropy=calc_entropy,
                                     calc_logit_scale=calc_logit_scale, logits_chunk=chunk, routes=routes,
                                     sp=sp)
        return run_micro_batches(data, fn, micro_batch_size=micro, max_tokens=max_tokens,
                                 group=self.group, model=model, share_prompt=share, sp=sp)

    def _coarsest_dtype(self) -> torch.dtype:
        """The lower of the engine's and the trainer's compute precisions (bf16 where
        either runs in bf16): what a rollout-vs-trainer log-prob gap is rounded to."""
        trainer = (default_mixed_precision(self.device.type)[0]
                   if self.config.actor.fsdp.mixed_precision == "auto" else None)
        dtypes = {rollout_dtype(self.config.rollout.dtype, self.device), trainer or torch.float32}
        return max(dtypes, key=lambda d: torch.finfo(d).eps)

    def _routes(self, batch: Batch, update: bool) -> str | None:
        """What ``actor.router_replay`` asks of this forward: ``replay`` the batch's
        ``routed_experts`` (R3 always, R2 in the update), ``record`` them (R2, old log-probs)."""
        mode = self.config.actor.router_replay
        if mode == "disabled":
            return None
        if "routed_experts" in batch.tensors and (mode == "R3" or update):
            return "replay"
        return "record" if mode == "R2" and not update else None

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS + ("routed_experts",))
    def compute_log_prob(self, batch: Batch, calc_entropy: bool = False,
                         calc_bound: bool = False) -> Batch:
        """Old log-probs of the response tokens under the current actor (+ entropy). With
        ``calc_bound``, ``log_prob_bound`` [B, R]: how far the engine's log-prob of each token
        may sit from this one by rounding alone (twice ``logprob_rounding_bound`` in the
        coarser of the two compute dtypes). ``actor.router_replay``: R2 adds
        ``routed_experts`` (this forward's expert choices); R3 routes by the rollout's and
        adds ``router_disagree`` / ``router_replayed`` [B, MoE layers] (tokens whose own
        choice differs from the rollout's, tokens replayed)."""
        a = self.config.actor
        routes = self._routes(batch, update=False)
        out = self._log_probs(self._require("actor"), batch, a.log_prob_micro_batch_size_per_gpu,
                              a.max_tokens_per_micro_batch, calc_entropy, calc_bound, a.logits_chunk_size,
                              routes, self.sp)
        tensors = {"old_log_probs": out["log_probs"].cpu()}
        for key in ("routed_experts", "router_disagree", "router_replayed"):
            if key in out:
                tensors[key] = out[key].cpu()
        if calc_entropy:
            tensors["entropys"] = out["entropy"].cpu()
        if calc_bound:
            tensors["log_prob_bound"] = 2 * logprob_rounding_bound(out["logit_scale"].cpu(),
                                                                   self._coarsest_dtype())
        return Batch(tensors)

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the response tokens under the frozen reference policy."""
        r = self.config.ref
        ref = self._require("ref")
        with adapters_disabled(ref) if self.reference == "adapters_off" else nullcontext():
            out = self._log_probs(ref, batch, r.log_prob_micro_batch_size_per_gpu,
                                  r.max_tokens_per_micro_batch, False, chunk=r.logits_chunk_size,
                                  sp=self.ref_sp)
        return Batch({"ref_log_prob": out["log_probs"].cpu()})

    # -- update ---------------------------------------------------------------------------
    def _loss_fn(self, norm, tokens, temperature, own_old: bool, routes: str | None = None):
        """``own_old``: the update is one on-policy step; the old log-probs are this
        forward's, detached (and the entropy is measured here for ``actor/entropy``)."""
        a = self.config.actor
        model = self.actor
        policy_loss = get_policy_loss_fn(a.policy_loss.loss_mode)
        args = model.args
        aux_coef = (args.router_aux_loss_coef if a.router_aux_loss_coef is None else a.router_aux_loss_coef)

        def loss_fn(mb):
            mask = mb["response_mask"]
            router = RouterStats(args.num_experts) if args.is_moe else None
            out = forward_log_probs(model, mb, use_remove_padding=self.config.model.use_remove_padding,
                                    share_prompt=self.config.model.shares_prompt, temperature=temperature,
                                    calc_entropy=a.entropy_coeff != 0 or own_old,
                                    entropy_grad=a.entropy_coeff != 0, logits_chunk=a.logits_chunk_size,
                                    moe=MoEStep(router) if router is not None else None, routes=routes,
                                    sp=self.sp, ids=ids_for(self.aux_losses, mb))
            log_prob = out["log_probs"]                                       # [b, R]
            old = log_prob.detach() if own_old else mb["old_log_probs"]
            extra = {"rollout_is_weights": mb["rollout_is_weights"]} if "rollout_is_weights" in mb else {}
            pg_loss, clipfrac, ppo_kl, clipfrac_lower, own = policy_loss_terms(policy_loss(  # (+ its own figures)
                old, log_prob, mb["advantages"], mask,
                loss_agg_mode=a.loss_agg_mode, normalizer=norm, config=a, **extra),
                f"policy loss {a.policy_loss.loss_mode}", log_prob)
            share = mask.float().sum() / tokens  # this micro-batch's weight in token means
            stats = {"pg_loss": pg_loss, "pg_clipfrac": clipfrac * share,
                     "ppo_kl": ppo_kl * share, "pg_clipfrac_lower": clipfrac_lower * share}
            for k, v in own.items():
                stats[k] = v.to(share.device) * share
            loss = pg_loss
            if self.aux_losses:  # none: the policy loss alone, no extra op in the graph
                loss = loss + add_aux_terms(self.aux_losses, mb, out, stats, share=share,
                                            loss_agg_mode=a.loss_agg_mode, normalizer=norm)
            if a.entropy_coeff != 0:
                entropy = agg_loss(out["entropy"], mask, a.loss_agg_mode, norm)
                loss = loss - a.entropy_coeff * entropy
            if "entropy" in out:
                stats["entropy"] = masked_mean(out["entropy"].detach(), mask) * share
            if a.use_kl_loss:
                kl = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type), mask,
                              a.loss_agg_mode, norm)
                loss = loss + a.kl_loss_coef * kl
                stats["kl_loss"] = kl
            if router is not None:
                # the load-balancing loss as a token-weighted mean over micro-batches; its
                # gradient enters at each MoE layer (RouterStats), scaled here as backward
                # will scale this loss (train_step: x dp for FSDP's average)
                router.weight = aux_coef * share.detach() * group_size(self.state.group)
                stats["moe_aux_loss"] = router.loss().to(share.device) * share
            return loss, stats
        return loss_fn

    @register(dispatch=Dispatch.DP_COMPUTE_EXACT, collect=Dispatch.RANK_ZERO,
              reads=UPDATE_KEYS + ("ref_log_prob", "rollout_is_weights", "routed_experts"))
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO update: ``ppo_epochs`` x mini-batches x micro-batches; returns metrics."""
        a = self.config.actor
        self._require("actor")
        own_old = batch.meta.get("old_log_probs") == "update"
        keys = UPDATE_KEYS + (("ref_log_prob",) if a.use_kl_loss else ())
        if "rollout_is_weights" in batch.tensors:  # algorithm.rollout_correction.rollout_is
            check_takes_is_weights(a.policy_loss.loss_mode)
            keys += ("rollout_is_weights",)
        if own_old:
            keys = tuple(k for k in keys if k != "old_log_probs")
            steps = a.ppo_epochs * -(-len(batch) // (a.ppo_mini_batch_size // self.dp_size))
            if steps != 1:
                raise ValueError(f"meta old_log_probs='update' needs a one-step update, but this "
                                 f"one takes {steps} optimizer steps (ppo_epochs={a.ppo_epochs}, "
                                 f"ppo_mini_batch_size={a.ppo_mini_batch_size}); compute "
                                 "old_log_probs first")
        routes = self._routes(batch, update=True)
        if routes == "replay":
            keys += ("routed_experts",)
        keys += check_aux_reads(a.aux_losses, batch, keys)
        data = tensors_of(batch, keys, self.device)
        temperature = float(batch.meta.get("temperature", 1.0))
        stats = self.state.update(
            data, mini_batch_size=a.ppo_mini_batch_size,
            micro_batch_size=a.ppo_micro_batch_size_per_gpu,
            max_tokens=a.max_tokens_per_micro_batch, epochs=a.ppo_epochs, shuffle=a.shuffle,
            seed=int(batch.meta.get("global_step", 0)), loss_agg_mode=a.loss_agg_mode,
            make_loss_fn=lambda norm, tokens: self._loss_fn(norm, tokens, temperature, own_old, routes),
            share_prompt=self.config.model.shares_prompt, sp=self.sp,
            scheduled_rows=batch.meta.get("scheduled_rows"))
        metrics = prefixed(stats, "actor")
        if a.use_kl_loss:
            metrics["actor/kl_coef"] = a.kl_loss_coef
        return metrics

    # -- a standalone rollout's weights -----------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def send_weights(self, rollout_tp_ranks: dict[int, int], adapters_only: bool = False) -> dict[str, float]:
        """Send this rank's pieces of the rollout ranks' TP slices (``rollout_tp_ranks``:
        global rank -> TP rank), in the rollout dtype (``adapters_only``: a LoRA actor's
        adapters, the rollout holding the frozen base weights already);
        ``{"bytes": sent, "seconds": ...}``."""
        import time

        from minihf.hybrid.reshard import local_shard
        from minihf.hybrid.transfer import plan_transfer, send_weights
        from minihf.parallel.fsdp import reshard

        model = self._require("actor")
        r = self.config.rollout
        dtype = rollout_dtype(r.dtype, self.device)
        key = (tuple(sorted(rollout_tp_ranks.items())), adapters_only)
        if key not in self.transfer_plans:  # the same every sync
            self.transfer_plans[key] = plan_transfer(
                {n: tuple(p.shape) for n, p in model.named_parameters()
                 if not adapters_only or is_lora_param(n)}, shard_ranks(self.group, self.rank),
                rollout_tp_ranks, r.tensor_model_parallel_size,
                tied_lm_head=bool(model.args.tie_word_embeddings),
                itemsize=torch.empty((), dtype=dtype).element_size(), bucket_bytes=r.reshard_bucket_mb << 20)
        rounds = self.transfer_plans[key]
        reshard(model)  # every parameter a DTensor shard
        t0 = time.perf_counter()
        params = {n: local_shard(p) for n, p in model.named_parameters()}
        sent = send_weights(params, rounds, self.rank, self.link("rollout"), dtype, self.device)
        return {"bytes": sent, "seconds": time.perf_counter() - t0}

    # -- checkpoints ----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """Sharded actor + optimizer + schedule + RNG (+ ``extra``) under ``path``."""
        self._require("actor")
        return self.state.save(path, extra)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def load_checkpoint(self, path: str) -> dict:
        """Restore what ``save_checkpoint`` wrote; returns the saved ``extra``."""
        self._require("actor")
        return self.state.load(path)
