"""Threads per rank: what a host's cores can run, and each rank's share of them.

A CPU job's ranks each run an OpenMP team (torch's intra-op threads). When the ranks on a
host run more threads than the cores this process may use, they take turns on the cores
and every parallel region waits for its slowest thread: the SmolLM2 recipe's step took
85-90 s instead of 16-18 s on 2 cores with ``OMP_NUM_THREADS=2`` exported (2 ranks, 4
threads). Nothing fails, so nothing said so.

``usable_cores`` counts the cores: the CPU affinity mask (``taskset``, a batch system's
binding), lowered by a cgroup CPU quota where one is set (containers: ``docker --cpus``,
Kubernetes limits; v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``). ``plan`` decides a rank's
thread count from ``controller.threads``:

* ``auto`` (the default): each rank's share, usable cores // ranks on this host, at least
  1; the environment's ``OMP_NUM_THREADS`` is lowered to it, never raised (a user who asked
  for fewer gets fewer);
* an integer: that many;
* ``inherit``: torch's own choice (``OMP_NUM_THREADS``, else all of the machine's cores).

``apply`` sets the figure on this process (torch, and ``OMP_NUM_THREADS`` for the
processes a rank starts) and returns the line local rank 0 prints: the figure and where it
came from, or a warning naming the numbers and the fix when the host is oversubscribed.
``sandbox_env`` is the environment a tool process gets: one thread per library, so a
sandboxed call does not start a full team next to the rank's own. Pure Python; torch is
imported only by ``apply``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# the variables that size a numeric library's thread pool in a child process
POOL_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _v2_limit(root: Path, path: str) -> float | None:
    """The lowest ``cpu.max`` quota on the way from ``path`` up to the v2 hierarchy's root."""
    best = None
    here = root / path.lstrip("/")
    while True:
        try:
            quota, period = (here / "cpu.max").read_text().split()[:2]
            if quota != "max" and float(period) > 0:
                best = min(best or float("inf"), float(quota) / float(period))
        except (OSError, ValueError):
            pass
        if here == root or root not in here.parents:
            return best
        here = here.parent


def _v1_limit(root: Path, path: str, controllers: str) -> float | None:
    """The v1 ``cpu`` controller's quota for ``path``, at its own mount or a combined one."""
    for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for where in (root / mount / path.lstrip("/"), root / mount):
            try:
                quota = int((where / "cpu.cfs_quota_us").read_text())
                period = int((where / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            return quota / period if quota > 0 and period > 0 else None
    return None


def cgroup_cpu_limit(root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup"
                     ) -> float | None:
    """The CPU quota of this process's cgroup in cores (1.5 = one and a half), or None when
    no quota is set or no cgroup file can be read (not Linux)."""
    root = Path(root)
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # the v2 unified hierarchy (mounted at root, or root/unified)
            for base in (root, root / "unified"):
                if (base / "cgroup.controllers").exists():
                    limits.append(_v2_limit(base, path))
                    break
        elif "cpu" in controllers.split(","):
            limits.append(_v1_limit(root, path, controllers))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class Cores:
    """The cores this process may use (``usable``) and what bounds them, for messages."""
    usable: int
    why: str


def usable_cores(affinity: set[int] | None = None, quota: float | None | str = "read") -> Cores:
    """The cores this process may run on: its affinity mask, under a cgroup CPU quota (whole
    cores, at least 1). ``affinity`` / ``quota`` replace what is read from the system."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if quota == "read":
        quota = cgroup_cpu_limit()
    n, why = len(affinity), f"{len(affinity)} in this process's CPU affinity"
    if quota is not None and int(quota) < n:
        n, why = max(1, int(quota)), f"a cgroup CPU quota of {quota:g} cores ({len(affinity)} in the affinity)"
    return Cores(max(1, n), why)


@dataclass(frozen=True)
class Plan:
    """One rank's threads (``threads``) and the line its host's local rank 0 prints
    (``line``: a warning when the host's ranks oversubscribe its cores)."""
    threads: int
    line: str
    oversubscribed: bool


def check_setting(setting) -> None:
    """A ValueError unless ``setting`` is a valid ``controller.threads``."""
    if setting not in ("auto", "inherit") and not (
            isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1):
        raise ValueError(f"controller.threads={setting!r}: use auto (each rank's share of the cores), an "
                         "integer >= 1, or inherit (OMP_NUM_THREADS / torch's default)")


def plan(setting: str | int, cores: Cores, local_ranks: int, inherited: int, env_value: str | None) -> Plan:
    """The threads per rank for ``controller.threads`` = ``setting`` when ``local_ranks``
    ranks share ``cores`` and torch would run ``inherited`` threads (``env_value``:
    ``OMP_NUM_THREADS`` as exported, None when unset)."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    share = max(1, cores.usable // local_ranks)
    source = f"OMP_NUM_THREADS={env_value}" if env_value is not None else "torch's default (OMP_NUM_THREADS unset)"
    check_setting(setting)
    if setting == "auto":
        threads, chosen = min(inherited, share), "controller.threads=auto: each rank's share of the cores"
        if threads < share:
            chosen = f"controller.threads=auto, kept below the share ({share}) by {source}"
    elif setting == "inherit":
        threads, chosen = inherited, f"controller.threads=inherit: {source}"
    else:
        threads, chosen = setting, f"controller.threads={setting}"
    total = threads * local_ranks
    ranks = f"{local_ranks} rank{'s' if local_ranks > 1 else ''} on this host"
    where = f"{cores.usable} usable cores ({cores.why})"
    if total > cores.usable:
        if local_ranks > cores.usable:
            fix = f"start at most {cores.usable} ranks on this host (--nproc-per-node {cores.usable})"
        else:  # (under auto, only more ranks than cores oversubscribe)
            fix = f"set controller.threads=auto (each rank gets {share}), or OMP_NUM_THREADS={share} with inherit"
        return Plan(threads, f"[minihf] warning: threads oversubscribe this host: {threads} per rank x {ranks} = "
                             f"{total} threads on {where}; {chosen}; each parallel region then waits for threads "
                             f"the cores cannot run (steps several times slower); {fix}", True)
    if setting == "auto" and env_value is not None and inherited * local_ranks > cores.usable:
        return Plan(threads, f"[minihf] warning: {source} x {ranks} would be {inherited * local_ranks} threads on "
                             f"{where}, oversubscribed (steps several times slower); each rank runs {threads} "
                             f"(controller.threads=auto; =inherit keeps the environment's value)", False)
    return Plan(threads, f"[minihf] threads: {threads} per rank ({chosen}; {ranks}, {where})", False)


_applied: Plan | None = None


def apply(setting: str | int, local_ranks: int | None = None, cores: Cores | None = None,
          interop: bool = True) -> Plan:
    """Decide this rank's threads (``plan``), set them on torch and in ``OMP_NUM_THREADS``
    (the processes the rank starts inherit it), and return the plan; ``local_ranks``
    defaults to torchrun's ``LOCAL_WORLD_SIZE`` (1 without it). ``interop``: size torch's
    inter-op pool too (once per process, for good: not for a caller's own process)."""
    global _applied
    import torch

    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    result = plan(setting, cores or usable_cores(), local_ranks, torch.get_num_threads(),
                  os.environ.get("OMP_NUM_THREADS"))
    if result.threads != torch.get_num_threads():
        torch.set_num_threads(result.threads)
    if interop:
        try:  # the inter-op pool (torch.jit.fork, a few ops) starts lazily: size it before it does
            torch.set_num_interop_threads(result.threads)
        except RuntimeError:  # it started already, or was sized once in this process
            pass
    os.environ["OMP_NUM_THREADS"] = str(result.threads)
    _applied = result
    return result


def applied() -> Plan | None:
    """The plan ``apply`` set in this process last, or None."""
    return _applied


def with_threads(cfg):
    """``cfg`` with ``controller.threads`` set to the figure this process runs (for the run
    dir's ``config.yaml``); ``cfg`` itself when it has no controller section or nothing was
    applied."""
    import dataclasses

    controller = getattr(cfg, "controller", None)
    if _applied is None or controller is None or not hasattr(controller, "threads"):
        return cfg
    return dataclasses.replace(cfg, controller=dataclasses.replace(controller, threads=_applied.threads))


def sandbox_env(threads: int = 1) -> dict[str, str]:
    """The thread variables of a tool's process: ``threads`` per numeric library."""
    return {name: str(threads) for name in POOL_VARIABLES}
