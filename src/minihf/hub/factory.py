"""The tiny-model factory: a task tokenizer plus a random-init model, as an HF model dir.

``init_model(out, arch, size, task)`` writes what a downloaded checkpoint would hold
(config.json from transformers' own config class, safetensors weights via
``minihf.models.save_hf``, a tokenizer dir with a chat template, generation_config.json),
so everything downstream loads it through the real path: ``load_hf`` + ``load_tokenizer``.
No hub access is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minihf.data.tasks import get_task
from minihf.data.tokenizer import build_char_tokenizer, save_tokenizer
from minihf.utils.files import check_output_dir, staged_dir

ARCHS = ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "mixtral")
# The mixture-of-experts archs at each size: 8 experts, each token routed to 2 (weights
# renormalised), each expert half the dense MLP's width: a token uses as many MLP
# parameters as the dense model's, the layer holds 4x as many.
MOE_EXPERTS, MOE_TOP_K = 8, 2
# Embedding rows are padded to a multiple of this (as real checkpoints do, e.g. Qwen2's
# 151936 for ~151.6k tokens) so vocab-parallel sharding divides evenly; ids past the
# tokenizer's length decode to nothing.
VOCAB_MULTIPLE = 32


@dataclass(frozen=True)
class Size:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool


# Parameter counts are for a ~40-token vocabulary (embeddings are negligible):
# tiny ~0.1M (unit tests), mini ~0.9M (the main RL job), small ~5.0M and medium ~29.5M
# (the rollout benchmarks).
SIZES = {
    "tiny": Size(64, 2, 4, 2, 128, True),
    "mini": Size(128, 4, 4, 2, 448, True),
    "small": Size(256, 6, 8, 4, 832, True),
    "medium": Size(512, 10, 8, 4, 1408, False),
}


def check_choice(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")


def model_config(arch: str, size: str, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int,
                 max_position_embeddings: int = 2048):
    """A transformers config object (``Qwen2Config``, ...) for ``arch`` at ``size``."""
    import transformers

    check_choice(arch, size)
    s = SIZES[size]
    config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                  "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
                  "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.hidden_size // s.num_attention_heads,
        intermediate_size=s.intermediate_size,
        tie_word_embeddings=s.tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None  # full attention; minihf does not implement sliding windows
    if arch == "qwen3_moe":
        kwargs.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, norm_topk_prob=True,
                      moe_intermediate_size=s.intermediate_size // 2, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":  # its experts are intermediate_size wide; no dense MLP
        kwargs.update(num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                      intermediate_size=s.intermediate_size // 2)
    config = config_cls(**kwargs)
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return config


def init_model(out_dir: str | Path, arch: str = "qwen2", size: str = "tiny", task: str = "digits",
               seed: int = 0, max_position_embeddings: int = 2048, tokenizer: str | Path | None = None) -> Path:
    """Write a random-init model dir for ``task``'s alphabet; returns ``out_dir``.

    ``tokenizer``: a dir whose tokenizer (e.g. a real BPE one with its chat template) the
    model uses instead of a character tokenizer; ``task`` is then ignored."""
    from transformers import GenerationConfig

    from minihf.data.tokenizer import load_tokenizer
    from minihf.models import build_model, init_weights, load_args, save_hf

    task_module = get_task(task)
    check_choice(arch, size)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, "init-model: the model dir")
    if (out_dir / "config.json").exists() or (out_dir / "model.safetensors").exists():
        raise FileExistsError(f"{out_dir} already holds a model; choose a new directory or delete it first")
    if tokenizer is None:
        tokenizer = build_char_tokenizer(task_module.ALPHABET, model_max_length=max_position_embeddings,
                                         extra_roles=getattr(task_module, "EXTRA_ROLES", ()),
                                         extra_special_tokens=getattr(task_module, "EXTRA_SPECIAL_TOKENS", ()))
    else:
        tokenizer = load_tokenizer(tokenizer)
    with staged_dir(out_dir) as tmp:  # an interrupted build leaves no model dir a rerun would trust
        save_tokenizer(tokenizer, tmp)
        vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        config = model_config(arch, size, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id,
                              tokenizer.pad_token_id, max_position_embeddings)
        config.save_pretrained(str(tmp))  # the models package reads the config the way it reads any checkpoint
        model = init_weights(build_model(load_args(tmp)), seed)
        save_hf(model, tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(str(tmp))
    return out_dir

