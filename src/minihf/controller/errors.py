"""Errors the controller raises on the driver (rank 0) and on worker ranks.

``RemoteError`` is what a driver call raises when the worker method failed on some rank: it
names the rank, the role, the method and carries the remote traceback as text (exceptions
themselves are not shipped: their classes may not exist on rank 0 and may not pickle).
``RankLostError`` is the same for a rank that stopped answering (died, or exceeded
``timeout_s``). ``ControllerAborted`` ends the serve loop of a worker rank when the driver
gave up, so that every rank of the job exits non-zero.
"""

from __future__ import annotations


class ControllerError(RuntimeError):
    """Misuse of the controller (bad placement, unknown method, ...)."""


class RemoteError(RuntimeError):
    """A worker method raised on ``rank``; ``traceback`` is the remote traceback text."""

    def __init__(self, rank: int, role: str, method: str, traceback: str):
        self.rank, self.role, self.method, self.traceback = rank, role, method, traceback
        super().__init__(f"{role}.{method} failed on rank {rank}:\n{traceback.rstrip()}")

    def __reduce__(self):
        return (type(self), (self.rank, self.role, self.method, self.traceback))


class RankLostError(RemoteError):
    """``rank`` did not answer ``role.method``: it died or exceeded the controller timeout."""


class ControllerAborted(RuntimeError):
    """Raised on a worker rank when the driver aborted the job (after an error there)."""
