"""The controller's process groups: every rank makes the same ``new_group`` calls, in the
same order, groups of one rank included."""

import torch.distributed as dist

from minihf.controller import run
from minihf.controller.config import ControllerConfig, RoleSpec
from minihf.testing import spawn_ranks

from test_controller import EchoWorker


def _nothing(groups):
    return None


def _group_calls(rank, world_size):
    calls, real = [], dist.new_group

    def recording(ranks=None, *args, **kwargs):
        calls.append((tuple(ranks), kwargs.get("use_local_synchronization", False)))
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    try:  # roles "a" and "b" of two ranks each with TP 1: four groups of one rank
        placement = {"a": RoleSpec([0, 1]), "b": RoleSpec([2, 3]), "tp": RoleSpec("all", tp_size=2)}
        run(_nothing, {"a": EchoWorker, "b": EchoWorker, "tp": EchoWorker},
            ControllerConfig(timeout_s=30, placement=placement))
    finally:
        dist.new_group = real
    return calls


def test_every_rank_makes_the_same_groups():
    """A group made by one rank alone (``use_local_synchronization``) advances torch's group
    counter on that rank only from torch 2.14 on: the ranks then name every later group
    differently and wait on each other's store keys until the timeout (split placements hung).
    So no rank-local creation, and the same calls on every rank, whatever its roles."""
    calls = spawn_ranks(_group_calls, 4, timeout_s=120)
    assert all(c == calls[0] for c in calls), calls
    assert not any(local for _, local in calls[0]), calls[0]
    assert {(0,), (1,), (2,), (3,)} <= {ranks for ranks, _ in calls[0]}, calls[0]
