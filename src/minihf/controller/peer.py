"""Rank 0's link to one worker rank: the calls it has not answered yet, in order.

A ``Peer`` sends commands on the rank's "down" channel and runs one receiver thread that,
while calls are pending, receives the next ``Reply`` on the "up" channel and resolves the
oldest future (worker ranks answer in order, so replies need no ids). Any transport
failure marks the peer lost: its pending and later calls raise ``RankLostError``. ``ping``
sends the heartbeat, only while no call is in flight (see ``driver``).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

import torch

from minihf.controller.errors import RankLostError, RemoteError
from minihf.controller.messages import Reply
from minihf.controller.transport import Channel, DecodeError, Into, Packed


class Peer:
    """Rank 0's link to one worker rank: ordered pending calls and their receiver thread."""

    def __init__(self, rank: int, down: Channel, up: Channel, timeout_s: float):
        self.rank, self.down, self.up, self.timeout_s = rank, down, up, timeout_s
        self._pending: deque = deque()  # (future, send works, packed, role, method, into)
        self._cond = threading.Condition()
        self._lost: BaseException | None = None
        self._closed = False
        self.stopped = False  # acknowledged STOP: left its serve loop
        self.late_pings: list = []  # heartbeat sends that did not complete in time
        self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                        name=f"minihf-recv-rank{rank}")
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def _lost_error(self, role: str, method: str) -> RankLostError:
        return RankLostError(self.rank, role, method,
                             f"rank {self.rank} did not answer: it died, or a call exceeded "
                             f"the controller timeout ({self.timeout_s:g}s; raise "
                             f"timeout_s if calls legitimately take longer).\n"
                             f"Cause: {self._lost!r}")

    def send(self, packed: Packed, role: str, method: str, into: Into | None = None) -> Future:
        """Send a command; the future gets its reply (tensors received ``into``, if given)."""
        fut: Future = Future()
        with self._cond:
            if self._lost is None:
                try:
                    works = self.down.isend(packed)
                except Exception as e:  # noqa: BLE001 - a dead peer surfaces here too
                    self._lost = e
                else:
                    self._pending.append((fut, works, packed, role, method, into))
                    self._cond.notify()
                    return fut
        fut.set_exception(self._lost_error(role, method))
        return fut

    def _receive_loop(self) -> None:
        if self.up.cuda is not None:  # the current device is per thread
            torch.cuda.set_device(self.up.cuda)
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                fut, works, _, role, method, into = self._pending[0]
            try:
                try:
                    reply = self.up.recv(into)
                except DecodeError as e:
                    reply = Reply(error=RemoteError(self.rank, role, method, str(e)))
                self.down.wait(works)  # done by now: the worker answered
            except Exception as e:  # noqa: BLE001 - any transport failure loses the peer
                with self._cond:
                    self._lost = e
                    pending = list(self._pending)
                    self._pending.clear()
                for fut, _, _, role, method, _ in pending:
                    fut.set_exception(self._lost_error(role, method))
                return
            with self._cond:
                self._pending.popleft()
            if reply.error is not None:
                fut.set_exception(reply.error)
            else:
                fut.set_result(reply.value)

    def ping(self, packed: Packed) -> list | None:
        """Send a heartbeat if no call is in flight; the send works (or None if not sent)."""
        with self._cond:
            if self._lost is not None or self._pending or self.stopped:
                return None
            try:
                return self.down.isend(packed)
            except Exception:  # noqa: BLE001 - the next call finds the peer lost
                return None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=self.timeout_s)
