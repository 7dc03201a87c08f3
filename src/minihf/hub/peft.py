"""PEFT adapter dirs in and out: what ``peft.PeftModel.from_pretrained`` reads and
``save_pretrained`` writes (``adapter_config.json`` + ``adapter_model.safetensors``).

:func:`write_adapter_dir` exports a LoRA checkpoint's adapters (``minihf export``);
:func:`read_adapter_dir` loads one to start training from
(``model.lora_adapter_path``) or to merge for ``minihf eval`` / ``generate``. Only plain
LoRA is read (no DoRA, rsLoRA, per-module ranks or trained biases): anything else is an
error naming the field, never a silently different model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minihf.models.lora import from_peft_state, to_peft_state
from minihf.utils.files import staged_dir

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_adapter_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, adapters)``: the dir's ``adapter_config.json`` and its A/B tensors under
    minihf's names (``...q_proj.lora_A``). Raises ValueError naming the path and the field
    for what minihf cannot run the same way peft would."""
    path = Path(path)
    if not is_adapter_dir(path):
        raise FileNotFoundError(f"{path} is not a PEFT adapter dir (no {CONFIG}); pass a dir "
                                "written by peft's save_pretrained or `minihf export`")
    cfg = json.loads((path / CONFIG).read_text())
    where = str(path / CONFIG)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={cfg.get('peft_type')!r}; only LORA adapters load")
    unsupported = {"use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
                   "fan_in_fan_out": False,
                   "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}
    for key, plain in unsupported.items():
        value = cfg.get(key, plain)
        if value not in (plain, None, {}, []):
            raise ValueError(f"{where}: {key}={value!r} is not supported (plain LoRA only: "
                             f"{key}={plain!r})")
    weights = path / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS} (the adapter's tensors)")
    return cfg, from_peft_state(load_file(str(weights)), str(weights))


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
