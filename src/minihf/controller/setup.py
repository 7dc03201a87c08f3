"""Setting up a controller job on every rank: the roles, their layouts, the process groups,
the workers.

``Role`` says how a role's worker is built; ``role_layouts`` gives each role its default
layout (the placement) and the ones its class declares; ``make_groups`` creates the
process groups every rank needs, in one global order: per role one over its ranks
(colocated roles get separate groups) plus the DP and TP groups of each of its layouts
(``minihf.controller.layout``); one over the union of two roles' ranks where a worker
class links them (``role_links``, ``Worker.linked_roles``: the actor and a standalone
rollout, for the weight sync); and two per worker rank r (driver->r, r->driver; see
``transport``). ``build_workers`` constructs this rank's workers, every rank failing
together. ``minihf.controller.launch`` runs them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from minihf.controller.errors import ControllerError
from minihf.controller.layout import DEFAULT_LAYOUT, RoleLayout
from minihf.controller.transport import Channel
from minihf.controller.worker import ParallelInfo, Worker, WorkerContext, create_worker


@dataclass(frozen=True)
class Role:
    """How to build a role's worker on each of its ranks: ``worker_cls(*args, **kwargs)``."""
    worker_cls: type[Worker]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def role_layouts(roles: Mapping[str, Role], defaults: dict[str, RoleLayout]
                 ) -> dict[str, dict[str, RoleLayout]]:
    """Every role's layouts: its default (placement) plus what its class declares. Checks
    that each remote method names a layout the role has."""
    out = {}
    for name, default in defaults.items():
        spec = roles[name]
        declared = spec.worker_cls.declare_layouts(*spec.args, **spec.kwargs)
        layouts = {DEFAULT_LAYOUT: default}
        for lname, tp in sorted(declared.items()):
            if lname == DEFAULT_LAYOUT:
                raise ControllerError(f"{spec.worker_cls.__name__}.declare_layouts: "
                                      f"{DEFAULT_LAYOUT!r} is the placement's layout; name yours "
                                      "differently")
            layouts[lname] = default.with_tp(lname, tp)
        for m in spec.worker_cls.remote_methods.values():
            if m.layout not in layouts:
                raise ControllerError(
                    f"{spec.worker_cls.__name__}.{m.name} uses layout {m.layout!r}, which the "
                    f"role does not declare (layouts: {sorted(layouts)}); return it from "
                    "declare_layouts")
        out[name] = layouts
    return out


def role_links(roles: Mapping[str, Role]) -> list[tuple[str, str]]:
    """Pairs of roles in the job that a worker class links (``Worker.linked_roles``), sorted."""
    pairs = {tuple(sorted((name, other))) for name, spec in roles.items()
             for other in spec.worker_cls.linked_roles if other in roles and other != name}
    return sorted(pairs)


def make_groups(rank: int, world: int, layouts: dict[str, dict[str, RoleLayout]],
                 cuda: torch.device | None, device: torch.device, timeout_s: float,
                 pairs: list[tuple[str, str]] = ()
                 ) -> tuple[dict[str, WorkerContext], dict[int, tuple[Channel, Channel]], list]:
    """This rank's worker contexts (role group; DP and TP groups of every layout) and its
    driver links.

    Every rank creates every group (torch requires it), in one global order: roles sorted
    by name (role group, then per layout by name: its TP groups, then its DP groups), then the
    linked role pairs (``pairs``, over both roles' ranks), then the links by peer. Groups of
    one rank too: made by that rank alone (``use_local_synchronization``), they advance
    torch's group counter on that rank only from torch 2.14 on, so the ranks would name every
    later group differently and wait on each other's store keys forever. A DP or TP group
    spanning the whole role is the role group.
    """
    timeout = timedelta(seconds=timeout_s)
    created: list = []

    def new_group(ranks) -> Any:
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            created.append(group)
            return group
        return None

    def pick(groups: list[tuple[int, ...]], role_group) -> Any:
        """Create ``groups`` (unless one group is the whole role); return this rank's."""
        if len(groups) == 1:
            return role_group
        mine = None
        for ranks in groups:
            mine = new_group(ranks) or mine
        return mine

    contexts = {}
    for name in sorted(layouts):
        default = layouts[name][DEFAULT_LAYOUT]
        group = new_group(default.ranks)
        infos = {}
        for lname, layout in sorted(layouts[name].items()):
            tp = pick(layout.tp_groups(), group)
            dp = pick(layout.dp_groups(), group)
            if rank in layout.ranks:
                i = layout.ranks.index(rank)
                infos[lname] = ParallelInfo(layout, layout.dp_rank(i), layout.tp_rank(i), dp, tp)
        if rank in default.ranks:
            base = infos.pop(DEFAULT_LAYOUT)
            contexts[name] = WorkerContext(rank, default, group, device, dp_group=base.dp_group,
                                           tp_group=base.tp_group, others=infos)
    for a, b in pairs:
        ranks = sorted(set(layouts[a][DEFAULT_LAYOUT].ranks) | set(layouts[b][DEFAULT_LAYOUT].ranks))
        group = new_group(ranks)
        for mine, other in ((a, b), (b, a)):
            if mine in contexts:
                contexts[mine].links[other] = group
    links: dict[int, tuple[Channel, Channel]] = {}
    for peer in range(1, world):  # two groups per pair: driver->peer and peer->driver
        down, up = new_group([0, peer]), new_group([0, peer])
        if rank in (0, peer):
            other = peer if rank == 0 else 0
            links[other] = (Channel(down, other, cuda, timeout_s),
                            Channel(up, other, cuda, timeout_s))
    return contexts, links, created


def build_workers(roles: dict[str, Role], contexts: dict[str, WorkerContext]
                   ) -> dict[str, Worker]:
    """Build this rank's workers; if any rank fails, every rank raises the same error."""
    workers, error = {}, None
    for name, ctx in contexts.items():
        try:
            spec = roles[name]
            workers[name] = create_worker(spec.worker_cls, ctx, spec.args, spec.kwargs)
        except Exception:  # noqa: BLE001 - reported to every rank below
            error = f"building role {name!r} failed on rank {ctx.rank}:\n{traceback.format_exc()}"
            break
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise ControllerError(failed[0])
    return workers
