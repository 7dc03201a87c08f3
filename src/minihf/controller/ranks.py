"""The job's rank processes as the operating system sees them.

Two ways a job could outlive its failure, closed here and in ``minihf.utils.script_start``: a
worker whose torchrun launcher was SIGKILLed (it would train on as an orphan;
``process_exit.die_with_launcher``, from the script's first import), and a rank frozen by
SIGSTOP or stuck in the kernel, which cannot act on torchrun's SIGTERM (``kill_lost_rank``,
from the ``(host, pid, start time)`` every rank reports at start-up, ``rank_processes``).
Used by ``launch.launch_job``.
"""

from __future__ import annotations

import os
import signal
import socket

import torch.distributed as dist

from minihf.controller.errors import RankLostError


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``; ``None`` if it is gone or unknown):
    with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, after "pid (comm)"
    except (OSError, IndexError):
        return None


def rank_processes() -> list[tuple[str, int, str | None]]:
    """``(host, pid, start time)`` of every rank (a collective: every rank calls it)."""
    me = (socket.gethostname(), os.getpid(), start_time(os.getpid()))
    if dist.get_world_size() == 1:
        return [me]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    return out


def kill_lost_rank(error: BaseException, processes: list) -> None:
    """After rank ``r`` stopped answering (``RankLostError``): if it still runs on this host
    (frozen, e.g. SIGSTOPped or stuck in the kernel), SIGKILL it. A frozen rank cannot act on
    torchrun's SIGTERM, and torchrun would otherwise wait ~30 s more before the job ends."""
    if not isinstance(error, RankLostError) or not 0 <= error.rank < len(processes):
        return
    host, pid, start = processes[error.rank]
    if host != socket.gethostname() or start is None or start_time(pid) != start:
        return  # on another host, or already gone (its pid may belong to someone else now)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
