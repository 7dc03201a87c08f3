"""Training checkpoints out as Hugging Face model dirs: :func:`export_hf` (the ``minihf
export`` command), and :func:`model_dir_of`, which lets every command that takes a model
dir take a checkpoint too."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from minihf.models import build_model, load_args, save_hf
from minihf.utils.checkpoint import TOKENIZER_FILES, load_model_state
from minihf.utils.files import check_output_dir, read_json, staged_dir


def role_checkpoint(path: str | Path) -> Path | None:
    """The role checkpoint (a dir with ``meta.json``) that ``path`` names: itself, or in a
    run's ``global_step_N`` the ``actor`` (the policy of an RL run), else its only trained
    role (``sft``, ``rm``); None if none."""
    path = Path(path)
    for ckpt in (path, path / "actor"):  # a step dir's config.json is the run's config
        if (ckpt / "meta.json").is_file():
            return ckpt
    if not (path / "driver_state.json").is_file():  # not a run's step dir
        return None
    roles = sorted(d for d in path.iterdir() if (d / "meta.json").is_file())
    return roles[0] if len(roles) == 1 else None


def export_hf(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the model of checkpoint ``ckpt`` as an HF dir at ``out`` (single process).

    ``ckpt``: a role's checkpoint dir (``meta.json``), or an RL run's ``global_step_N``,
    whose ``actor`` (the policy) is exported.

    ``dtype`` casts the weights (e.g. ``torch.bfloat16``); default keeps the stored fp32.
    The dir is written under a temporary name and renamed into place, so an interrupted
    export leaves no half-written model behind (a rerun exports again).
    """
    found, out = role_checkpoint(ckpt), Path(out)
    if found is None:
        raise FileNotFoundError(f"{ckpt} is not a minihf checkpoint (no meta.json, nor actor/meta.json); "
                                "pass a dir written by training (.../global_step_N, or a role's "
                                ".../global_step_N/critic)")
    ckpt = found
    check_output_dir(out, "export target")
    head = read_json(ckpt / "meta.json", "the checkpoint was not written completely; export an earlier "
                     "global_step_N").get("head")
    model = build_model(load_args(ckpt / "hf"), head)
    state = model.state_dict()
    load_model_state(ckpt, state)
    model.load_state_dict(state)
    model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    with staged_dir(out) as tmp:
        save_hf(model, tmp)
        for name in TOKENIZER_FILES:
            if (ckpt / "hf" / name).exists() and name != "config.json":
                shutil.copy2(ckpt / "hf" / name, tmp / name)
    return out


def model_dir_of(path: str | Path, scratch: Path) -> Path:
    """An HF model dir for ``path``: itself, or a training checkpoint (``global_step_N`` of
    an RL run, its ``actor``, or an SFT ``global_step_N``) exported under ``scratch``."""
    path = Path(path)
    if role_checkpoint(path) is not None:
        return export_hf(path, scratch / "hf")
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither an HF model dir (config.json) nor a training checkpoint "
                            "(meta.json, or actor/meta.json); pass e.g. outputs/RUN/global_step_N")
