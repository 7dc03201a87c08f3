"""Training checkpoints out as Hugging Face model dirs: :func:`export_hf` (the ``minihf
export`` command), and :func:`model_dir_of`, which lets every command that takes a model
dir take a checkpoint too.

A LoRA checkpoint holds the adapters only (and a critic's value head); its base model is
the dir ``meta.json`` names (``lora.base``). It exports as a PEFT adapter dir, or with
``merge`` as a plain model dir with ``W + B A * alpha / r`` in each adapted weight. A PEFT
adapter dir given where a model dir is expected is merged into its base the same way,
after ``minihf.hub.peft``'s checks (a broken adapter is one line, never merged)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from minihf.hub.peft import check_adapter, is_adapter_dir, read_adapter_dir, write_adapter_dir
from minihf.models import build_model, load_args, load_hf, save_hf
from minihf.models.lora import apply_lora, merge_lora_state, trained_with_lora
from minihf.utils.checkpoint import TOKENIZER_FILES, load_model_state
from minihf.utils.files import CorruptFileError, check_output_dir, read_json, staged_dir


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


def export_hf(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              merge: bool = False) -> Path:
    """Write the model of checkpoint ``ckpt`` as an HF dir at ``out`` (single process).

    ``ckpt``: a role's checkpoint dir (``meta.json``), or an RL run's ``global_step_N``,
    whose ``actor`` (the policy) is exported.

    ``dtype`` casts the weights (e.g. ``torch.bfloat16``); default keeps the stored fp32.
    The dir is written under a temporary name and renamed into place, so an interrupted
    export leaves no half-written model behind (a rerun exports again). A LoRA checkpoint
    is written as a PEFT adapter dir, or (``merge``) merged into its base model.
    """
    found, out = role_checkpoint(ckpt), Path(out)
    if found is None:
        raise FileNotFoundError(f"{ckpt} is not a minihf checkpoint (no meta.json, nor actor/meta.json); "
                                "pass a dir written by training (.../global_step_N, or a role's "
                                ".../global_step_N/critic)")
    ckpt = found
    check_output_dir(out, "export target")
    head, lora = read_meta(ckpt)
    keep = [("the checkpoint", ckpt)] + ([("its LoRA base model", Path(lora["base"]))] if lora else [])
    check_not_over(out, keep)
    if lora:
        return _export_lora(ckpt, out, head, lora, dtype, merge)
    model = build_model(load_args(ckpt / "hf"), head)
    state = model.state_dict()
    load_model_state(ckpt, state)
    model.load_state_dict(state)
    model.tie_weights()
    return _write_model(model, ckpt / "hf", out, dtype)


def check_not_over(out: Path, keep: list[tuple[str, Path]]) -> None:
    """A ValueError when the export target ``out`` is, holds or lies inside a dir the export
    reads (the checkpoint, a LoRA base): the write replaces ``out`` whole, so ``minihf export
    outputs/run/global_step_5 outputs/run --overwrite`` deleted the run's every checkpoint,
    and ``--merge`` onto ``lora.base`` the base of every LoRA checkpoint of the run."""
    target = out.resolve()
    for what, path in keep:
        src = path.resolve()
        how = ("is" if target == src else "holds" if target in src.parents
               else "is inside" if src in target.parents else None)
        if how is not None:
            raise ValueError(f"export target {out} {how} {what} {path}, which the export reads and "
                             f"replacing {out} would destroy; choose another dir")


META_FIX = "the checkpoint was not written completely; export an earlier global_step_N"
LORA_KEYS = ("rank", "alpha", "modules", "target_modules", "base")  # what training writes


def read_meta(ckpt: Path) -> tuple[str | None, dict | None]:
    """``head`` and ``lora`` of a role checkpoint's ``meta.json``; one line naming the file
    when it is not the object training writes (a list, a ``lora`` without its keys)."""
    path = ckpt / "meta.json"
    meta = read_json(path, META_FIX)
    if not isinstance(meta, dict):
        raise CorruptFileError(f"{path} holds a JSON {type(meta).__name__}, not an object with the "
                               f"checkpoint's head and settings; {META_FIX}")
    head, lora = meta.get("head"), meta.get("lora")
    if head is not None and not isinstance(head, str):
        raise CorruptFileError(f"{path}: head={head!r} is not a head name (lm, value, score); {META_FIX}")
    if lora and not (isinstance(lora, dict) and all(k in lora for k in LORA_KEYS)):
        missing = [k for k in LORA_KEYS if k not in lora] if isinstance(lora, dict) else list(LORA_KEYS)
        raise CorruptFileError(f"{path}: lora={lora!r:.60} lacks {missing}; {META_FIX}")
    return head, lora or None


def _write_model(model, files: Path, out: Path, dtype: torch.dtype | None) -> Path:
    """``model`` as an HF dir at ``out``, with the tokenizer files of ``files``."""
    if dtype is not None:
        model.to(dtype)
    with staged_dir(out) as tmp:
        save_hf(model, tmp)
        for name in TOKENIZER_FILES:
            if (files / name).exists() and name != "config.json":
                shutil.copy2(files / name, tmp / name)
    return out


def _base_dir(base: str | None, where: str) -> Path:
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{where}: the base model {base!r} is not a model dir (no "
                                "config.json); LoRA adapters need the base they were trained on, "
                                "put it back there (or point the field at a copy of it)")
    return Path(base)


def _export_lora(ckpt: Path, out: Path, head: str, lora: dict, dtype, merge: bool) -> Path:
    """A LoRA checkpoint as a PEFT adapter dir, or merged into its base (``merge``)."""
    base = _base_dir(lora.get("base"), f"{ckpt / 'meta.json'} lora.base")
    if not merge and head != "lm":
        raise ValueError(f"{ckpt} is a LoRA {head} model: its {head} head was trained in full, "
                         "which a PEFT causal-LM adapter dir cannot hold; export it with --merge")
    experts = [m for m in lora["modules"] if ".experts." in m]
    dense = [m for m in lora["modules"] if ".mlp." in m and ".experts." not in m and m.rpartition(".")[2]
             in {e.rpartition(".")[2] for e in experts}]
    if not merge and experts and dense:
        raise ValueError(f"{ckpt} adapts the experts and the dense MLP layers of a mixture-of-experts model "
                         f"under the same names ({dense[0]} beside {experts[0]}): peft maps those names onto the "
                         "experts when it loads an adapter dir and drops the dense layers' adapters (max logit "
                         "error 0.14 measured); export it with --merge")
    model = load_hf(base, head=head) if merge else build_model(load_args(ckpt / "hf"), head, device="meta")
    apply_lora(model, lora["rank"], lora["alpha"], lora["modules"])
    trained = {n: torch.empty(t.shape) for n, t in model.state_dict().items()
               if trained_with_lora(n, head)}
    load_model_state(ckpt, trained)
    if not merge:
        adapters = {n: t if dtype is None else t.to(dtype) for n, t in trained.items()}
        return write_adapter_dir(out, adapters, rank=lora["rank"], alpha=lora["alpha"],
                                 target_modules=lora["target_modules"], base=str(base))
    return _merged(base, head, {**model.state_dict(), **trained}, lora["alpha"] / lora["rank"],
                   ckpt / "hf", out, dtype)


def _merged(base: Path, head: str, state: dict, scaling: float, files: Path, out: Path,
            dtype) -> Path:
    plain = build_model(load_args(base), head)
    plain.load_state_dict(merge_lora_state(state, scaling))
    plain.tie_weights()
    return _write_model(plain, files, out, dtype)


def merge_adapter_dir(adapter: str | Path, out: str | Path) -> Path:
    """A PEFT LoRA adapter dir merged into its base model (``base_model_name_or_path``, a
    local dir) as an HF model dir at ``out``, after ``minihf.hub.peft``'s checks."""
    found = read_adapter_dir(adapter)
    base = _base_dir(found.base, f"{found.config_file} base_model_name_or_path")
    model = load_hf(base)
    check_adapter(found, model, f"the base model {base}")
    apply_lora(model, found.rank, found.alpha, found.modules)
    adapters = {n: t.float() for n, t in found.tensors.items()}
    return _merged(base, "lm", {**model.state_dict(), **adapters}, found.alpha / found.rank, base,
                   Path(out), None)


def model_dir_of(path: str | Path, scratch: Path) -> Path:
    """An HF model dir for ``path``: itself, or a training checkpoint (``global_step_N`` of
    an RL run, its ``actor``, or an SFT ``global_step_N``) exported under ``scratch``."""
    path = Path(path)
    if role_checkpoint(path) is not None:
        return export_hf(path, scratch / "hf", merge=True)
    if is_adapter_dir(path):
        return merge_adapter_dir(path, scratch / "hf")
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither an HF model dir (config.json), a PEFT adapter dir "
                            "(adapter_config.json) nor a training checkpoint (meta.json, or "
                            "actor/meta.json); pass e.g. outputs/RUN/global_step_N")
