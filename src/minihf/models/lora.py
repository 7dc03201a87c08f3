"""LoRA: low-rank adapters on a built model's linear layers, added after construction.

:func:`apply_lora` walks the modules (CONTRIBUTING.md, rule 1: the model files stay as they are) and
replaces each targeted ``Linear`` by a :class:`LoRALinear` that keeps the same ``weight``
and ``bias`` parameters (same names: state-dict keys and the parallelism tables still
match on ``...q_proj.weight``) and adds two: ``lora_A`` [r, in] and ``lora_B`` [out, r].
Its forward is peft's::

    y = x W^T + b + (x A^T) B^T * alpha / r

so the same base weights and adapter values give peft's logits. The adapters sit beside
the weight as parameters of the same module (``q_proj.lora_A``), not in a sub-module as
in peft (``q_proj.lora_A.default.weight``); :func:`to_peft_state` / :func:`from_peft_state`
translate the names for export and for starting from a PEFT adapter dir.

Targets are the decoder's projections (``q k v o gate up down``, and in a mixture-of-experts
model every expert's, Mixtral's ``w1 w3 w2`` included); ``all-linear`` means all of them,
as peft's ``all-linear`` leaves the output layer out. An LM head or a value head is never
adapted here (a critic trains its value head in full beside the adapters). Nor is a MoE
router (``mlp.gate``): peft on transformers 5 leaves it alone too (it is no ``nn.Linear``
there, and neither are the experts, which peft adapts only through ``target_parameters``),
and an adapter on it would move every token's routing, which RL's rollout-vs-trainer
agreement (and routing replay) relies on.

:func:`adapters_disabled` switches every adapter off for the forwards inside it: the
actor's own model then is the base model, which is how a LoRA actor's reference policy is
computed without a second copy of the base weights (``x W^T + b`` alone: the very ops a
model without adapters runs, so its log-probs equal a separate reference exactly).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn as nn

from .linear import Linear, linear

# the decoder's projections, a MoE expert's included (Mixtral names them w1/w3/w2); the
# MoE router (``gate``) is not among them (see the module docstring)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."


def lora_delta(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
               scaling: float) -> torch.Tensor:
    """``(x A^T) B^T * scaling``: the adapter's contribution (peft's order of operations)."""
    return linear(linear(x, lora_A), lora_B) * scaling


class LoRALinear(Linear):
    """A ``Linear`` with a low-rank adapter beside its (frozen) weight; see the module
    docstring. Built from an existing layer by :func:`apply_lora`, sharing its parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)  # not nn.Linear's: the weight and bias are the base layer's
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, dtype=w.dtype, device=w.device))
        self.scaling = alpha / rank
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        return y + lora_delta(x, self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def adaptable(model: nn.Module) -> list[str]:
    """Names of the linear modules LoRA can adapt (the decoder's projections), in order."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.rpartition(".")[2] in TARGETS]


def module_names(model: nn.Module, target_modules: str | list[str],
                 exclude_modules: list[str] | None = None, key: str = "target_modules") -> list[str]:
    """Names of the linear modules ``target_modules`` / ``exclude_modules`` select.

    ``target_modules``: ``all-linear`` or a list whose items name modules by their last
    name parts (``q_proj``, ``self_attn.q_proj``, ``layers.0.mlp.up_proj``: peft's suffix
    match). Raises ValueError naming ``key`` when an item matches no adaptable module or
    when nothing is left to adapt.
    """
    linears = adaptable(model)

    def matches(item: str) -> list[str]:
        return [n for n in linears if n == item or n.endswith("." + item)]

    if target_modules == ALL_LINEAR:
        chosen = list(linears)
    elif isinstance(target_modules, str):
        raise ValueError(f"{key}={target_modules!r}: use {ALL_LINEAR!r} or a list of module names "
                         f"such as {list(TARGETS)}")
    else:
        chosen = []
        for item in target_modules:
            found = matches(item)
            if not found:
                raise ValueError(f"{key}: {item!r} names no adaptable module; LoRA adapts the "
                                 f"decoder's projections {list(TARGETS)} (e.g. 'q_proj', "
                                 "'layers.0.self_attn.v_proj'), never an LM or value head")
            chosen += [n for n in found if n not in chosen]
    excluded: set[str] = set()
    for item in exclude_modules or []:
        found = matches(item)
        if not found:
            ex_key = key.rpartition(".")[0] + ".exclude_modules" if "." in key else "exclude_modules"
            raise ValueError(f"{ex_key}: {item!r} names no adaptable module (choose among "
                             f"{list(TARGETS)} or a longer name ending in one)")
        excluded.update(found)
    chosen = [n for n in linears if n in chosen and n not in excluded]  # model order
    if not chosen:
        raise ValueError(f"{key}={target_modules!r} with exclude_modules={exclude_modules!r} "
                         "leaves no module to adapt")
    return chosen


def apply_lora(model: nn.Module, rank: int, alpha: float, names: list[str]) -> nn.Module:
    """Replace the linear modules ``names`` of ``model`` by :class:`LoRALinear` (in place,
    on whatever device the model is, ``meta`` included; adapters uninitialised: fill them
    with :func:`init_lora_state` or a saved state). Returns ``model``."""
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), rank, alpha))
    return model


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that carry an adapter (``lora_A``/``lora_B`` parameters), by name: the
    training model's :class:`LoRALinear` layers and the engine's TP layers alike."""
    return {n: m for n, m in model.named_modules() if getattr(m, "lora_A", None) is not None}


def is_lora_param(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def trained_with_lora(name: str, head: str) -> bool:
    """Whether parameter ``name`` trains in a LoRA model with ``head``: the adapters, and a
    value or score head (new, so trained in full, as peft's ``modules_to_save``)."""
    return is_lora_param(name) or (head != "lm" and not name.startswith("model."))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Inside: every adapter of ``model`` is off (its forwards are the base model's)."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m in mods:
            m.adapter_enabled = True


def init_lora_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Initial adapter values, as peft draws them: ``lora_A`` ~ U(-1/sqrt(in), 1/sqrt(in))
    (Kaiming-uniform with a = sqrt(5)), ``lora_B`` = 0, so the adapted model starts equal to
    its base. Drawn on CPU from ``seed`` in name order: every rank and every sharding gets
    the same full tensors (``shapes``: adapter names -> full shapes)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith(".lora_B"):
            out[name] = torch.zeros(shape)
        else:
            bound = 1 / math.sqrt(shape[1])
            out[name] = torch.rand(shape, generator=gen) * (2 * bound) - bound
    return out


def to_peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """minihf adapter names -> a PEFT adapter file's (``base_model.model.<module>.lora_A.weight``)."""
    out = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        out[f"{PEFT_PREFIX}{module}.{leaf}.weight"] = t
    return out


_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight$")


def from_peft_state(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter file's tensors -> minihf adapter names. Raises ValueError naming
    ``where`` for a key that is not a LoRA A/B weight (e.g. DoRA magnitudes, biases)."""
    out = {}
    for key, t in state.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight; only plain LoRA "
                             "adapters (no DoRA, no trained biases or modules_to_save) load here")
        out[f"{m.group(1)}.{m.group(2)}"] = t
    return out


def target_list(names: list[str], all_names: list[str]) -> list[str]:
    """``target_modules`` for an adapter config: the leaf names when they select exactly
    ``names`` among ``all_names`` (the adaptable modules), else the full module names."""
    leaves = sorted({n.rpartition(".")[2] for n in names})
    if sorted(n for n in all_names if n.rpartition(".")[2] in leaves) == sorted(names):
        return leaves
    return list(names)


@torch.no_grad()
def merge_lora_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full model state with adapters -> the plain model's: ``W + B A * scaling`` for
    every adapted weight, the adapter tensors dropped (for ``minihf export --merge``)."""
    out = {k: v for k, v in state.items() if not is_lora_param(k)}
    for name in [k for k in state if k.endswith(".lora_A")]:
        module = name[: -len(".lora_A")]
        w = out[f"{module}.weight"]
        delta = (state[f"{module}.lora_B"].double() @ state[name].double()) * scaling
        out[f"{module}.weight"] = (w.double() + delta).to(w.dtype)
    return out
