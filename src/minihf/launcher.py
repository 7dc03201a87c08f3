"""``minihf train|sft|rm ... --nproc-per-node N``: a launcher that checks before it starts.

The whole config is loaded and validated here, in the parent, before any rank starts: a
bad key or value is one line and exit code 2. The ranks then run as
``python -m minihf.launcher KIND ARGS`` (what ``scripts/train_*.py`` do under torchrun)
through torch's elastic launch API, with a static rendezvous: one node by default (a free
local port), or ``--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`` with one launcher
per node, as ``torchrun --nnodes M --node-rank R --master-addr HOST --master-port PORT``.
A failed job is one line naming the failing rank and its exit code, under that rank's
own message (no launcher traceback or failure table); Ctrl-C ends every rank, each with
its line, and exits 130. Unless ``OMP_NUM_THREADS`` is set, each rank gets the machine's
cores divided by the ranks per node, said once.
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank: the scripts' start-up first (before the imports below)
    import minihf.utils.script_start  # noqa: F401

import logging
import os
import sys

KINDS = ("train", "sft", "rm")


def recipe_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """``[RECIPE] key=value ...`` (or ``recipe=NAME``) -> (recipe or None, overrides)."""
    from minihf.config import split_cli_args

    args = list(args)
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


def launch_ranks(kind: str, args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None) -> int:
    """Start the ranks of this node and wait for the job; its exit code (0, the failing
    rank's, or 130 after Ctrl-C). ``args`` were validated with ``load`` already."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from minihf.controller.ranks import free_port

    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nproc-per-node {nproc_per_node}, --nnodes {nnodes}, --node-rank {node_rank}: "
                         "need >= 1 process per node, >= 1 node, and 0 <= node rank < nodes")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, the same "
                         "on every node)")
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // nproc_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        print(f"[minihf] OMP_NUM_THREADS={threads} per rank ({os.cpu_count()} cores, {nproc_per_node} ranks "
              "per node); set OMP_NUM_THREADS to choose", file=sys.stderr)
    config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node, run_id="minihf",
                          rdzv_backend="static", rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
                          rdzv_configs={"rank": node_rank}, max_restarts=0)
    logging.disable(logging.ERROR)  # the launcher's own log lines: the ranks speak for themselves
    try:
        elastic_launch(config, sys.executable)("-m", "minihf.launcher", kind, *args)
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
