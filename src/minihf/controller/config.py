"""The controller's config section: role placement and process-group settings.

``ControllerConfig`` is a field of every job's root config (``controller.*`` keys);
``resolve_placement`` turns its ``placement`` (role name -> ``RoleSpec``) into each role's
default ``RoleLayout`` (global ranks, TP size) for a given world size; ``idle_ranks`` /
``idle_warning``: the ranks such a placement leaves without a role (a warning, not an
error: the job runs, those processes only wait). Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from minihf.config import ConfigError, from_dict, suggest
from minihf.controller.layout import RoleLayout
from minihf.utils.threads import check_setting as check_threads


@dataclass
class RoleSpec:
    """Where one role runs: ``ranks`` ("all" or a list of global ranks) and its TP size."""
    ranks: Union[Literal["all"], list[int]] = "all"  # the global ranks the role runs on; all: every rank
    tp_size: int = 1                     # tensor-parallel size of its default layout (training roles: 1)

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.ranks != "all":
            if not self.ranks:
                raise ValueError("ranks is empty; give at least one rank or 'all'")
            if len(set(self.ranks)) != len(self.ranks):
                raise ValueError(f"ranks {self.ranks} contain duplicates")


PlacementConfig = dict[str, RoleSpec]  # role name -> RoleSpec


def refuse_tp(placement: PlacementConfig, why: str) -> None:
    """A ValueError naming the first role placed with ``tp_size`` > 1, for jobs whose roles
    train data-parallel only (``why`` says where TP lives instead, if anywhere)."""
    for role, spec in placement.items():
        tp = spec.tp_size if isinstance(spec, RoleSpec) else dict(spec).get("tp_size", 1)
        if tp != 1:
            raise ValueError(f"controller.placement.{role}.tp_size={tp}: this job's roles train "
                             f"data-parallel (FSDP) only, so a TP size would be ignored; {why}")


def resolve_placement(placement: PlacementConfig, world_size: int,
                      roles: list[str] | None = None) -> dict[str, RoleLayout]:
    """Resolve ``placement`` for ``world_size`` ranks: each role's default layout.

    With ``roles`` (the roles the job builds), roles not named in ``placement`` run on all
    ranks with TP 1, and placement entries for roles that do not exist are errors.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    placement = {k: v if isinstance(v, RoleSpec) else from_dict(RoleSpec, v, f"controller.placement.{k}")
                 for k, v in placement.items()}
    if roles is not None:
        for name in placement:
            if name not in roles:
                raise ConfigError(f"controller.placement names unknown role {name!r}; "
                                  f"{suggest(name, list(roles))}roles: {', '.join(roles)}")
        placement = {r: placement.get(r, RoleSpec()) for r in roles}
    out = {}
    for name, spec in placement.items():
        ranks = list(range(world_size)) if spec.ranks == "all" else sorted(spec.ranks)
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"controller.placement.{name}.ranks: {bad} out of range for world size "
                              f"{world_size} (valid ranks 0..{world_size - 1})")
        try:
            out[name] = RoleLayout(name, tuple(ranks), spec.tp_size)
        except ConfigError as e:
            raise ConfigError(f"controller.placement.{name}: {e}") from None
    return out


def idle_ranks(layouts: dict[str, RoleLayout], world_size: int) -> list[int]:
    """Ranks other than 0 that no role runs on: ``controller.placement`` names every role's
    ranks and leaves these out, so they start and wait for the whole job (rank 0 runs the
    driver, with or without a role)."""
    used = {r for layout in layouts.values() for r in layout.ranks}
    return [r for r in range(1, world_size) if r not in used]


def idle_warning(layouts: dict[str, RoleLayout], world_size: int) -> str | None:
    """The line ``run`` prints on rank 0 when ``idle_ranks`` is not empty, else None."""
    idle = idle_ranks(layouts, world_size)
    if not idle:
        return None
    placed = ", ".join(f"{n} {list(layout.ranks)}" for n, layout in sorted(layouts.items()))
    return (f"[minihf] warning: controller.placement leaves rank(s) {idle} of {world_size} with no role "
            f"({placed}): they wait for the whole job without work; add them to a role's ranks, or "
            "start fewer processes")


@dataclass
class ControllerConfig:
    """Process group and placement settings for ``minihf.controller``.

    ``timeout_s`` bounds every collective and every single call, and is how long a rank
    may go without hearing from a peer before counting it as lost (the driver sends idle
    workers a heartbeat every ``timeout_s / 4``). ``idle_timeout_s`` bounds how long a
    worker rank waits for the driver's next command: ``None`` waits as long as the driver
    is alive (a long driver-side phase is fine), a number ends the job after that long
    without a command. A driver process that dies is seen at once (its connections close);
    one that stops answering (host gone, process frozen) within ``timeout_s``.
    """
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with CUDA, else gloo
    timeout_s: float = 600.0  # collectives, calls and dead-peer detection give up after this
    idle_timeout_s: float | None = None  # worker waiting for a command; None: no limit
    placement: PlacementConfig = field(default_factory=dict)  # role -> ranks (+ tp_size); empty: all ranks
    # each rank's CPU threads: auto = its share of the host's usable cores (affinity, cgroup
    # quota) over the ranks on the host, never above OMP_NUM_THREADS; an integer; or inherit
    # (OMP_NUM_THREADS / torch's default). A host whose ranks oversubscribe its cores is
    # named in a warning at start-up (minihf.utils.threads)
    threads: Union[Literal["auto", "inherit"], int] = "auto"

    def __post_init__(self):
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if not self.timeout_s >= 1:  # below it, starting the process groups alone times out
            raise ValueError(f"timeout_s must be >= 1 (seconds; the default is 600), got "
                             f"{self.timeout_s}: shorter, the ranks cannot even connect")
        check_threads(self.threads)
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 or null (no limit while the driver "
                             f"is alive), got {self.idle_timeout_s}")
