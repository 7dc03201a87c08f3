"""Checks shared by the workers' config sections (``minihf.workers.config``): each fails in
one line naming the key and what it takes."""

from __future__ import annotations

from typing import Optional

from minihf.algorithms import LOSS_AGG_MODES


def _positive_or_null(key: str, value, what: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{key}={value!r} must be an int >= 1 ({what})")


def check_chunk(section: str, chunk: Optional[int]) -> None:
    _positive_or_null(f"{section}.logits_chunk_size", chunk,
                      "response tokens whose logits are made at a time, e.g. 1024) or null (all of a "
                      "micro-batch's at once")


def check_sp(section: str, size: Optional[int]) -> None:
    _positive_or_null(f"{section}.ulysses_sequence_parallel_size", size,
                      "ranks that split one sequence; 1 = off")


def check_micro(micro: Optional[int], max_tokens: Optional[int]) -> None:
    if micro is None and max_tokens is None:
        raise ValueError("set a micro-batch size (*_micro_batch_size_per_gpu) or "
                         "max_tokens_per_micro_batch")
    if micro is not None and micro < 1:
        raise ValueError(f"micro-batch size {micro} must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} must be >= 1")


def check_ppo_update(cfg) -> None:
    """The checks shared by the actor's and the critic's update sections."""
    if cfg.ppo_mini_batch_size < 1 or cfg.ppo_epochs < 1:
        raise ValueError(f"ppo_mini_batch_size={cfg.ppo_mini_batch_size} and "
                         f"ppo_epochs={cfg.ppo_epochs} must be >= 1")
    check_micro(cfg.ppo_micro_batch_size_per_gpu, cfg.max_tokens_per_micro_batch)
    if cfg.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={cfg.loss_agg_mode!r}; choose one of "
                         f"{list(LOSS_AGG_MODES)}")


def check_actor_worker(worker: str) -> None:
    """``actor_rollout_ref.worker``: minihf's class, or a recipe's ``file.py:Class`` that exists
    (checked without importing the file; that it subclasses the actor's is checked when built)."""
    if worker == "ActorRolloutRefWorker":
        return
    from minihf.utils.imports import check_ref, is_code_ref

    if not is_code_ref(worker):
        raise ValueError(f"worker={worker!r}: name ActorRolloutRefWorker, or a subclass of it in a "
                         f"recipe file as path/to/file.py:Class")
    try:
        check_ref(worker, "worker class")
    except (FileNotFoundError, AttributeError) as e:
        raise ValueError(f"worker: {e}") from None
