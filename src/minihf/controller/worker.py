"""``Worker`` base class and the ``@register`` decorator that declares remote methods.

``@register(dispatch=..., collect=..., blocking=...)`` turns a method into a
``RemoteMethod`` descriptor: it still behaves like the plain method on the worker itself,
and it carries a ``MethodSpec``. ``Worker.__init_subclass__`` builds the class's explicit
table ``remote_methods`` (name -> spec) from its bases' tables plus the ``RemoteMethod``
entries in the class body; ``WorkerGroup`` and the serve loop only ever look names up in
that table (no ``dir()`` scans, no attribute-string conventions).

The runtime creates a worker with ``create_worker``: it binds the ``WorkerContext`` (rank,
role, role process group, layout, device) *before* calling ``__init__``, so ``self.device``
and friends are usable inside ``__init__``; subclasses just call ``super().__init__()``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch

from minihf.controller.dispatch import CollectFn, Dispatch, RoleLayout, get_dispatch_mode
from minihf.controller.errors import ControllerError


@dataclass(frozen=True)
class MethodSpec:
    """How the driver calls one worker method."""
    name: str
    dispatch: str
    collect: CollectFn | None = None  # None: the dispatch mode's own collect function
    blocking: bool = True

    def collect_fn(self) -> CollectFn:
        return self.collect or get_dispatch_mode(self.dispatch).collect_fn


class RemoteMethod:
    """A worker method declared with ``@register``: callable locally, listed for the driver."""

    def __init__(self, fn: Callable, spec: MethodSpec):
        self.fn, self.spec = fn, spec
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner: type, name: str) -> None:
        self.spec = replace(self.spec, name=name)

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable:
        return self.fn if obj is None else self.fn.__get__(obj, objtype)


def register(dispatch: str = Dispatch.ONE_TO_ALL, collect: str | CollectFn | None = None,
             blocking: bool = True) -> Callable[[Callable], RemoteMethod]:
    """Declare a worker method callable from the driver.

    ``dispatch`` names a mode of ``DISPATCH_MODES``; ``collect`` overrides how results are
    joined (a mode name, whose collect function is used, or a ``collect_fn(layout, outputs,
    ctx)``); ``blocking=False`` makes the driver call return a future.
    """
    get_dispatch_mode(dispatch)  # fail at class definition on a typo
    if isinstance(collect, str):
        collect = get_dispatch_mode(collect).collect_fn

    def wrap(fn: Callable) -> RemoteMethod:
        if isinstance(fn, RemoteMethod):
            raise ControllerError(f"{fn.spec.name} is decorated with @register twice")
        return RemoteMethod(fn, MethodSpec(fn.__name__, dispatch, collect, blocking))

    return wrap


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker runs: global rank, its role's layout and process group, its device."""
    rank: int
    layout: RoleLayout
    group: Any  # torch.distributed ProcessGroup of the role's ranks
    device: torch.device
    dp_group: Any = None  # this rank's DP group (same TP rank); the role group if tp_size 1
    tp_group: Any = None  # this rank's TP group; the role group if dp_size is 1


class Worker:
    """Base class of role workers; one instance per rank of the role's placement."""

    remote_methods: ClassVar[dict[str, MethodSpec]] = {}
    _ctx: WorkerContext | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        table: dict[str, MethodSpec] = {}
        for base in reversed(cls.__mro__[1:]):
            if issubclass(base, Worker):
                table.update(base.remote_methods)
        for name, value in vars(cls).items():
            if isinstance(value, RemoteMethod):
                table[name] = value.spec
        cls.remote_methods = table

    @property
    def ctx(self) -> WorkerContext:
        if self._ctx is None:
            raise ControllerError(f"{type(self).__name__} was constructed directly; create "
                                  "workers through minihf.controller.launch/run (or "
                                  "create_worker) so they know their rank, group and device")
        return self._ctx

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def role(self) -> str:
        return self.ctx.layout.role

    @property
    def group(self) -> Any:
        return self.ctx.group

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def role_rank(self) -> int:
        return self.ctx.layout.ranks.index(self.ctx.rank)

    @property
    def role_size(self) -> int:
        return self.ctx.layout.size

    @property
    def dp_rank(self) -> int:
        return self.ctx.layout.dp_rank(self.role_rank)

    @property
    def dp_size(self) -> int:
        return self.ctx.layout.dp_size

    @property
    def tp_rank(self) -> int:
        return self.ctx.layout.tp_rank(self.role_rank)

    @property
    def tp_size(self) -> int:
        return self.ctx.layout.tp_size

    @property
    def dp_group(self) -> Any:
        return self.ctx.dp_group

    @property
    def tp_group(self) -> Any:
        return self.ctx.tp_group


def create_worker(cls: type[Worker], ctx: WorkerContext, args: tuple = (),
                  kwargs: dict | None = None) -> Worker:
    """Construct ``cls(*args, **kwargs)`` with ``ctx`` bound before ``__init__`` runs."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ControllerError(f"role {ctx.layout.role!r}: {cls!r} is not a Worker subclass")
    worker = cls.__new__(cls)
    worker._ctx = ctx
    worker.__init__(*args, **(kwargs or {}))
    return worker
