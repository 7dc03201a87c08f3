"""The few message types exchanged between the driver and a worker rank.

Driver -> worker: ``Command`` (run ``role.method``), ``Stop`` (leave the serve loop, answer
with an empty ``Reply``), ``Abort`` (leave it with an error, no answer). Worker -> driver:
one ``Reply`` per ``Command`` or ``Stop``, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minihf.controller.errors import RemoteError


@dataclass
class Command:
    role: str
    method: str
    args: tuple
    kwargs: dict
    reply: bool  # False: only acknowledge (the collect function does not need this rank)


@dataclass
class Stop:
    pass


@dataclass
class Abort:
    reason: str


@dataclass
class Reply:
    value: Any = None
    error: RemoteError | None = None
