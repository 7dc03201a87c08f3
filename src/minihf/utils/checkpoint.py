"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), and HF export.

Layout of a checkpoint dir::

    model/            DCP: the model's sharded state dict (each rank writes its shards)
    optim/            DCP: the optimizer state (AdamW moments, step), sharded alike
    extra/rank_R.pt   per rank: LR-scheduler state, RNG states, caller's extra state
                      (data-sampler position, global step, ...)
    hf/               config.json (+ tokenizer files copied from the source model dir)
    meta.json         world size and head kind (+ the LoRA settings), for loading and export

A model with frozen parameters (LoRA: the base weights) saves its trained ones only (the
adapters, a critic's value head) and their optimizer state; the base comes from the
model dir on resume and on export (``meta.json``'s ``lora.base``).

Resuming restores everything an optimizer step depends on, so the next step is
bit-identical to an uninterrupted run on CPU. Loading runs no code from the files
(``minihf.utils.safe_load``): a checkpoint from a stranger is data only. Export to an HF
dir is ``minihf.hub.export_hf``, which reads ``model/`` with :func:`load_model_state`.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from minihf.utils.files import CorruptFileError, short_write
from minihf.utils.safe_load import (SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError,
                                    load_extra)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
                   "added_tokens.json", "tokenizer.model")


def capture_rng_state() -> dict:
    """This process's RNG states: torch CPU (+ CUDA), Python ``random``, NumPy (its key as a
    tensor, so the state loads with ``weights_only=True``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # keys: a tensor, or an ndarray in older checkpoints
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _quiet_single_process(single: bool):
    """Silence DCP's "assuming the intent is ... a single process" warning when it is."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def _rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _options(model: torch.nn.Module, load: bool = False) -> StateDictOptions | None:
    """Trained parameters only when some are frozen (LoRA); None (everything) otherwise."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=not load)


def _model_state(model: torch.nn.Module) -> dict:
    """The model's state dict to save or load into: its trained parameters only when some
    are frozen. DCP's ``ignore_frozen_params`` keeps a frozen tied alias (the LM head of a
    tied embedding: ``named_parameters`` lists it once), so the keys are filtered here too."""
    options = _options(model)
    state = get_model_state_dict(model, options=options)
    if options is None:
        return state
    trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, lr_scheduler=None,
                    *, group=None, extra: dict | None = None, hf_source: str | Path | None = None,
                    meta: dict | None = None) -> Path:
    """Save a (sharded) training state to ``path``; every rank of ``group`` must call it.

    ``extra`` is this rank's own picklable state (sampler position, step, ...), returned by
    :func:`load_checkpoint`. ``hf_source``: a model dir whose tokenizer files are copied
    into ``hf/`` so ``minihf.hub.export_hf`` writes a complete model dir. ``meta``: more
    keys for ``meta.json`` (a LoRA model's settings).
    """
    path = Path(path)
    try:
        _save(path, model, optimizer, lr_scheduler, group, extra, hf_source, meta)
    except (Exception, CheckpointException) as exc:
        short = short_write(exc, path, "the checkpoint", KEPT)
        if short is None:
            raise
        raise short from None
    return path


KEPT = ("it is incomplete and never used: latest_checkpointed_iteration.txt still names the previous "
        "complete checkpoint, which is intact; free space, then rerun the same command to resume from it")


def _save(path, model, optimizer, lr_scheduler, group, extra, hf_source, meta) -> None:
    rank, world = _rank(group)
    with _quiet_single_process(group is None):
        dcp.save({"model": _model_state(model)},
                 checkpoint_id=str(path / "model"), process_group=group)
        if optimizer is not None:
            dcp.save({"optim": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=str(path / "optim"), process_group=group)
    (path / "extra").mkdir(parents=True, exist_ok=True)
    torch.save({"lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "rng": capture_rng_state(), "extra": extra or {}},
               path / "extra" / f"rank_{rank}.pt")
    if rank == 0:
        hf = path / "hf"
        hf.mkdir(parents=True, exist_ok=True)
        args = model.args
        (hf / "config.json").write_text(json.dumps(args.to_hf_config(model.head), indent=2,
                                                   sort_keys=True) + "\n")
        if hf_source is not None:
            for name in TOKENIZER_FILES:
                if (Path(hf_source) / name).exists():
                    shutil.copy2(Path(hf_source) / name, hf / name)
        (path / "meta.json").write_text(json.dumps({"world_size": world, "head": model.head,
                                                    **(meta or {})}) + "\n")
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)


CKPT_FIX = ("resume from an earlier global_step_N (trainer.resume_mode=resume_path), start fresh "
            "(trainer.resume_mode=disable or a new trainer.default_local_dir)")


def _dcp_load(state: dict, shard_dir: Path, group, **kw) -> None:
    """``dcp.load`` with one line instead of every rank's traceback when the shards are
    incomplete, truncated, or written for a model of another shape (``CorruptFileError``)."""
    if not (shard_dir / ".metadata").is_file():
        raise CorruptFileError(f"{shard_dir} has no .metadata file (the checkpoint was not written "
                               f"completely); {CKPT_FIX}")
    reader, planner = SafeFileSystemReader(shard_dir), SafeLoadPlanner()
    try:  # a crafted index is refused here, before DCP (whose versions differ in what they report)
        reader.read_metadata()
    except UnsafeCheckpointError:
        raise
    except Exception:  # a damaged index: dcp.load below reports it as such
        pass
    try:
        dcp.load(state, checkpoint_id=str(shard_dir), process_group=group, storage_reader=reader,
                 planner=planner, **kw)
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps every rank's error in one (a BaseException)
        if planner.refusal is not None:  # whatever DCP's version made of it
            raise planner.refusal from None
        failures = getattr(exc, "failures", {}).values()
        interrupt = next((e for e, _ in failures if isinstance(e, (KeyboardInterrupt, SystemExit))), None)
        if interrupt is not None:  # Ctrl-C while loading: an interrupt, not a damaged file
            raise interrupt from None
        refused = [line.strip() for line in str(exc).splitlines() if "refusing to load" in line]
        if refused:  # a rank's UnsafeCheckpointError inside DCP's wrapper
            raise UnsafeCheckpointError(refused[0][refused[0].index("refusing to load"):]) from None
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        last, low = (lines[-1][:240] if lines else type(exc).__name__), str(exc).lower()
        if "size mismatch" in low:
            why = f"it was written for a model of a different shape ({last})"
        elif "missing key" in low:
            why = f"it lacks tensors this model has, another architecture? ({last})"
        else:
            why = f"{last} (a truncated or damaged shard?)"
        raise CorruptFileError(f"cannot load the checkpoint shards in {shard_dir}: {why}; {CKPT_FIX}") from None


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, lr_scheduler=None,
                    *, group=None, restore_rng: bool = True) -> dict:
    """Load what :func:`save_checkpoint` wrote into the (already sharded) ``model`` etc.

    Returns this rank's ``extra`` dict. Model and optimizer load under any world size (DCP
    reshards); RNG and scheduler states are per rank: a rank without a file of its own (the
    run was saved with fewer ranks) takes rank 0's schedule, and its RNG starts fresh (a
    warning says so), with an empty ``extra``.
    """
    path = Path(path)
    if not (path / "model").is_dir():
        raise FileNotFoundError(f"no checkpoint at {path} (expected {path / 'model'}/ written "
                                "by save_checkpoint)")
    rank, _ = _rank(group)
    if optimizer is not None and not (path / "optim").is_dir():
        raise FileNotFoundError(f"{path} has no optimizer state (optim/); it was saved "
                                "without an optimizer")
    with _quiet_single_process(group is None):
        state = {"model": _model_state(model)}
        _dcp_load(state, path / "model", group)
        set_model_state_dict(model, state["model"], options=_options(model, load=True))
        if optimizer is not None:
            ostate = {"optim": get_optimizer_state_dict(model, optimizer)}
            _dcp_load(ostate, path / "optim", group)
            set_optimizer_state_dict(model, optimizer, ostate["optim"])
    own, first = path / "extra" / f"rank_{rank}.pt", path / "extra" / "rank_0.pt"
    if not own.exists():
        # saved with fewer ranks: the LR schedule is the same on every rank, so rank 0's
        # (this rank's own shard of every weight must move at the others' learning rate)
        if not first.exists():
            raise CorruptFileError(f"{path} has no extra/rank_0.pt (the LR schedule and RNG states); {CKPT_FIX}")
        warnings.warn(f"{own} missing (saved with fewer ranks?): this rank's RNG starts fresh; its LR "
                      f"schedule comes from {first}")
        saved = load_extra(first)
        if lr_scheduler is not None and saved["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(saved["lr_scheduler"])
        return {}
    saved = load_extra(own)
    if lr_scheduler is not None and saved["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if restore_rng:
        restore_rng_state(saved["rng"])
    return saved["extra"]


def load_model_state(ckpt: str | Path, state: dict) -> None:
    """Fill ``state`` (a plain, unsharded model state dict) from checkpoint ``ckpt``'s
    ``model/`` shards, in this single process (no process group needed)."""
    wrapped = {"model": state}
    with _quiet_single_process(True):
        _dcp_load(wrapped, Path(ckpt) / "model", None, no_dist=True)
    state.update(wrapped["model"])
