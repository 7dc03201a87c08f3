"""``minihf train|sft|rm ... --nproc-per-node N``: a launcher that checks before it starts.

The whole config is loaded and validated here, in the parent, before any rank starts: a
bad key or value is one line and exit code 2. The ranks then run as
``python -m minihf.launcher KIND ARGS`` (what ``scripts/train_*.py`` do under torchrun)
through torch's elastic launch API, with a static rendezvous: one node by default (a free
local port), or ``--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`` with one launcher
per node, as ``torchrun --nnodes M --node-rank R --master-addr HOST --master-port PORT``.
A failed job is one line naming the failing rank and its exit code, under that rank's
own message (no launcher traceback or failure table); Ctrl-C ends every rank, each with
its line, and exits 130. Unless ``OMP_NUM_THREADS`` is set, the ranks start with this
host's usable cores divided by the ranks per node, said once; each rank then settles its
threads from ``controller.threads`` (``minihf.utils.threads``).

The launch arguments are checked before the config (``check_launch``, one line, exit 2):
``--rdzv-endpoint`` must be ``HOST:PORT`` with a port in 1..65535 and a host that resolves
(port 0, "any free port", left the ranks waiting 10 minutes on a port no one listened
on); ``--nproc-per-node`` at most one rank per GPU on CUDA (rank r drives ``cuda:r``) and,
on CPU, at most the ranks this host's available memory holds before any model loads
(``max_local_ranks``: more ranks than cores share the cores and run, slower).
The rendezvous (the launchers of all nodes meeting at node 0's endpoint) is torch's static
one, wrapped (``minihf.controller.rendezvous``) because the launcher's own log lines are
silenced: a node still waiting says so, and one that gives up after
``controller.timeout_s`` says which side was missing instead of torch's C++ stack.
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank: the scripts' start-up first (before the imports below)
    import minihf.utils.script_start  # noqa: F401

import logging
import os
import sys

KINDS = ("train", "sft", "rm")
# what a CPU rank holds before any model: Python, torch, minihf, gloo (220 MB measured on
# torch 2.13 CPU); the bound on ranks per node is the host's available memory over this
RANK_FLOOR_BYTES = 256 * 2**20


def recipe_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """``[RECIPE] key=value ...`` (or ``recipe=NAME``) -> (recipe or None, overrides)."""
    from minihf.config import ConfigError, split_cli_args

    args = list(args)
    flags = [a for a in args if a.startswith("-")]
    if flags:  # torchrun's spellings (--nproc_per_node, --standalone) came through as a recipe or key
        raise ConfigError(f"{flags[0]!r} is not an option here: minihf's launch options are --nproc-per-node, "
                          "--nnodes, --node-rank and --rdzv-endpoint (with '-', before the recipe; one node "
                          "needs no --standalone), and the rest is [RECIPE] KEY=VALUE ...; see --help")
    if args and "=" not in args[0]:
        args[0] = f"recipe={args[0]}"
    return split_cli_args(args)


def load(kind: str, args: list[str]):
    """The validated config of a ``minihf KIND`` command line (``[RECIPE] key=value ...``)."""
    from minihf.config import load_config

    recipe, overrides = recipe_and_overrides(args)
    if kind == "train":
        from minihf.trainer.ppo_job import DEFAULT_RECIPE, PPOJobConfig

        return load_config(PPOJobConfig, recipe or DEFAULT_RECIPE, overrides)
    from minihf.trainer.sft import check_paths

    if kind == "sft":
        from minihf.trainer.sft import SFTConfig as cls
    else:
        from minihf.trainer.rm import RMConfig as cls
    cfg = load_config(cls, recipe, overrides)
    check_paths(cfg)
    return cfg


def run(kind: str, cfg) -> None:
    """The job of ``kind`` on this rank (a script's ``main``)."""
    if kind == "train":
        from minihf.trainer.ppo_job import run_ppo
        run_ppo(cfg)
    elif kind == "sft":
        from minihf.trainer.sft import run_sft
        run_sft(cfg)
    else:
        from minihf.trainer.rm import run_rm
        run_rm(cfg)


def _available_memory() -> int | None:
    """Bytes this host can still give processes (Linux ``MemAvailable``; else all of it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def max_local_ranks(cpu: bool = False) -> tuple[int, str]:
    """The most ranks one node can start, and why: one per GPU with CUDA (rank r drives
    ``cuda:r``); on CPU (or with ``cpu``: ranks that use no GPU), the host's available
    memory over ``RANK_FLOOR_BYTES`` (what a rank holds before any model). CPU ranks beyond
    the cores share them: slower, but they run."""
    import torch

    if not cpu and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return n, (f"each rank drives one GPU (cuda:LOCAL_RANK) and this node has {n}; more nodes: "
                   "--nnodes")
    from minihf.utils.threads import usable_cores

    cores = usable_cores().usable
    memory = _available_memory()
    if memory is None:  # no way to tell: a bound far above any CPU job, below a fork bomb
        return 64 * cores, f"without a memory figure for this host, at most 64 ranks per core ({cores} cores)"
    n = max(1, memory // RANK_FLOOR_BYTES)
    return n, (f"each CPU rank is a process holding ~{RANK_FLOOR_BYTES / 2**30:.2f} GB before any model "
               f"(Python, torch, gloo) and this host has {memory / 2**30:.1f} GB available, room for {n}; "
               f"ranks beyond its {cores} cores share them (slower), so {cores} run fastest")


def check_launch(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None
                 ) -> None:
    """The launch arguments of ``minihf train|sft|rm``, before anything is loaded: a
    ValueError naming the flag and the fix."""
    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nproc-per-node {nproc_per_node}, --nnodes {nnodes}, --node-rank {node_rank}: "
                         "need >= 1 process per node, >= 1 node, and 0 <= node rank < nodes")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, the same "
                         "on every node)")
    if rdzv_endpoint is not None:
        from minihf.controller.rendezvous import parse_endpoint

        parse_endpoint(rdzv_endpoint)
    if nproc_per_node > 1:
        most, why = max_local_ranks()
        if nproc_per_node > most:
            raise ValueError(f"--nproc-per-node {nproc_per_node} is more than this node can start: {why}; "
                             f"use --nproc-per-node {most} or fewer")


def launch_ranks(kind: str, args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None, rdzv_timeout_s: float = 600.0) -> int:
    """Start the ranks of this node and wait for the job; its exit code (0, the failing
    rank's, 1 when the nodes did not meet within ``rdzv_timeout_s`` (the job's
    ``controller.timeout_s``), or 130 after Ctrl-C). ``args`` were validated with ``load``
    already; the launch arguments are checked here again (``check_launch``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from minihf.controller.ranks import free_port
    from minihf.controller.rendezvous import RDZV_BACKEND, RendezvousFailed, WaitingRendezvous
    from minihf.utils.threads import usable_cores

    check_launch(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    rendezvous_handler_registry.register(RDZV_BACKEND, WaitingRendezvous.create)  # again: a no-op
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks' OpenMP starts at their share
        cores = usable_cores()
        threads = max(1, cores.usable // nproc_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        print(f"[minihf] OMP_NUM_THREADS={threads} per rank ({cores.usable} usable cores: {cores.why}; "
              f"{nproc_per_node} ranks per node); controller.threads decides in each rank", file=sys.stderr)
    config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node, run_id="minihf",
                          rdzv_backend=RDZV_BACKEND, rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
                          rdzv_configs={"rank": node_rank, "timeout": rdzv_timeout_s}, max_restarts=0)
    logging.disable(logging.ERROR)  # the launcher's own log lines: the ranks speak for themselves
    try:
        elastic_launch(config, sys.executable)("-m", "minihf.launcher", kind, *args)
    except RendezvousFailed as exc:
        print(f"[minihf] {exc}", file=sys.stderr)
        return 1
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"[minihf] the job failed: rank {rank} exited with code {failure.exitcode} (its message is "
              "above)", file=sys.stderr)
        return code
    except SignalException as exc:
        print(f"[minihf] interrupted ({exc.sigval.name}); rerun the same command to resume from the run's "
              "latest checkpoint", file=sys.stderr)
        return 130
    return 0


def main(kind: str, args: list[str]) -> None:
    """A rank's job (``scripts/train_*.py`` and the launched ranks): load, then run."""
    run(kind, load(kind, args))


if __name__ == "__main__":
    from minihf.controller import run_script

    run_script(lambda argv: main(argv[0], argv[1:]), sys.argv[1:])
