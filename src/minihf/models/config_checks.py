"""Checks of a Hugging Face ``config.json`` before anything is built from it, and the
architecture names minihf supports.

``check_config(cfg, where)`` raises one ValueError naming the file (``where``), the key,
the value and the fix: missing or absurd sizes (each capped far above any real checkpoint,
and the parameter count they imply), heads that do not divide, booleans written as strings,
non-finite or out-of-range rope and norm settings, rope settings of each supported
``rope_type``, eos ids outside the vocabulary. ``minihf.models.args.ModelArgs.from_hf``
runs it on every config it reads, so every reader of a model's shape (the trainers,
``minihf plan``, the exporters) gets the same line.
"""

from __future__ import annotations

import math
from typing import Any

from minihf.utils.files import MODEL_FIX

# HF class-name prefix per arch, and HF class-name suffix per head kind.
ARCH_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
               "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}
MOE_ARCHS = ("qwen3_moe", "mixtral")
HEAD_SUFFIX = {"lm": "ForCausalLM", "score": "ForSequenceClassification", "value": "ForTokenClassification"}
SUPPORTED_ARCHITECTURES = {
    prefix + suffix: (arch, head)
    for arch, prefix in ARCH_PREFIX.items()
    for head, suffix in HEAD_SUFFIX.items()
}
ROPE_TYPES = ("default", "llama3", "linear")


def hf_architecture(arch: str, head: str) -> str:
    """The transformers class name for ``arch`` with ``head`` (e.g. Qwen2ForCausalLM)."""
    return ARCH_PREFIX[arch] + HEAD_SUFFIX[head]


def _unsupported(name: str, where: str | None = None) -> ValueError:
    causal = ", ".join(n for n in SUPPORTED_ARCHITECTURES if n.endswith("ForCausalLM"))
    return ValueError(
        (f"{where}: " if where else "") + f"unsupported architecture {name!r}: minihf.models supports {causal} "
        "(and their ForSequenceClassification / ForTokenClassification variants for reward "
        "and critic checkpoints). Convert the checkpoint to one of these or add the architecture."
    )


# config.json keys minihf reads as sizes: (key, required, what it counts, largest accepted).
# The caps are far above any real checkpoint (the largest value seen is in the comment) and
# stop a typo (an extra digit, 10**12) before it becomes a terabyte allocation or a build
# that never ends (every layer and head is built as Python modules up front).
_SIZES = (("vocab_size", True, "tokens in the vocabulary", 2**24),          # ~262k (Gemma 3)
          ("hidden_size", True, "the model width", 2**20),                  # 16384 (Llama 3.1 405B)
          ("num_hidden_layers", True, "decoder layers", 2**12),             # 126
          ("num_attention_heads", True, "query heads", 2**12),              # 128
          ("intermediate_size", True, "the MLP width", 2**20),              # 53248
          ("num_key_value_heads", False, "KV heads", 2**12),
          ("head_dim", False, "features per head", 2**12),                  # 256
          # ~1M (Qwen2.5-1M); on a GPU the RoPE table holds one row per position
          ("max_position_embeddings", False, "the context length", 2**24))
# The parameter count the sizes imply, at most: 2**40 (~1.1T, 2 TiB in bf16) is 2.7x the
# largest dense Llama-family checkpoint (Llama 3.1 405B). Each size can be within its cap
# while their product is not (vocab_size and hidden_size both near theirs).
MAX_PARAMETERS = 2**40
# config.json keys minihf reads as booleans. JSON ``"false"`` (a string) is truthy in Python,
# so a quoted value would silently mean the opposite: only true, false or null are taken.
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob")
# The rope fields each supported rope_type reads (besides rope_theta), all numbers > 0.
_ROPE_FIELDS = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _quoted(value: Any) -> str:
    return " (a string: write it without quotes)" if isinstance(value, str) else ""


def check_token_ids(value: Any, key: str, where: str, vocab_size: Any, fix: str) -> tuple[int, ...]:
    """``value`` (an id or a list of ids, e.g. ``eos_token_id``) as a tuple, each a whole
    number in ``[0, vocab_size)`` when ``vocab_size`` is a whole number; ``()`` for null.
    An id outside the embedding can never be sampled, so generation would never stop on it.
    A ValueError naming ``where`` and ``key`` otherwise."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    vocab = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab is not None and i >= vocab):
            span = f"0 to {vocab - 1}, vocab_size={vocab} in config.json" if vocab is not None else "0 or more"
            raise ValueError(f"{where}: {key}={value!r} must be a token id (a whole number from {span}) "
                             f"or a list of them{_quoted(i)}; {fix}")
    return tuple(ids)


def _arch_and_head(cfg: dict, where: str) -> tuple[str, str]:
    """The minihf arch and head kind named by ``architectures`` (else ``model_type``)."""
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        example = f'["{archs}"]' if isinstance(archs, str) else '["Qwen2ForCausalLM"]'
        raise ValueError(f"{where}: architectures={archs!r} must be a list of class names, e.g. "
                         f"{example}; fix that value in config.json, or {MODEL_FIX}")
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(archs[0], where)
        return SUPPORTED_ARCHITECTURES[archs[0]]
    arch = cfg.get("model_type", "<missing model_type>")
    if arch not in ARCH_PREFIX:
        raise _unsupported(arch, where)
    return arch, "lm"


def _rope_source(cfg: dict) -> tuple[str, dict]:
    """Which key holds the rope settings minihf uses, and their dict (empty: default rope).
    transformers >= 5 nests them (with rope_theta) in rope_parameters, <= 4 has rope_scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or cfg.get("rope_scaling") is None):
        return "rope_parameters", params
    return "rope_scaling", cfg.get("rope_scaling") or {}


def _check_rope(cfg: dict, where: str, fix: str) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {key}={value!r} must be a JSON object (e.g. "
                             f'{{"rope_type": "linear", "factor": 2.0}}) or null; {fix}')
    thetas = [("rope_theta", cfg.get("rope_theta"))]
    if isinstance(cfg.get("rope_parameters"), dict):
        thetas.append(("rope_parameters.rope_theta", cfg["rope_parameters"].get("rope_theta")))
    for key, value in thetas:
        if value is not None and not (_is_number(value) and value > 0):
            raise ValueError(f"{where}: {key}={value!r} must be a finite number > 0 (the RoPE base, e.g. "
                             f"10000.0){_quoted(value)}; {fix}")
    key, scaling = _rope_source(cfg)
    type_key = "rope_type" if scaling.get("rope_type") or not scaling.get("type") else "type"  # as _parse_rope
    kind = scaling.get(type_key) or "default"
    if not isinstance(kind, str) or kind not in _ROPE_FIELDS:
        raise ValueError(f"{where}: unsupported {key}.{type_key}={kind!r} (in {key}={scaling!r}): "
                         f"minihf supports rope_type in {ROPE_TYPES}; {fix}")
    for name in _ROPE_FIELDS[kind]:
        value = scaling.get(name)
        if not (_is_number(value) and value > 0):
            what = " is missing" if value is None else f"={value!r} must be a finite number > 0"
            raise ValueError(f"{where}: {key}.{name}{what} (rope_type {kind!r} reads it){_quoted(value)}; {fix}")
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if not high > low:  # the smooth ramp between the two wavelengths divides by high - low
            raise ValueError(f"{where}: {key}.high_freq_factor={high!r} must be greater than "
                             f"low_freq_factor={low!r} (llama3 rope); {fix}")
        old = scaling.get("original_max_position_embeddings")
        if old is not None and (isinstance(old, bool) or not isinstance(old, int) or old < 1):
            raise ValueError(f"{where}: {key}.original_max_position_embeddings={old!r} must be a whole "
                             f"number >= 1{_quoted(old)}; {fix}")


def moe_experts(cfg: dict) -> Any:
    """The expert count a MoE config gives: ``num_experts`` (Qwen3-MoE's name) or
    ``num_local_experts`` (Mixtral's, which transformers 5 also writes for Qwen3-MoE)."""
    value = cfg.get("num_experts")
    return cfg.get("num_local_experts") if value is None else value


def _check_moe(arch: str, cfg: dict, where: str, fix: str) -> None:
    """A MoE config's expert settings: counts whole and in range, top-k <= experts, the
    sparse-layer rule's values, a finite non-negative load-balancing coefficient."""
    key = "num_local_experts" if cfg.get("num_experts") is None else "num_experts"
    experts = moe_experts(cfg)
    sizes = [(key, experts, "experts per MoE layer"), ("num_experts_per_tok", cfg.get("num_experts_per_tok"),
             "experts each token is routed to")]
    if arch == "qwen3_moe":
        sizes += [("moe_intermediate_size", cfg.get("moe_intermediate_size"), "each expert's MLP width"),
                  ("decoder_sparse_step", cfg.get("decoder_sparse_step", 1), "layers per MoE layer")]
    for name, value, what in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            missing = " is missing" if value is None else f"={value!r} must be a whole number >= 1"
            raise ValueError(f"{where}: {name}{missing} ({what}; {arch} is a mixture-of-experts model)"
                             f"{_quoted(value)}; {fix}")
        if value > 2**16:
            raise ValueError(f"{where}: {name}={value} ({what}) is past the most minihf accepts, 65536; {fix}")
    if cfg["num_experts_per_tok"] > experts:
        raise ValueError(f"{where}: num_experts_per_tok={cfg['num_experts_per_tok']} is more than the "
                         f"{experts} experts ({key}); a token is routed to at most every expert; {fix}")
    only = cfg.get("mlp_only_layers") if arch == "qwen3_moe" else None
    if only is not None and not (isinstance(only, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg["num_hidden_layers"] for i in only)):
        raise ValueError(f"{where}: mlp_only_layers={only!r} must be a list of layer indices from 0 to "
                         f"{cfg['num_hidden_layers'] - 1} (layers kept dense); {fix}")
    coef = cfg.get("router_aux_loss_coef")
    if coef is not None and not (_is_number(coef) and coef >= 0):
        raise ValueError(f"{where}: router_aux_loss_coef={coef!r} must be a finite number >= 0 (the "
                         f"load-balancing loss's weight, e.g. 0.001){_quoted(coef)}; {fix}")


def _moe_layers(cfg: dict) -> int:
    """How many layers of a checked MoE config are sparse (transformers' rule)."""
    if cfg.get("model_type") == "mixtral" or (cfg.get("architectures") or [""])[0].startswith("Mixtral"):
        return cfg["num_hidden_layers"]
    step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(cfg["num_hidden_layers"]) if i not in only and (i + 1) % step == 0)


def implied_parameters(cfg: dict, active: bool = False) -> int:
    """Parameters of the LM model a checked config.json describes (embeddings, an untied
    lm_head, attention, MLP or experts and router, norms; biases are negligible and left
    out). ``active``: those one token uses (its ``num_experts_per_tok`` experts per MoE
    layer, every router)."""
    vocab, hidden, layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)  # q, o and k, v
    ffn = 3 * hidden * cfg["intermediate_size"]
    sparse = 0
    experts = moe_experts(cfg)
    if experts:  # a MoE config (checked before this is called)
        sparse = _moe_layers(cfg)
        width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        used = cfg["num_experts_per_tok"] if active else experts
        moe = 3 * hidden * width * used + experts * hidden
    per_layer = attention + 2 * hidden
    body = layers * per_layer + (layers - sparse) * ffn + (sparse * moe if sparse else 0)
    return vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2) + body + hidden


def check_config(cfg: Any, where: str) -> None:
    """A config.json's values before anything is built from them: a ValueError naming
    ``where`` (the file), the key, the value and the fix for

    * a missing size, or one that is not a whole number >= 1 (``0``, ``-4``, ``"32"``,
      ``true``) or past its cap (``_SIZES``), and sizes that imply more than
      ``MAX_PARAMETERS`` parameters;
    * ``architectures`` that is not a list of names, or names no supported architecture;
    * booleans that are not JSON booleans (``"false"`` would read as true);
    * ``rms_norm_eps`` not finite in (0, 1), ``rope_theta`` not finite > 0, rope settings
      that are not an object, an unsupported rope type or a field it reads that is missing
      or not finite > 0;
    * head counts that do not divide, a head dim that is 0 or odd (rotary embeddings turn
      pairs of features), an unsupported ``hidden_act``, a ``sliding_window`` in use that is
      not a whole number, an ``eos_token_id`` outside the vocabulary.

    A zero used to surface deep inside the build (``max() arg is an empty sequence`` for no
    layers), a huge size as a terabyte allocation."""
    fix = f"fix that value in config.json, or {MODEL_FIX}"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must be a JSON object of the model's settings, got "
                         f"{type(cfg).__name__}; {MODEL_FIX}")
    arch, _ = _arch_and_head(cfg, where)
    for key, required, what, cap in _SIZES:
        if key not in cfg or cfg[key] is None:
            if required:
                raise ValueError(f"{where} has no {key} ({what}); add it to config.json, or {MODEL_FIX}")
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            kind = " (a string: write the number without quotes)" if isinstance(value, str) else ""
            raise ValueError(f"{where}: {key}={value!r} must be a whole number >= 1 ({what}){kind}; {fix}")
        if value > cap:
            raise ValueError(f"{where}: {key}={value} ({what}) is past the most minihf accepts, "
                             f"{cap} (2**{cap.bit_length() - 1}), far above any real checkpoint's; {fix}")
    for key in _BOOLS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{where}: {key}={value!r} must be true or false, a JSON boolean"
                             f"{_quoted(value)}; {fix}")
    eps = cfg.get("rms_norm_eps")
    # eps guards the RMSNorm's division by the root mean square of activations that are ~1
    # (real checkpoints use 1e-6..1e-5); one >= 1 swamps them, so nothing is normalised
    if eps is not None and not (_is_number(eps) and 0 < eps < 1):
        raise ValueError(f"{where}: rms_norm_eps={eps!r} must be a number > 0 and < 1 (e.g. 1e-06; it is "
                         f"added to the mean square of activations near 1){_quoted(eps)}; {fix}")
    init = cfg.get("initializer_range")
    if init is not None and not (_is_number(init) and init >= 0):
        raise ValueError(f"{where}: initializer_range={init!r} must be a finite number >= 0 (e.g. 0.02)"
                         f"{_quoted(init)}; {fix}")
    _check_rope(cfg, where, fix)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
                         f"(each KV head serves a whole group of query heads); {fix}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim < 1 or head_dim % 2:
        source = (f"head_dim={head_dim}" if cfg.get("head_dim") else
                  f"hidden_size={cfg['hidden_size']} // num_attention_heads={heads} gives head_dim={head_dim}")
        raise ValueError(f"{where}: {source}, which must be even and >= 2 (rotary embeddings turn pairs of "
                         f"features); {fix}")
    if arch in MOE_ARCHS:
        _check_moe(arch, cfg, where, fix)
    params = implied_parameters(cfg)
    if params > MAX_PARAMETERS:
        raise ValueError(f"{where}: its sizes (vocab_size={cfg['vocab_size']}, hidden_size={cfg['hidden_size']}, "
                         f"num_hidden_layers={cfg['num_hidden_layers']}, intermediate_size="
                         f"{cfg['intermediate_size']}) imply {params / 1e12:.3g}T parameters, past the "
                         f"{MAX_PARAMETERS / 1e12:.2g}T minihf accepts (the largest dense checkpoints have "
                         f"~0.4T); {fix}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act={act!r} is not supported: minihf's MLP is SwiGLU (silu); "
                         "Llama-family checkpoints use 'silu'; convert the checkpoint or set "
                         "hidden_act to \"silu\" if it really is SwiGLU")
    if arch in ("mistral", "mixtral") or (arch in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window")):
        window = cfg.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{where}: sliding_window={window!r} must be a whole number >= 1 (tokens "
                             f"each position attends to) or null{_quoted(window)}; {fix}")
    check_token_ids(cfg.get("eos_token_id"), "eos_token_id", where, cfg["vocab_size"], fix)


def context_error(lengths: str, total: int, max_position_embeddings: int, model: str,
                  fix: str) -> str | None:
    """The one line for a prompt + response length past a model's context (``lengths``, e.g.
    ``"data.max_prompt_length + data.max_response_length = 512 + 4096"``, sums to
    ``total``), naming ``model`` and the ``fix``; None when it fits. Training refuses such a
    config at start-up with this wording (``ppo_job.check_rollout_tp``), ``minihf eval``,
    ``minihf generate`` and the engine (``max_model_len``) too: past it the positions have no trained rotary angles and a
    KV cache of the length asked for is allocated (or filled for minutes) first."""
    if total <= max_position_embeddings:
        return None
    return (f"{lengths} exceeds the model's context, max_position_embeddings="
            f"{max_position_embeddings} ({model}); {fix}")
