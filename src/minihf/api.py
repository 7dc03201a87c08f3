"""The Python entry points: a job in this process, as ``minihf train`` / ``sft`` / ``rm`` run
it, returning its result and raising its errors.

    import minihf
    result = minihf.train("grpo", ["trainer.total_training_steps=2"])
    result.metrics["val-core/mean"], result.run_dir

Each takes a recipe (a name, a folder or a YAML path; None: the trainer's default) and
dotted overrides, or a config object already built (``load_config``). One rank, in this
process (a notebook, a test, a sweep written in Python); for several ranks use torchrun
with ``scripts/train_*.py``. A bad key raises ``ConfigError`` before anything starts; a
failure in the job raises there. Nothing process-wide is installed: no parent-death
signal, no ``os._exit``, no ``gc.freeze`` at exit (those belong to the scripts and the CLI).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass
class TrainResult:
    """What a job returns: every logged row (``history``), the last row's metrics merged
    over the run (``metrics``: each key's latest value) and the run dir (absolute)."""
    history: list[dict]
    metrics: dict[str, Any]
    run_dir: Path


def _config(cls, recipe, overrides):
    from minihf.config import load_config

    if isinstance(recipe, cls):
        if overrides:
            raise ValueError("pass overrides with a recipe name, not with a config object "
                             "(change the object's fields instead)")
        return recipe
    if recipe is not None and not isinstance(recipe, (str, os.PathLike)):
        raise TypeError(f"recipe must be a name, a folder or a YAML path (or None for the default), got "
                        f"{type(recipe).__name__} {recipe!r}; overrides go second: train(recipe, ['key=value', ...])")
    given = overrides
    if isinstance(given, (str, dict)) or given is not None and not isinstance(given, Iterable):
        overrides = [None]  # refused below, named as given
    overrides = list(overrides or [])  # (a generator is read once, here)
    if not all(isinstance(o, str) for o in overrides):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got {given!r}; e.g. "
                        "['trainer.total_training_steps=2']")
    return load_config(cls, os.fspath(recipe) if recipe is not None else None, overrides)


def _result(history: list[dict] | None, trainer) -> TrainResult:
    from minihf.trainer.common import run_dir

    history = list(history or [])
    metrics: dict[str, Any] = {}
    for row in history:
        metrics.update(row)
    return TrainResult(history, metrics, run_dir(trainer).resolve())


def train(recipe: Any = None, overrides: Sequence[str] = ()) -> TrainResult:
    """RL (``minihf train``): the whole job, preparation and warm start included."""
    from minihf.trainer.ppo_job import DEFAULT_RECIPE, PPOJobConfig, run_ppo

    cfg = _config(PPOJobConfig, DEFAULT_RECIPE if recipe is None else recipe, overrides)
    return _result(run_ppo(cfg, in_process=True), cfg.trainer)


def train_sft(recipe: Any = None, overrides: Sequence[str] = ()) -> TrainResult:
    """Supervised fine-tuning (``minihf sft``)."""
    from minihf.trainer.sft import SFTConfig, run_sft

    cfg = _config(SFTConfig, recipe, overrides)
    return _result(run_sft(cfg, in_process=True), cfg.trainer)


def train_rm(recipe: Any = None, overrides: Sequence[str] = ()) -> TrainResult:
    """Reward-model training (``minihf rm``)."""
    from minihf.trainer.rm import RMConfig, run_rm

    cfg = _config(RMConfig, recipe, overrides)
    return _result(run_rm(cfg, in_process=True), cfg.trainer)
