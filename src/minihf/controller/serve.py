"""Running commands on a rank's local workers: the serve loop of worker ranks.

Ranks other than 0 sit in ``serve``: receive the next message from the driver, run it on
the named role's worker, send the ``Reply`` back, strictly in order, until ``Stop``.
``execute`` is shared with the driver's own local executor, so a method behaves the same
wherever it runs: exceptions become a ``RemoteError`` with the traceback text.

Threads: worker methods run on a thread owned by one ``serve`` call (rank 0's executor
thread is likewise owned by one ``Driver``), never on the caller's long-lived thread. torch
keeps per-thread caches keyed by objects that compare equal across runs: DTensor's sharding
cache hands back output specs holding the ``DeviceMesh`` that was current when an entry was
made, and meshes over the same ranks built on the same thread are equal even when their
process groups differ. A second ``run`` in the same processes on the caller's thread would
therefore send FSDP's collectives over the previous run's (destroyed) groups on worker
ranks only, while rank 0 (fresh thread) used the new ones: a hang. A fresh thread per run
starts every rank with empty caches.
"""

from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from minihf.controller.errors import ControllerAborted, RemoteError
from minihf.controller.messages import Abort, Command, Reply, Stop
from minihf.controller.transport import Channel, DecodeError, pack
from minihf.controller.worker import Worker


def execute(workers: dict[str, Worker], cmd: Command, rank: int) -> Reply:
    """Run ``cmd`` on this rank's worker for ``cmd.role``; errors go into the Reply."""
    try:
        worker = workers[cmd.role]
        if cmd.method not in type(worker).remote_methods:
            raise AttributeError(f"{type(worker).__name__} has no @register method "
                                 f"{cmd.method!r}")
        value = getattr(worker, cmd.method)(*cmd.args, **cmd.kwargs)
        return Reply(value if cmd.reply else None)
    except Exception:  # noqa: BLE001 - every failure goes back to the driver
        return Reply(error=RemoteError(rank, cmd.role, cmd.method, traceback.format_exc()))


def _send_reply(up: Channel, reply: Reply, cmd: Command | None, rank: int) -> None:
    try:
        packed = pack(reply, up.cuda)
    except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
        role, method = (cmd.role, cmd.method) if cmd else ("?", "stop")
        error = RemoteError(rank, role, method, "could not send the return value back:\n"
                            + traceback.format_exc())
        packed = pack(Reply(error=error), up.cuda)
    up.wait(up.isend(packed))


def serve(down: Channel, up: Channel, workers: dict[str, Worker], rank: int) -> None:
    """Answer the driver's commands in order until ``Stop``; ``Abort`` raises.

    The loop runs on a new thread that ends with this call (see the module docstring).
    """
    def init_thread() -> None:
        if down.cuda is not None:  # the current device is per thread
            torch.cuda.set_device(down.cuda)

    with ThreadPoolExecutor(1, thread_name_prefix="minihf-serve",
                            initializer=init_thread) as pool:
        pool.submit(_serve_loop, down, up, workers, rank).result()


def _serve_loop(down: Channel, up: Channel, workers: dict[str, Worker], rank: int) -> None:
    while True:
        try:
            msg: Any = down.recv()
        except DecodeError as e:
            _send_reply(up, Reply(error=RemoteError(rank, "?", "?", str(e))), None, rank)
            continue
        if isinstance(msg, Stop):
            _send_reply(up, Reply(), None, rank)
            return
        if isinstance(msg, Abort):
            raise ControllerAborted(f"rank {rank}: the driver aborted the job: {msg.reason}")
        _send_reply(up, execute(workers, msg, rank), msg, rank)
