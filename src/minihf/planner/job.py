"""The RL job as the planner sees it: each role's model shape and the step's workload.

Read from a ``PPOJobConfig`` (recipe + overrides, as ``train_ppo.py`` takes them): which
roles exist, their model dirs (``config.json``; or a named shape such as ``llama-7b`` for a
model that is not on this machine), batch sizes, lengths, n and epochs (the micro-batch sizes are the planner's to choose).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Llama-2 shapes (7B, 13B, 70B) and CodeLlama-34B's, the models of the HybridFlow paper's
# experiments (vocab 32000, context 4096; 34B and 70B use 8 KV heads).
NAMED_SHAPES = {
    "llama-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008),
    "llama-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                      intermediate_size=13824),
    "llama-34b": dict(hidden_size=8192, num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=22016),
    "llama-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=28672),
}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of one role's model."""
    params: int                          # all parameters (exact, from the built model)
    layers: int
    hidden: int
    kv_dim: int                          # num_key_value_heads x head_dim
    heads: int
    kv_heads: int
    vocab: int
    ffn: int                             # MLP intermediate size (MoE: the routed experts' together)
    largest_block: int                   # parameters of the largest FSDP unit but the root
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of every parameter, in order
    tied: bool
    active_params: int | None = None     # those one token's forward uses (a MoE model's routed experts); None: params

    @property
    def active(self) -> int:
        """Parameters one token's forward multiplies by (the FLOP count's): all of a dense
        model's, a mixture-of-experts model's less its unrouted experts."""
        return self.params if self.active_params is None else self.active_params

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_dim * itemsize


def _args(spec: str):
    from minihf.models import ModelArgs, load_args

    if spec in NAMED_SHAPES:
        return ModelArgs(arch="llama", vocab_size=32000, head_dim=NAMED_SHAPES[spec]["hidden_size"]
                         // NAMED_SHAPES[spec]["num_attention_heads"], max_position_embeddings=4096,
                         **NAMED_SHAPES[spec])
    if Path(spec, "config.json").is_file():
        return load_args(spec)
    raise ValueError(f"model {spec!r}: no config.json there, and not a named shape "
                     f"({', '.join(NAMED_SHAPES)}); pass a model dir or a name")


@lru_cache(maxsize=32)
def model_shape(spec: str, head: str = "lm") -> ModelShape:
    """The shape of ``spec`` (a model dir, or a name in ``NAMED_SHAPES``) with ``head``."""
    from minihf.models import build_model

    args = _args(spec)
    model = build_model(args, head, device="meta")
    shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    block = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    total = sum(math.prod(s) for _, s in shapes)
    unrouted = sum((len(layer.ffn.experts) - args.num_experts_per_tok) * sum(
                   p.numel() for p in layer.ffn.experts[0].parameters())
                   for layer in model.model.layers if args.is_moe_layer(layer.self_attn.layer_idx))
    ffn = args.moe_intermediate_size * args.num_experts_per_tok if args.is_moe else args.intermediate_size
    return ModelShape(total, args.num_hidden_layers, args.hidden_size,
                      args.num_key_value_heads * args.head_dim, args.num_attention_heads,
                      args.num_key_value_heads, args.vocab_size, ffn, block, shapes,
                      args.tie_word_embeddings, active_params=total - unrouted if args.is_moe else None)


def lora_params(spec: str, head: str, rank: int, targets, exclude) -> int:
    """Parameters of rank-``rank`` adapters on the modules ``targets``/``exclude`` select in
    ``spec``'s model (``minihf.models.lora``), plus a value or score head (trained in full)."""
    from minihf.models import build_model
    from minihf.models.lora import module_names, trained_with_lora

    model = build_model(_args(spec), head, device="meta")
    adapters = sum(rank * (m.in_features + m.out_features)
                   for m in map(model.get_submodule, module_names(model, targets, exclude)))
    return adapters + sum(p.numel() for n, p in model.named_parameters()
                          if trained_with_lora(n, head))


@dataclass(frozen=True)
class Role:
    name: str
    model: ModelShape
    trains: bool                         # has gradients and AdamW state
    epochs: int = 1
    mini_batch: int = 0                  # sequences per optimizer step (trained roles)
    activation_checkpointing: bool = False
    wrap_blocks: bool = True
    token_budget: bool = False           # the config cuts micro-batches by tokens (max_tokens_per_micro_batch)
    lora_params: int | None = None       # LoRA: the adapters' parameters (the base is frozen); None: all train
    logits_chunk: int | None = None      # tokens whose logits exist at a time (actor.logits_chunk_size); None: all
    sp: int = 1                          # ranks that split each micro-batch's tokens (ulysses_sequence_parallel_size)
    # the role table's row (minihf.roles): its forward in a step, its micro-batch keys in rows and
    # as a token budget; empty: the row minihf declares for the name
    forward: str = ""
    micro_keys: tuple[str, ...] = ()
    token_keys: tuple[str, ...] = ()

    def row_keys(self) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """``(forward, micro_keys, token_keys)`` of its role-table row."""
        if self.micro_keys:
            return self.forward, self.micro_keys, self.token_keys
        from minihf.roles import declared

        row = declared(self.name, self.trains)
        return row.forward, row.micro_keys, row.token_keys

    @property
    def trained_params(self) -> int:
        """Parameters with gradients and AdamW state."""
        return self.model.params if self.lora_params is None else self.lora_params


@dataclass(frozen=True)
class Workload:
    """One RL step: ``sequences`` = prompts x n rows of ``prompt_len + response_len`` tokens."""
    prompts: int
    n: int
    prompt_len: int
    response_len: int
    share_prompt: bool                   # packed forwards run each prompt once per n responses
    recompute_old_log_prob: bool
    use_ref: bool
    roles: tuple[Role, ...]

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def forward_tokens(self) -> int:
        """Tokens one forward over the step's batch computes."""
        prompt_rows = self.prompts if self.share_prompt else self.sequences
        return prompt_rows * self.prompt_len + self.sequences * self.response_len

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)


def workload(cfg, models: dict[str, str] | None = None) -> Workload:
    """The workload of ``cfg`` (a ``PPOJobConfig``); ``models`` maps a role (or ``all``) to a
    model spec that replaces its ``model.path``."""
    from minihf.config import section_of
    from minihf.roles import planned_roles

    rows = planned_roles(cfg)  # the role table's rows (minihf.roles): core, Safe-RLHF's, the recipe's
    models = dict(models or {})
    unknown = sorted(set(models) - {r.name for r in rows} - {"all"})
    if unknown:
        raise ValueError(f"--model {unknown[0]}=...: roles are {', '.join(['all', *(r.name for r in rows)])}")
    a, d = cfg.actor_rollout_ref, cfg.data

    def role(row) -> Role:
        model_cfg = section_of(cfg, row.section).model
        spec = models.get(row.name, models.get("all", model_cfg.path))
        shape = model_shape(spec, row.head)
        keys = dict(forward=row.forward, micro_keys=row.micro_keys, token_keys=row.token_keys)
        if not row.trains:
            return Role(row.name, shape, False, token_budget=section_of(cfg, row.token_keys[0]) is not None, **keys)
        section = section_of(cfg, row.trains)
        lora = (lora_params(spec, row.head, model_cfg.lora_rank, model_cfg.target_modules,
                            model_cfg.exclude_modules) if getattr(model_cfg, "lora", False) else None)
        owner = section if hasattr(section, "fsdp") else section_of(cfg, row.section)  # a recipe role's train
        return Role(row.name, shape, True, section.ppo_epochs, section.ppo_mini_batch_size,
                    owner.fsdp.activation_checkpointing, owner.fsdp.wrap_blocks,
                    section.max_tokens_per_micro_batch is not None, lora,
                    getattr(owner, "logits_chunk_size", None), getattr(section, "ulysses_sequence_parallel_size", 1),
                    **keys)

    roles = [role(r) for r in rows]
    # the driver's own rule (and the log-prob check adds the pass too)
    old = cfg.old_log_prob_source == "recompute" or a.rollout.check_log_probs != "off"
    return Workload(d.train_batch_size, a.rollout.n, d.max_prompt_length, d.max_response_length,
                    a.model.shares_prompt, old, cfg.use_ref, tuple(roles))
