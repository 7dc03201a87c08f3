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
    """A worker method raised on ``rank``; ``traceback`` is the remote traceback text;
    ``summary`` the one line that says it all, for an error minihf raised for the user
    (``user_summary``), else None."""

    def __init__(self, rank: int, role: str, method: str, traceback: str, summary: str | None = None):
        self.rank, self.role, self.method, self.traceback = rank, role, method, traceback
        self.summary = summary
        super().__init__(f"{role}.{method} failed on rank {rank}:\n{traceback.rstrip()}")

    def __reduce__(self):
        return (type(self), (self.rank, self.role, self.method, self.traceback, self.summary))


def user_summary(e: BaseException) -> str | None:
    """``Type: message`` for an error of minihf's own user-error classes (a ``ValueError`` or
    ``OSError`` subclass defined in minihf: ``ConfigError``, ``CorruptFileError``, a failed
    checkpoint write ...), whose message names the value and the fix; None for anything
    else, whose traceback is what to read."""
    if isinstance(e, (ValueError, OSError)) and type(e).__module__.startswith("minihf."):
        return f"{type(e).__name__}: {e}"
    return None


class RankLostError(RemoteError):
    """``rank`` did not answer ``role.method``: it died or exceeded the controller timeout."""


class ControllerAborted(RuntimeError):
    """Raised on a worker rank when the driver aborted the job (after an error there)."""
