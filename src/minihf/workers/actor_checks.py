"""The actor section's settings checked against its model: routing replay needs a
mixture-of-experts model; the actor's and reference's sequence-parallel sizes must fit the
model (``minihf.parallel.ulysses``). The job runs them before any worker starts
(``minihf.trainer.ppo_job``), the worker again at ``init_model``. Also the section's small
derived facts: how the reference is computed, which ranks hold the FSDP shards."""

from __future__ import annotations

from minihf.parallel.ulysses import check_sp_model
from minihf.workers.config import ActorRolloutRefConfig


def check_router_replay(cfg: ActorRolloutRefConfig) -> None:
    """``actor.router_replay`` other than disabled needs a mixture-of-experts model."""
    mode = cfg.actor.router_replay
    if mode != "disabled":
        from minihf.models import load_args

        args = load_args(cfg.model.path)
        if not args.is_moe:
            raise ValueError(f"actor_rollout_ref.actor.router_replay={mode} replays a mixture-of-experts "
                             f"model's expert choices, but {cfg.model.path} is a dense {args.arch} model; "
                             "set it to disabled")


def sp_sizes(cfg: ActorRolloutRefConfig) -> tuple[int, int]:
    """The actor's and the reference's ``ulysses_sequence_parallel_size`` (the reference's
    null: the actor's, as in verl)."""
    actor = cfg.actor.ulysses_sequence_parallel_size
    ref = cfg.ref.ulysses_sequence_parallel_size
    return actor, actor if ref is None else ref


def check_actor_sp(cfg: ActorRolloutRefConfig, args) -> None:
    """The actor's and reference's SP sizes against the model (``args``)."""
    for section, size in zip(("actor", "ref"), sp_sizes(cfg)):
        check_sp_model(size, args, f"actor_rollout_ref.{section}.ulysses_sequence_parallel_size",
                       cfg.model.use_remove_padding)


def reference_source(model_cfg) -> str:
    """How the reference policy is computed: a LoRA actor's is its base (adapters off)."""
    return "adapters_off" if getattr(model_cfg, "lora", False) else "model"


def shard_ranks(group, rank: int) -> list[int]:
    """Global ranks holding FSDP shards 0, 1, ... over ``group`` (its rank order)."""
    import torch.distributed as dist

    return dist.get_process_group_ranks(group) if group is not None else [rank]
