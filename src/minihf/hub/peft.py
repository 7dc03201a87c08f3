"""PEFT adapter dirs in and out: what ``peft.PeftModel.from_pretrained`` reads and
``save_pretrained`` writes (``adapter_config.json`` + ``adapter_model.safetensors``).

:func:`write_adapter_dir` exports a LoRA checkpoint's adapters (``minihf export``). Every
adapter dir minihf reads goes through the two checks here, so each problem is one line
naming the file and the key or tensor, before any model runs:

* :func:`read_adapter_dir` -- the dir alone: the config is a JSON object with a positive
  integer ``r`` equal to the tensors' rank and a positive ``lora_alpha``; no field asks for
  something minihf would silently run differently (DoRA, rsLoRA, per-module ranks, trained
  biases, layer replication, adapters on some layers only, ...: peft's LoRA variants and
  semantics-changing fields, see ``UNSUPPORTED``); the safetensors file is readable, holds
  an A and a B of consistent shapes for each module, only for linear layers (no embedding
  adapters), every value finite, and ``B A alpha / r`` finite in float32.
* :func:`check_adapter` -- the dir against the model it is put on: each adapted module is
  one of the model's projections with the tensors' shapes, the tensors cover exactly the
  modules ``target_modules`` / ``exclude_modules`` select (peft's matching), and, when
  training starts from it, ``base_model_name_or_path`` is the run's model dir.

``minihf eval`` / ``generate`` merge an adapter dir into its base
(``minihf.hub.export.merge_adapter_dir``) and training starts from one
(``model.lora_adapter_path``: ``minihf.workers.engine.adapter_state``); both call both.
``lora_dropout`` is accepted and unused (minihf's LoRA has no dropout; it never changes
what a trained adapter computes).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from minihf.config import ConfigError
from minihf.models.lora import ALL_LINEAR, TARGETS, adaptable, from_peft_state, to_peft_state
from minihf.utils.files import CorruptFileError, open_safetensors, read_json, staged_dir

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FIX = "re-save the adapter (peft's save_pretrained, or `minihf export CKPT OUT` of a checkpoint)"
PLAIN = ("minihf runs plain LoRA only; merge the adapter with peft (merge_and_unload) and pass "
         "the merged model dir")
# peft fields that make a model other than ``W x + B A x * alpha / r`` on the listed
# modules (peft's LoRA variants are the fields it tags ``is_lora_variant``), with the value
# that means "off", and what they do
UNSUPPORTED = {
    "use_dora": (False, "DoRA rescales each weight by a trained magnitude"),
    "use_rslora": (False, "rsLoRA scales by alpha / sqrt(r), not alpha / r"),
    "bias": ("none", "the adapter trained biases"), "lora_bias": (False, "the adapter trained biases"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights"),
    "rank_pattern": ({}, "per-module ranks"), "alpha_pattern": ({}, "per-module alphas"),
    "modules_to_save": (None, "fully trained modules beside the adapters"),
    "layer_replication": (None, "layers duplicated into a deeper model"),
    "layers_to_transform": (None, "adapters on some layers only"),
    "layers_pattern": (None, "adapters on some layers only"),
    "trainable_token_indices": (None, "trained embedding rows"),
    "target_parameters": (None, "adapters on raw parameters (e.g. MoE experts)"),
    "use_qalora": (False, "QALoRA's pooled inputs"),
    **{key: (None, "a LoRA variant") for key in ("alora_invocation_tokens", "velora_config",
                                                 "monteclora_config", "use_bdlora", "arrow_config",
                                                 "kasa_config")},
}
# init_lora_weights only says how training began, except where peft changed the base
# weights at init (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) or runs a variant (MiCA)
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
_EMBEDDING_KEY = re.compile(r"\.lora_embedding_[AB]\b")
FP32_MAX = torch.finfo(torch.float32).max


@dataclass
class Adapter:
    """A PEFT LoRA adapter dir that passed :func:`read_adapter_dir`'s checks."""
    path: Path
    rank: int                                   # r
    alpha: float                                # lora_alpha
    target_modules: str | list[str] | None
    exclude_modules: str | list[str] | None
    base: str | None                            # base_model_name_or_path
    tensors: dict[str, torch.Tensor]            # minihf names (``...q_proj.lora_A``), as stored
    keys: dict[str, str]                        # minihf name -> the file's tensor name

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS

    @property
    def modules(self) -> list[str]:
        return sorted({n.rpartition(".")[0] for n in self.tensors})


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_adapter_dir(path: str | Path) -> Adapter:
    """The adapter dir ``path``, checked on its own (see the module docstring). Raises
    FileNotFoundError, CorruptFileError (an unreadable file, broken tensors) or ConfigError
    (a config value), each one line naming the file and the key or tensor."""
    path = Path(path)
    if not is_adapter_dir(path):
        raise FileNotFoundError(f"{path} is not a PEFT adapter dir (no {CONFIG}); pass a dir "
                                "written by peft's save_pretrained or `minihf export`")
    where = path / CONFIG
    cfg = read_json(where, FIX)
    if not isinstance(cfg, dict):
        raise CorruptFileError(f"{where} holds a JSON {type(cfg).__name__}, not an object of LoRA "
                               f"settings (r, lora_alpha, target_modules, ...); {FIX}")
    _check_fields(cfg, where)
    keys, tensors = _read_tensors(path / WEIGHTS)
    rank = _check_rank(cfg, where, tensors, keys)
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        shown = " is missing" if "lora_alpha" not in cfg else f"={alpha!r} is not a number > 0"
        raise ConfigError(f"{where}: lora_alpha{shown}; set it to the alpha the adapter was trained "
                          f"with (its scale is lora_alpha / r; peft's default is 8)")
    adapter = Adapter(path, rank, float(alpha), cfg.get("target_modules"), cfg.get("exclude_modules"),
                      cfg.get("base_model_name_or_path"), tensors, keys)
    _check_finite(adapter)
    return adapter


def _check_fields(cfg: dict, where: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type={cfg.get('peft_type')!r}; only LORA adapters load")
    for key, (plain, what) in UNSUPPORTED.items():
        value = cfg.get(key, plain)
        if value not in (plain, None, {}, []):
            raise ConfigError(f"{where}: {key}={value!r} is not supported ({what}); set {key}="
                              f"{json.dumps(plain)} only if it was trained without it, else: {PLAIN}")
    init = cfg.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise ConfigError(f"{where}: init_lora_weights={init!r} is not supported (it changes the base "
                          "weights or the forward); save the adapter with peft's "
                          f"path_initial_model_for_weight_conversion (plain LoRA on the original "
                          f"base), or: {PLAIN}")
    for key in ("target_modules", "exclude_modules"):
        value = cfg.get(key)
        if not (value is None or isinstance(value, str)
                or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
            raise ConfigError(f"{where}: {key}={value!r}; use a list of module names, a regex or "
                              f"{ALL_LINEAR!r}")


def _read_tensors(weights: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(minihf name -> file key, minihf name -> tensor) of the adapter file, each module
    with an A [r, in] and a B [out, r] of one projection."""
    if not weights.is_file():
        raise FileNotFoundError(f"{weights.parent} has no {WEIGHTS} (the adapter's tensors)")
    with open_safetensors(weights, FIX) as fh:
        stored = {k: fh.get_tensor(k) for k in fh.keys()}
    if not stored:
        raise CorruptFileError(f"{weights} holds no tensors (an adapter that changes nothing); {FIX}")
    for key in stored:
        if _EMBEDDING_KEY.search(key):
            raise ConfigError(f"{weights}: tensor {key!r} adapts an embedding, which is not supported: "
                              f"minihf's LoRA covers linear layers only ({', '.join(TARGETS)}); train "
                              f"the adapter without embeddings in target_modules, or: {PLAIN}")
    keys = {next(iter(from_peft_state({k: t}, str(weights)))): k for k, t in stored.items()}
    state = {name: stored[k] for name, k in keys.items()}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if module.rpartition(".")[2] not in TARGETS:
            raise ConfigError(f"{weights}: tensor {keys[name]!r} adapts {module}, which is not "
                              f"supported: minihf's LoRA covers linear layers only ({', '.join(TARGETS)})")
        if not t.is_floating_point() or t.dim() != 2:
            raise CorruptFileError(f"{weights}: tensor {keys[name]!r} is {t.dtype} of shape "
                                   f"{list(t.shape)}, not a 2-D float matrix; {FIX}")
    for name in state:
        module, _, leaf = name.rpartition(".")
        other = f"{module}.{'lora_B' if leaf == 'lora_A' else 'lora_A'}"
        if other not in state:
            raise CorruptFileError(f"{weights}: {keys[name]!r} has no {other.rpartition('.')[2]} "
                                   f"beside it (LoRA needs both A and B of {module}); {FIX}")
        a, b = state[f"{module}.lora_A"], state[f"{module}.lora_B"]
        if a.shape[0] != b.shape[1]:
            raise CorruptFileError(f"{weights}: {module} has lora_A {list(a.shape)} and lora_B "
                                   f"{list(b.shape)}: their rank differs; {FIX}")
    return keys, state


def _check_rank(cfg: dict, where: Path, tensors: dict[str, torch.Tensor], keys: dict[str, str]) -> int:
    """``r``, which must be the tensors' rank (one rank for every module: no rank_pattern)."""
    ranks = {}
    for name, t in tensors.items():
        if name.endswith(".lora_A"):
            ranks.setdefault(t.shape[0], name)
    if len(ranks) > 1:
        (r1, n1), (r2, n2) = list(ranks.items())[:2]
        raise CorruptFileError(f"{where.parent / WEIGHTS}: {keys[n1]!r} has rank {r1} but {keys[n2]!r} "
                               f"rank {r2}; minihf needs one rank for every module (no rank_pattern)")
    rank, name = next(iter(ranks.items()))
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r != rank:
        shown = " is missing" if "r" not in cfg else f"={r!r}"
        raise ConfigError(f"{where}: r{shown} but the tensors have rank {rank} ({keys[name]!r} is "
                          f"{list(tensors[name].shape)}); set r to {rank}")
    return rank


def _check_finite(adapter: Adapter) -> None:
    """Every value finite, and so is what the adapter adds to each weight, ``B A alpha / r``,
    in float32: the merged model holds ``W + B A alpha / r`` and the unmerged forward adds
    the same product, so a finite A and B whose product overflows (a 1e30-scaled adapter, a
    huge lora_alpha) breaks both just as a NaN does. The product depends on the adapter
    alone, so every path checks it before any base weight is loaded; it is computed only
    where the bound ``r max|A| max|B| alpha / r`` allows an overflow."""
    for name, t in adapter.tensors.items():
        bad = ~torch.isfinite(t)
        if bad.any():
            nan = int(torch.isnan(t).sum())
            raise CorruptFileError(
                f"{adapter.weights_file}: tensor {adapter.keys[name]!r} has {nan} NaN and "
                f"{int(bad.sum()) - nan} infinite values (of {t.numel()}); the adapter is broken, "
                "re-export it from a good checkpoint (e.g. an earlier global_step_N)")
    scaling = adapter.alpha / adapter.rank
    for module in adapter.modules:
        a = adapter.tensors[f"{module}.lora_A"].double()
        b = adapter.tensors[f"{module}.lora_B"].double()
        if adapter.rank * a.abs().max().item() * b.abs().max().item() * scaling <= FP32_MAX:
            continue
        peak = ((b @ a) * scaling).abs().max().item()
        if peak > FP32_MAX:
            raise CorruptFileError(
                f"{adapter.weights_file}: {module}'s lora_B x lora_A x lora_alpha / r "
                f"({adapter.alpha:g} / {adapter.rank}) reaches {peak:.3g}, beyond float32's "
                f"{FP32_MAX:.3g}: the merged weight would be infinite; the tensors "
                f"({adapter.keys[module + '.lora_B']!r}, lora_A) or lora_alpha in "
                f"{adapter.config_file} are wrong")


def check_adapter(adapter: Adapter, model: nn.Module, where: str, base_dir: str | Path | None = None,
                  base_key: str = "model.path") -> None:
    """``adapter`` against ``model`` (any device, ``meta`` included; ``where`` names the
    model in messages): see the module docstring. ``base_dir``: the model dir training
    starts from (``base_key``), which ``base_model_name_or_path`` must name when it names a
    local dir (compared as files: relative paths, trailing slashes and symlinks resolve); a
    hub id, or a dir that is gone, cannot be compared and passes (the shapes are checked)."""
    names = set(adaptable(model))
    linears = {n: m for n, m in model.named_modules() if n in names}
    for module in adapter.modules:
        if module not in linears:
            raise ConfigError(f"{adapter.weights_file}: {adapter.keys[module + '.lora_A']!r} adapts "
                              f"{module}, which {where} does not have (an adapter for another model?)")
        a, b = adapter.tensors[f"{module}.lora_A"], adapter.tensors[f"{module}.lora_B"]
        out_f, in_f = linears[module].weight.shape
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise ConfigError(f"{adapter.weights_file}: {module} has lora_A {list(a.shape)} and lora_B "
                              f"{list(b.shape)}; {where} needs [r, {in_f}] and [{out_f}, r] (an adapter "
                              "for another base model?)")
    targeted = _targeted(adapter, model, list(linears))
    missing = [m for m in targeted if m not in adapter.modules]
    if missing:
        raise CorruptFileError(f"{adapter.weights_file} has no tensors for {len(missing)} of the "
                               f"{len(targeted)} modules its target_modules name ({missing[:4]}"
                               f"{'...' if len(missing) > 4 else ''}); {FIX}")
    extra = [m for m in adapter.modules if m not in targeted]
    if extra:
        spec = f"target_modules={adapter.target_modules!r}" + (
            f" with exclude_modules={adapter.exclude_modules!r}" if adapter.exclude_modules else "")
        raise ConfigError(f"{adapter.weights_file} adapts {extra[:4]}, which {spec} in "
                          f"{adapter.config_file} does not select (peft would leave them out); make "
                          "the config name every module the tensors adapt")
    if base_dir is not None and adapter.base:
        base = Path(adapter.base).expanduser()
        if base.is_dir() and Path(base_dir).is_dir() and not os.path.samefile(base, base_dir):
            raise ConfigError(
                f"{adapter.config_file}: base_model_name_or_path={adapter.base!r} ({base.resolve()}) is "
                f"not {base_key}={str(base_dir)!r} ({Path(base_dir).resolve()}): the adapter was trained "
                f"on another model; set {base_key} to its base, or if {base_dir} is a copy of that "
                "base, set base_model_name_or_path to it")


def _targeted(adapter: Adapter, model: nn.Module, linears: list[str]) -> list[str]:
    """The modules ``target_modules`` / ``exclude_modules`` select, as peft matches them:
    ``all-linear``, a regex (the whole name), or names matched on their last parts. A
    target naming a module minihf's LoRA cannot adapt (an embedding, the head) is an error.
    Without ``target_modules``, whatever the tensors adapt."""
    where = adapter.config_file

    def select(spec, names: list[str], key: str) -> list[str]:
        if isinstance(spec, str):
            try:
                return [n for n in names if re.fullmatch(spec, n)]
            except re.error as exc:
                raise ConfigError(f"{where}: {key}={spec!r} is not a valid regex ({exc})") from None
        return [n for n in names if any(n == i or n.endswith("." + i) for i in spec)]

    spec = adapter.target_modules
    if spec is None:
        return adapter.modules
    chosen = linears if spec == ALL_LINEAR else select(spec, linears, "target_modules")
    if isinstance(spec, list):
        others = [n for n, m in model.named_modules() if n and n not in linears
                  and isinstance(m, (nn.Linear, nn.Embedding))]
        for item in spec:
            if not select([item], linears, "target_modules") and select([item], others, "target_modules"):
                raise ConfigError(f"{where}: target_modules names {item!r}, which is not supported: "
                                  f"minihf's LoRA covers the linear projections only ({', '.join(TARGETS)}); "
                                  f"{PLAIN}")
    if adapter.exclude_modules:
        excluded = set(select(adapter.exclude_modules, linears, "exclude_modules"))
        chosen = [n for n in chosen if n not in excluded]
    return chosen


def write_adapter_dir(out: str | Path, adapters: dict[str, torch.Tensor], *, rank: int,
                      alpha: float, target_modules: list[str], base: str | None) -> Path:
    """A PEFT LoRA adapter dir at ``out`` (written under a temporary name, then renamed)."""
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
           "target_modules": target_modules, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
           "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
           "base_model_name_or_path": base}
    out = Path(out)
    with staged_dir(out) as tmp:
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in to_peft_state(adapters).items()},
                  str(tmp / WEIGHTS), metadata={"format": "pt"})
    return out
