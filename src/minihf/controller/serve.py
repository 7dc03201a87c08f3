"""Running commands on a rank's local workers: the serve loop of worker ranks.

Ranks other than 0 sit in ``serve``: receive the next message from the driver, run it on
the named role's worker, send the ``Reply`` back, strictly in order, until ``Stop``
(``Ping``, the driver's heartbeat to idle workers, is skipped).
``execute`` is shared with the driver's own local executor, so a method behaves the same
wherever it runs: exceptions become a ``RemoteError`` with the traceback text.

Threads: ``serve`` runs the loop on the run's worker thread (``launch`` explains why).
"""

from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from minihf.controller.errors import ControllerAborted, ControllerError, RemoteError, user_summary
from minihf.controller.messages import Abort, Command, Ping, Reply, Stop
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
    except Exception as e:  # noqa: BLE001 - every failure goes back to the driver
        return Reply(error=RemoteError(rank, cmd.role, cmd.method, traceback.format_exc(), user_summary(e)))


def _send_reply(up: Channel, reply: Reply, cmd: Command | None, rank: int) -> None:
    try:
        packed = pack(reply, up.cuda)
    except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
        role, method = (cmd.role, cmd.method) if cmd else ("?", "stop")
        error = RemoteError(rank, role, method, "could not send the return value back:\n"
                            + traceback.format_exc())
        packed = pack(Reply(error=error), up.cuda)
    up.wait(up.isend(packed))


def serve(down: Channel, up: Channel, workers: dict[str, Worker], rank: int,
          idle_timeout_s: float | None, pool: ThreadPoolExecutor) -> None:
    """Answer the driver's commands in order until ``Stop``; ``Abort`` raises.

    Between commands, every message (a command or the driver's ``Ping`` heartbeat) must
    arrive within the channel's timeout, else the driver counts as gone; with
    ``idle_timeout_s``, a command must also come within that long of the previous reply.
    The loop runs on ``pool``'s thread, the run's worker thread.
    """
    pool.submit(_serve_loop, down, up, workers, rank, idle_timeout_s).result()


def _next_message(down: Channel, rank: int, idle_since: float,
                  idle_timeout_s: float | None) -> Any:
    """The driver's next message, or a ``ControllerError`` saying why none came."""
    wait = down.timeout.total_seconds()
    idle_left = None
    if idle_timeout_s is not None:
        idle_left = idle_timeout_s - (time.monotonic() - idle_since)
        wait = max(min(wait, idle_left), 0.001)
    t0 = time.monotonic()
    try:
        return down.recv(timeout_s=wait)
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001 - a timeout or a closed connection
        if time.monotonic() - t0 < wait * 0.9:
            why = f"the connection to the driver (rank 0) failed: it died or ended ({e})"
        elif idle_left is not None and idle_left <= wait:
            why = (f"no command from the driver for idle_timeout_s={idle_timeout_s:g}s; raise "
                   "it (or set it to null) if the driver legitimately works longer alone")
        else:
            why = (f"heard nothing from the driver (rank 0), not even its heartbeat, for "
                   f"timeout_s={wait:g}s: it hung or its host is gone")
        raise ControllerError(f"rank {rank}: {why}") from e


def _serve_loop(down: Channel, up: Channel, workers: dict[str, Worker], rank: int,
                idle_timeout_s: float | None) -> None:
    idle_since = time.monotonic()
    while True:
        try:
            msg: Any = _next_message(down, rank, idle_since, idle_timeout_s)
        except DecodeError as e:
            _send_reply(up, Reply(error=RemoteError(rank, "?", "?", str(e))), None, rank)
            idle_since = time.monotonic()
            continue
        if isinstance(msg, Ping):
            continue
        if isinstance(msg, Stop):
            _send_reply(up, Reply(), None, rank)
            return
        if isinstance(msg, Abort):
            raise ControllerAborted(f"rank {rank}: the driver aborted the job: {msg.reason}")
        _send_reply(up, execute(workers, msg, rank), msg, rank)
        idle_since = time.monotonic()
