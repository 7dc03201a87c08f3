"""Config sections of the training workers (composed into a job's root config).

Batch sizes count *sequences* (rows of a Batch, i.e. prompts x samples per prompt) and
are global over the role's data-parallel ranks unless the name ends in ``_per_gpu``.
Every field has verl's name where verl has one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from minihf.algorithms.kl import KL_PENALTIES
from minihf.workers.aux_loss import AuxLossConfig
from minihf.workers.optim import OptimConfig
from minihf.workers.multi_turn_config import MultiTurnConfig
from minihf.workers.section_checks import check_actor_worker, check_chunk, check_micro, check_ppo_update, check_sp


@dataclass
class FSDPConfig:
    """How a role's model is sharded (see ``minihf.parallel.fsdp.apply_fsdp``)."""
    param_offload: bool = False          # params/grads/optimizer state on the host (CPUOffloadPolicy)
    optimizer_offload: bool = False      # actor on CUDA: optimizer state on the host while generating
    activation_checkpointing: bool = False  # recompute block activations in backward (less memory)
    mixed_precision: Literal["auto", "none"] = "auto"  # auto: bf16/fp32-reduce on CUDA, fp32 on CPU
    reshard_after_forward: bool = True   # free gathered parameters after each block's forward
    wrap_blocks: bool = True             # one FSDP unit per block; false: the whole model is one unit (fewer collectives, faster for small models)


@dataclass
class ModelConfig:
    """Which checkpoint a role loads and how its forward runs."""
    path: str = ""                       # HF checkpoint dir (config.json + safetensors)
    use_remove_padding: bool = True      # padding-free packed micro-batches


@dataclass
class RLModelConfig(ModelConfig):
    """An RL role's model: its forwards see n responses per prompt."""
    share_prompt: bool = True            # packed: a prompt shared by several responses runs once per micro-batch

    @property
    def shares_prompt(self) -> bool:
        """Whether forwards share prompts: only packed ones can."""
        return self.use_remove_padding and self.share_prompt


@dataclass
class TrainedModelConfig(RLModelConfig):
    """A trained RL role's model (actor, critic), optionally with LoRA adapters (verl's
    names; ``minihf.models.lora``): ``lora_rank`` > 0 freezes the base weights and trains
    adapters on the ``target_modules`` only (a critic's value head is trained in full)."""
    lora_rank: int = 0                   # LoRA rank r; 0 = train every weight
    lora_alpha: float = 16.0             # adapter scale: alpha / r
    target_modules: Union[str, list[str]] = "all-linear"  # all-linear (q/k/v/o/gate/up/down) or module names
    exclude_modules: Optional[list[str]] = None  # module names left out of target_modules
    lora_adapter_path: Optional[str] = None  # start from this PEFT adapter dir (adapter_config.json)

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    def __post_init__(self):
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be an int >= 0 (0 = no LoRA)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0")
        if self.lora_rank == 0:
            stray = [k for k, v in (("target_modules", self.target_modules != "all-linear"),
                                    ("exclude_modules", self.exclude_modules is not None),
                                    ("lora_adapter_path", self.lora_adapter_path is not None)) if v]
            if stray:
                raise ValueError(f"{', '.join(stray)} set but lora_rank=0 (LoRA is off); set "
                                 "lora_rank > 0 (e.g. 16) or drop them")
            if self.lora_alpha != TrainedModelConfig.lora_alpha:  # (a LoRA recipe run with rank 0: a warning)
                warnings.warn(f"lora_alpha={self.lora_alpha} is set but lora_rank=0 (LoRA is off), so it "
                              "does nothing; set lora_rank > 0 to train adapters", stacklevel=2)


@dataclass
class PolicyLossConfig:
    """Which registered policy loss the actor minimises (``minihf.algorithms``'
    ``register_policy_loss``): ``vanilla`` (PPO-clip, dual clip optional), ``gspo``, or one a
    recipe registers."""
    loss_mode: str = "vanilla"           # a registered loss (vanilla, gspo) or file.py:function

    def __post_init__(self):  # (a wrong one failed on the workers, after start-up)
        from minihf.algorithms import get_policy_loss_fn
        from minihf.utils.imports import check_name_or_ref

        check_name_or_ref(self.loss_mode, get_policy_loss_fn, "policy loss")


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class ActorConfig:
    """PPO policy update."""
    ppo_mini_batch_size: int = 16        # sequences per optimizer step, global
    ppo_micro_batch_size_per_gpu: Optional[int] = 4  # rows per forward/backward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # dynamic micro-batches (wins when set)
    ppo_epochs: int = 1                  # passes over each step's batch
    shuffle: bool = False                # reshuffle rows before cutting mini-batches each epoch
    clip_ratio: float = 0.2              # PPO clip epsilon (both sides unless low/high are set)
    clip_ratio_low: Optional[float] = None  # lower clip epsilon (DAPO clip-higher); null: clip_ratio
    clip_ratio_high: Optional[float] = None  # upper clip epsilon; null: clip_ratio
    clip_ratio_c: Optional[float] = 3.0  # dual-clip bound (verl's default); null disables
    entropy_coeff: float = 0.0           # entropy bonus weight in the loss
    use_kl_loss: bool = False            # GRPO-style KL to the reference in the loss
    kl_loss_coef: float = 0.001          # weight of the KL-to-reference loss (use_kl_loss)
    kl_loss_type: str = "low_var_kl"     # KL estimator: kl (k1) | abs | mse (k2) | low_var_kl (k3)
    loss_agg_mode: str = "token-mean"   # seq-mean-token-sum-norm divides by the response length
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    log_prob_micro_batch_size_per_gpu: Optional[int] = 8  # for compute_log_prob
    # Old log-probs of the PPO ratio: true = a forward pass before the update; null (auto) =
    # skip it when the update is one on-policy optimizer step (its own log-probs, detached,
    # are exact); false = also otherwise use the rollout engine's log-probs (approximate)
    recompute_log_prob: Optional[bool] = None
    # the LM head's logits made this many response tokens at a time (log-probs and entropy,
    # forward and backward; minihf.algorithms.chunked_logits): never [tokens, vocab] whole,
    # for long responses and large vocabularies; null: a micro-batch's at once
    logits_chunk_size: Optional[int] = None
    # Ulysses sequence parallelism (verl's key): this many of the actor's ranks split each packed
    # micro-batch's tokens (attention by all-to-all over heads); it must divide the actor's
    # ranks; needs model.use_remove_padding and a dense model. 1: off
    ulysses_sequence_parallel_size: int = 1
    use_torch_compile: bool = False      # torch.compile (dynamic shapes) each block's norms and MLP for the update and log-probs (verl's key; attention stays eager); each process compiles once
    # a mixture-of-experts policy's load-balancing loss weight in the update (transformers' load_balancing_loss_func,
    # which it adds only with output_router_logits; the metric actor/moe_aux_loss); null: the model config's
    # router_aux_loss_coef (0.001 where it has none, transformers' default); 0: logged, not trained. Dense: ignored
    router_aux_loss_coef: Optional[float] = None
    # rollout routing replay for a mixture-of-experts policy (verl's modes): disabled; R2 =
    # the old-log-prob forward records each token's experts and the update routes by them;
    # R3 = the rollout engine records them and both the old-log-prob forward and the update
    # route by them (the routing weights stay the live router's). Not for a dense model
    router_replay: str = "disabled"
    # extra terms of the loss from a recipe, by name (minihf.workers.aux_loss: a function that may
    # read the student's log-probs at chosen ids from the update's forward, and batch keys)
    aux_losses: dict[str, AuxLossConfig] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self):
        check_ppo_update(self)
        check_chunk("actor", self.logits_chunk_size)
        check_sp("actor", self.ulysses_sequence_parallel_size)
        if not self.clip_ratio > 0:
            raise ValueError(f"clip_ratio={self.clip_ratio} must be > 0")
        if self.clip_ratio_low is not None and not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} must be in [0, 1) (the ratio's "
                             "floor is 1 - clip_ratio_low)")
        if self.clip_ratio_high is not None and not self.clip_ratio_high >= 0:
            raise ValueError(f"clip_ratio_high={self.clip_ratio_high} must be >= 0 (the ratio's "
                             "ceiling is 1 + clip_ratio_high)")
        if not self.kl_loss_coef >= 0:
            raise ValueError(f"kl_loss_coef={self.kl_loss_coef} must be >= 0 (a negative weight "
                             "rewards moving away from the reference)")
        if self.router_replay not in ROUTER_REPLAY_MODES:
            raise ValueError(f"router_replay={self.router_replay!r}; choose one of {list(ROUTER_REPLAY_MODES)} "
                             "(disabled, or R2/R3 for a mixture-of-experts model)")
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf")):
            raise ValueError(f"router_aux_loss_coef={coef!r} must be a finite number >= 0 (e.g. 0.001), or "
                             "null for the model config's value")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (e.g. 3.0), or "
                             "null to disable the dual clip")
        if self.policy_loss.loss_mode == "gspo" and self.loss_agg_mode not in ("seq-mean-token-mean",
                                                                               "seq-mean-token-sum"):
            raise ValueError(f"policy_loss.loss_mode=gspo aggregates per sequence (seq-mean-token-mean), "
                             f"but loss_agg_mode={self.loss_agg_mode!r}: set loss_agg_mode=seq-mean-token-mean")
        if self.kl_loss_type not in KL_PENALTIES:
            raise ValueError(f"kl_loss_type={self.kl_loss_type!r}; choose one of "
                             f"{list(KL_PENALTIES)}")


@dataclass
class RefConfig:
    """The frozen reference policy (same checkpoint as the actor)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = 8  # rows per reference forward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per reference forward (wins when set)
    logits_chunk_size: Optional[int] = None  # as actor.logits_chunk_size, for the reference's forward
    ulysses_sequence_parallel_size: Optional[int] = None  # as actor's, for the reference's forward; null: actor's
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # param_offload: keep it on the host when idle

    def __post_init__(self):
        check_micro(self.log_prob_micro_batch_size_per_gpu, self.max_tokens_per_micro_batch)
        check_chunk("ref", self.logits_chunk_size)
        check_sp("ref", self.ulysses_sequence_parallel_size)


@dataclass
class ValKwargs:
    """Sampling for validation rollouts (``meta["validate"]``)."""
    n: int = 1                           # samples per validation prompt (mean@n)
    do_sample: bool = False              # false: greedy validation
    temperature: float = 0.0             # validation sampling temperature
    top_k: int = -1                      # validation top-k; -1: off
    top_p: float = 1.0                   # validation nucleus; 1.0: off

    def __post_init__(self):
        _check_sampling(self, "rollout.val_kwargs")


def _check_sampling(cfg, where: str) -> None:
    if not isinstance(cfg.n, int) or cfg.n < 1:
        raise ValueError(f"{where}.n={cfg.n!r} must be an int >= 1 (samples per prompt)")
    if cfg.temperature < 0:
        raise ValueError(f"{where}.temperature={cfg.temperature} must be >= 0 (0 = greedy)")
    if not isinstance(cfg.top_k, int) or cfg.top_k < -1:
        raise ValueError(f"{where}.top_k={cfg.top_k!r} must be an int; -1 or 0 disables it")
    if not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"{where}.top_p={cfg.top_p} must be in (0, 1] (1 = off)")


@dataclass
class RolloutConfig:
    """Generation inside the actor (the hybrid engine), verl's names.

    ``n`` samples per prompt (the driver repeats prompts); ``prompt_length`` +
    ``response_length`` bound the engine's sequences; ``tensor_model_parallel_size`` (t)
    must divide the actor's ranks: generation runs N/t replicas of TP t. ``reshard``:
    ``hybrid`` gathers each rank's TP slice inside its group of N/t ranks, ``naive``
    gathers every full weight on every rank, then slices (the baseline). ``free_cache_engine``
    frees the engine's weights and KV cache after each generation. A sample's random stream
    is a function of (``seed``, global step, prompt uid, sample index) only.
    ``check_log_probs``: each step, the engine's log-probs of the sampled tokens against the
    trainer's on the same tokens, within twice ``minihf.algorithms.logprob_rounding_bound``
    (``warn`` logs the worst token, ``error`` stops the run naming it; docs/hybrid-engine.md).
    """
    n: int = 1                           # samples per prompt
    temperature: float = 1.0             # sampling temperature
    top_k: int = -1                      # top-k sampling; -1 or 0: off
    top_p: float = 1.0                   # nucleus sampling; 1.0: off
    do_sample: bool = True               # false: greedy
    ignore_eos: bool = False             # every response runs to response_length (benchmarks)
    prompt_length: Optional[int] = None  # None: the PPO trainer sets data.max_prompt_length
    response_length: Optional[int] = None  # None: data.max_response_length
    tensor_model_parallel_size: int = 1  # generation TP size t (divides the actor's ranks)
    max_num_seqs: int = 256              # sequences decoded at once (continuous batching slots)
    max_num_batched_tokens: Optional[int] = None  # prefill token cap per engine step; null: none
    enable_chunked_prefill: bool = False  # a context over max_num_batched_tokens is prefilled in pieces over several steps while the others decode (needs max_num_batched_tokens)
    gpu_memory_utilization: float = 0.5  # of free CUDA memory (torch's unused cached blocks included), for the KV cache
    free_cache_engine: bool = True       # free engine weights and KV cache after each generation
    reshard: Literal["hybrid", "naive"] = "hybrid"  # hybrid: TP slices within N/t ranks; naive: gather all
    reshard_bucket_mb: int = 32          # small tensors travel together up to this size
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    seed: int = 0                        # base of every sample's seed (with step, uid, sample index)
    check_log_probs: Literal["off", "warn", "error"] = "off"  # engine vs trainer log-probs within rounding, every step
    free_base_weights: bool = False      # LoRA actor: sleeping frees the engine's base weights too (gathered again each step); default keeps them, so only the adapters move
    enforce_eager: bool = False          # false: on CUDA the decode step is a CUDA graph per bucket (captured at its second use, again after each sleep); CPU: the eager step with large weights prepacked, for oneDNN on AMD CPUs, for MKL on Intel's (models/linear.py: pack_kind); true: eager, no packing
    cudagraph_capture_sizes: Optional[list[int]] = None  # the decode step's batch buckets; null: powers of two up to max_num_seqs, and max_num_seqs
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    def __post_init__(self):
        _check_sampling(self, "rollout")
        if self.check_log_probs not in ("off", "warn", "error"):
            raise ValueError(f"rollout.check_log_probs={self.check_log_probs!r}; choose off, warn "
                             "or error")
        for key in ("prompt_length", "response_length", "tensor_model_parallel_size",
                    "max_num_seqs", "reshard_bucket_mb"):
            value = getattr(self, key)
            if value is None and key in ("prompt_length", "response_length"):
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{key}={value!r} must be an int >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} "
                             "must be >= 1, or null (no cap)")
        if self.enable_chunked_prefill and self.max_num_batched_tokens is None:
            raise ValueError("rollout.enable_chunked_prefill=true cuts prefills at "
                             "rollout.max_num_batched_tokens tokens a step, which is null; set it "
                             "too (e.g. rollout.max_num_batched_tokens=2048)")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not isinstance(sizes, list) or not sizes
                                  or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)):
            raise ValueError(f"rollout.cudagraph_capture_sizes={sizes!r} must be a non-empty list of ints >= 1 "
                             "(batch sizes, e.g. [1, 2, 4, 8, 16]), or null (powers of two up to max_num_seqs)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} "
                             "must be in (0, 1]")


@dataclass
class ActorRolloutRefConfig:
    """The hybrid actor/rollout/reference worker."""
    model: TrainedModelConfig = field(default_factory=TrainedModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # the actor role's worker class: minihf's, or a recipe's subclass of it (path/to/file.py:Class)
    worker: str = "ActorRolloutRefWorker"

    def __post_init__(self):
        check_actor_worker(self.worker)


@dataclass
class CriticConfig:
    """PPO value-function update (model.path may be a causal-LM checkpoint)."""
    model: TrainedModelConfig = field(default_factory=TrainedModelConfig)
    ppo_mini_batch_size: int = 16        # sequences per critic optimizer step, global
    ppo_micro_batch_size_per_gpu: Optional[int] = 4  # rows per forward/backward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per micro-batch (wins when set)
    forward_micro_batch_size_per_gpu: Optional[int] = 8  # rows per value forward (compute_values)
    ppo_epochs: int = 1                  # passes over each step's batch
    shuffle: bool = False                # reshuffle rows each epoch
    cliprange_value: float = 0.5         # value clipping around the old values
    loss_agg_mode: str = "token-mean"    # how token losses are averaged (see agg_loss)
    ulysses_sequence_parallel_size: int = 1  # as actor.ulysses_sequence_parallel_size, for the critic
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self):
        check_ppo_update(self)
        check_sp("critic", self.ulysses_sequence_parallel_size)
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value={self.cliprange_value} must be > 0 (the values "
                             "move at most this far from the old ones per update)")


@dataclass
class RewardModelConfig:
    """A learned reward model (score head; scored at the last response token)."""
    model: RLModelConfig = field(default_factory=RLModelConfig)
    micro_batch_size_per_gpu: Optional[int] = 8  # rows per reward-model forward
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per forward (wins when set)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self):
        check_micro(self.micro_batch_size_per_gpu, self.max_tokens_per_micro_batch)


@dataclass
class LogProbConfig:
    """A frozen causal LM that scores response tokens (``LogProbWorker``): a teacher in
    on-policy distillation, or a policy placed on ranks of its own."""
    model: RLModelConfig = field(default_factory=RLModelConfig)
    log_prob_micro_batch_size_per_gpu: Optional[int] = 8  # rows per forward (when no token budget)
    max_tokens_per_micro_batch: Optional[int] = None  # token budget per forward (wins when set)
    logits_chunk_size: Optional[int] = None  # as actor.logits_chunk_size, for this model's forward
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self):
        check_micro(self.log_prob_micro_batch_size_per_gpu, self.max_tokens_per_micro_batch)
        check_chunk("<role>", self.logits_chunk_size)
