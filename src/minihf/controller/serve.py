"""Running commands on a rank's local workers: the serve loop of worker ranks.

Ranks other than 0 sit in ``serve``: receive the next message from the driver, run it on
the named role's worker, send the ``Reply`` back, strictly in order, until ``Stop``.
``execute`` is shared with the driver's own local executor, so a method behaves the same
wherever it runs: exceptions become a ``RemoteError`` with the traceback text.
"""

from __future__ import annotations

import traceback
from typing import Any

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
    """Answer the driver's commands in order until ``Stop``; ``Abort`` raises."""
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
