"""ModelArgs: the architecture hyper-parameters of a Llama-family decoder, dense or
mixture-of-experts (Qwen3-MoE, Mixtral).

Built from a Hugging Face ``config.json`` (a dict, a path, or a transformers config
object), whose values are checked first (``minihf.models.config_checks.check_config``: one
line naming the file, the key, the value and the fix; every reader of a model's shape, the
trainers, ``minihf plan`` and the exporters, goes through ``from_hf``), and turned back into one for saving. Both
rope layouts are understood: transformers <= 4.x keeps ``rope_theta`` and ``rope_scaling``
at the top level, transformers 5.x nests both in ``rope_parameters``. The raw config is
kept in ``hf_config`` so a save writes back what was loaded, with only the head and dtype
updated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minihf.utils.files import MODEL_FIX, read_json

from minihf.models.config_checks import (MOE_ARCHS, moe_experts, ARCH_PREFIX, ROPE_TYPES, hf_architecture, _unsupported, check_config, _arch_and_head, _rope_source)  # noqa: F401 (re-exported)

@dataclass
class ModelArgs:
    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # always carries "rope_type" when not None
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` also biases o_proj; Qwen2 does not
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    sliding_window: int | None = None  # informational: minihf attends over the full context
    # mixture of experts (num_experts 0: dense). Qwen3-MoE's names; Mixtral's
    # num_local_experts is read as num_experts and its top-k weights are always renormalised
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # every this many layers is sparse (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (Qwen3-MoE)
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the config (HF's name)
    head: str = "lm"  # head kind of the checkpoint these args were read from
    hf_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.arch not in ARCH_PREFIX:
            raise _unsupported(self.arch)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; fix the config."
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling {self.rope_scaling!r}: minihf supports rope_type in "
                f"{ROPE_TYPES}."
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (transformers' rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_hf(cls, config: Any) -> "ModelArgs":
        """Build from a config dict, a transformers config object, a checkpoint dir or a
        path to ``config.json``."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
                if not path.exists():
                    raise FileNotFoundError(_no_config_message(path.parent))
            elif not path.exists():
                raise FileNotFoundError(f"model dir {path} does not exist; pass a Hugging Face model "
                                        "dir (config.json + model.safetensors)")
            cfg, where = read_json(path, MODEL_FIX), str(path)
        elif isinstance(config, dict):
            cfg, where = copy.deepcopy(config), "the model config"
        elif hasattr(config, "to_dict"):
            cfg, where = config.to_dict(), f"the {type(config).__name__}"
        else:
            raise TypeError(f"cannot read model args from {type(config).__name__}; pass a dict, "
                            "a path or a transformers config")
        check_config(cfg, where)
        return cls(**_parse(cfg))

    # ---------------------------------------------------------------- writing
    def to_hf_config(self, head: str = "lm", dtype: str | None = None) -> dict:
        """A config.json dict for this model with ``head`` (lm|value|score)."""
        cfg = copy.deepcopy(self.hf_config)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling)
        cfg.update(
            architectures=[hf_architecture(self.arch, head)],
            model_type=self.arch,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            hidden_act=cfg.get("hidden_act", "silu"),
        )
        if self.arch in ("llama", "qwen3", "qwen3_moe"):
            cfg["attention_bias"] = self.attention_bias
        if self.arch == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        if self.is_moe:
            cfg.update(num_experts_per_tok=self.num_experts_per_tok,
                       router_aux_loss_coef=self.router_aux_loss_coef)
            if self.arch == "mixtral":
                cfg["num_local_experts"] = self.num_experts
            else:
                cfg.update(moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                           decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
                cfg.setdefault("num_experts", self.num_experts)
                if "num_local_experts" in cfg:  # transformers 5 writes this name for Qwen3-MoE too
                    cfg["num_local_experts"] = self.num_experts
        if "rope_parameters" in cfg or "rope_theta" not in cfg:
            cfg["rope_parameters"] = rope  # transformers >= 5 layout
        if "rope_theta" in cfg or "rope_parameters" not in self.hf_config:
            # transformers <= 4 layout; written too for configs built in code so both read it
            cfg["rope_theta"] = self.rope_theta
            cfg["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        if head in ("value", "score"):
            cfg["num_labels"] = 1
            cfg["id2label"] = {"0": "LABEL_0"}
            cfg["label2id"] = {"LABEL_0": 0}
        if dtype is not None:
            cfg["dtype"] = dtype
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = dtype
        return cfg


def _no_config_message(path: Path) -> str:
    """Why ``path`` (an existing dir without config.json) is not a model dir, and what to do."""
    msg = f"{path} has no config.json (expected a Hugging Face model dir)"
    if (path / "meta.json").exists() or (path / ".metadata").exists() or (path / "model" / ".metadata").exists():
        return (msg + "; this looks like a training checkpoint; run `minihf export CKPT OUT` first "
                f"(e.g. `minihf export {path} {path}-hf`) and pass OUT")
    if any(path.glob("pytorch_model*.bin")):
        return (msg + "; it holds pytorch_model.bin weights, which minihf does not read: convert with "
                "transformers (`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)` "
                "writes config.json and model.safetensors)")
    return msg


def _parse(cfg: dict) -> dict:
    """ModelArgs fields from a config dict ``check_config`` accepted."""
    arch, head = _arch_and_head(cfg, "the model config")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope_theta, rope_scaling = _parse_rope(cfg)
    attn_bias = bool(cfg.get("attention_bias"))  # a checked JSON boolean or null
    window = None
    if arch in ("mistral", "mixtral") or (arch in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window")):
        window = cfg.get("sliding_window")
    return dict(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=_get(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=True if arch == "qwen2" else (attn_bias if arch in ("llama", "qwen3", "qwen3_moe") else False),
        o_proj_bias=attn_bias if arch in ("llama", "qwen3", "qwen3_moe") else False,
        mlp_bias=bool(cfg.get("mlp_bias")) if arch == "llama" else False,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        max_position_embeddings=_get(cfg, "max_position_embeddings", 4096),
        initializer_range=_get(cfg, "initializer_range", 0.02),
        sliding_window=window,
        **_parse_moe(arch, cfg),
        head=head,
        hf_config=cfg,
    )


def _parse_moe(arch: str, cfg: dict) -> dict:
    """The MoE fields of a checked config (none for a dense arch)."""
    if arch not in MOE_ARCHS:
        return {}
    return dict(
        num_experts=moe_experts(cfg),
        num_experts_per_tok=cfg["num_experts_per_tok"],
        # Mixtral's experts are intermediate_size wide and its top-k weights always renormalised
        moe_intermediate_size=cfg["intermediate_size"] if arch == "mixtral" else cfg["moe_intermediate_size"],
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob")),
        decoder_sparse_step=1 if arch == "mixtral" else _get(cfg, "decoder_sparse_step", 1),
        mlp_only_layers=() if arch == "mixtral" else tuple(cfg.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", 0.001)),  # transformers' default
    )


def _get(cfg: dict, key: str, default: Any) -> Any:
    """``cfg[key]``, or ``default`` when it is absent or null."""
    return default if cfg.get(key) is None else cfg[key]


def _parse_rope(cfg: dict) -> tuple[float, dict | None]:
    scaling = dict(_rope_source(cfg)[1])
    theta = float(scaling.pop("rope_theta", None) or _get(cfg, "rope_theta", 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}
