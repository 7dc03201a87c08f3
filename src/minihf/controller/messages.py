"""The few message types exchanged between the driver and a worker rank.

Driver -> worker: ``Command`` (run ``role.method``), ``Stop`` (leave the serve loop, answer
with an empty ``Reply``), ``Abort`` (leave it with an error, no answer), ``Ping`` (the
driver is alive; sent to idle workers, no answer). Worker -> driver:
one ``Reply`` per ``Command`` or ``Stop``, in order. ``TensorStub`` stands in for a tensor
whose bytes have not arrived yet (see ``transport.peek``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
class Ping:
    pass


@dataclass
class Abort:
    reason: str


@dataclass
class Reply:
    value: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True)
class TensorStub:
    """A tensor of a message before its bytes arrive: where it goes is decided from this."""
    index: int  # position in the message's tensor table
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
