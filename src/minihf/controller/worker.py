"""``Worker`` base class and the ``@register`` decorator that declares remote methods.

``@register(dispatch=..., collect=..., blocking=..., layout=...)`` turns a method into a
``RemoteMethod`` descriptor: it still behaves like the plain method on the worker itself,
and it carries a ``MethodSpec``. ``Worker.__init_subclass__`` builds the class's explicit
table ``remote_methods`` (name -> spec) from the ``RemoteMethod`` entries of the class and
its bases (``registered_methods``); ``WorkerGroup`` and the serve loop only ever look names up in
that table (no ``dir()`` scans, no attribute-string conventions).

The runtime creates a worker with ``create_worker``: it binds the ``WorkerContext`` (rank,
role, role process group, layouts and their groups, device) *before* calling ``__init__``,
so ``self.device`` and friends are usable inside ``__init__``; subclasses just call
``super().__init__()``. ``dp_rank``/``tp_rank``/... describe the default layout;
``self.parallel(name)`` any declared one. A worker class declares its extra layouts with
the classmethod ``declare_layouts(*args, **kwargs)`` (from its constructor arguments,
e.g. the rollout TP size in its config), so every rank can build their groups at launch;
``declare_reads(*args, **kwargs)`` adds Batch keys a method reads, from its config.
Every worker has ``start_profile`` / ``stop_profile`` (``trainer.profile_steps``,
``minihf.utils.profiling``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

import torch

from minihf.controller.dispatch import (CollectFn, Dispatch, RepliesFn, all_replies,
                                        get_dispatch_mode)
from minihf.controller.errors import ControllerError
from minihf.controller.layout import DEFAULT_LAYOUT, RoleLayout


@dataclass(frozen=True)
class MethodSpec:
    """How the driver calls one worker method."""
    name: str
    dispatch: str
    collect: CollectFn | None = None  # None: the dispatch mode's own collect function
    blocking: bool = True
    layout: str = DEFAULT_LAYOUT  # which of the role's layouts the call is dispatched over
    replies: RepliesFn = all_replies  # which of the dispatch's collect_from ranks reply
    reads: tuple[str, ...] | None = None  # Batch keys the method reads (None: it gets all)

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
             blocking: bool = True, layout: str = DEFAULT_LAYOUT,
             reads: tuple[str, ...] | None = None) -> Callable[[Callable], RemoteMethod]:
    """Declare a worker method callable from the driver.

    ``dispatch`` names a mode of ``DISPATCH_MODES``; ``collect`` overrides how results are
    joined (a mode name, whose collect function and ``replies`` are used, or a
    ``collect_fn(layout, outputs, ctx)``); ``blocking=False`` makes the driver call return a
    future; ``layout`` names the role layout the call is split over (``"default"``, or one
    the worker class declares in ``declare_layouts``); ``reads`` names the ``Batch`` keys
    (tensor or non-tensor columns) the method reads: the driver sends only those of them
    that a ``Batch`` argument holds, with its meta (None: the whole batch).
    """
    get_dispatch_mode(dispatch)  # fail at class definition on a typo
    replies = all_replies
    if isinstance(collect, str):
        mode = get_dispatch_mode(collect)
        collect, replies = mode.collect_fn, mode.replies

    def wrap(fn: Callable) -> RemoteMethod:
        if isinstance(fn, RemoteMethod):
            raise ControllerError(f"{fn.spec.name} is decorated with @register twice")
        return RemoteMethod(fn, MethodSpec(fn.__name__, dispatch, collect, blocking, layout,
                                           replies, tuple(reads) if reads is not None else None))

    return wrap


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in one layout of its role, with that layout's process groups."""
    layout: RoleLayout
    dp_rank: int
    tp_rank: int
    dp_group: Any = None  # ranks with this rank's TP rank (FSDP gather group of a strided layout)
    tp_group: Any = None  # this rank's replica

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker runs: global rank, its role's layouts and process groups, its device."""
    rank: int
    layout: RoleLayout  # the default layout
    group: Any  # torch.distributed ProcessGroup of the role's ranks
    device: torch.device
    dp_group: Any = None  # this rank's DP group (same TP rank); the role group if tp_size 1
    tp_group: Any = None  # this rank's TP group; the role group if dp_size is 1
    others: dict = field(default_factory=dict)  # declared layout name -> ParallelInfo
    links: dict = field(default_factory=dict)  # linked role -> group over both roles' ranks

    def parallel(self, name: str = DEFAULT_LAYOUT) -> ParallelInfo:
        if name == DEFAULT_LAYOUT:
            i = self.layout.ranks.index(self.rank)
            return ParallelInfo(self.layout, self.layout.dp_rank(i), self.layout.tp_rank(i),
                                self.dp_group, self.tp_group)
        if name not in self.others:
            raise ControllerError(f"role {self.layout.role!r} has no layout {name!r}; declared: "
                                  f"{[DEFAULT_LAYOUT, *sorted(self.others)]}")
        return self.others[name]


class Worker:
    """Base class of role workers; one instance per rank of the role's placement."""

    remote_methods: ClassVar[dict[str, MethodSpec]] = {}
    # roles this one exchanges tensors with directly (a group over both roles' ranks is
    # made at launch when both are in the job: ``link(role)``)
    linked_roles: ClassVar[tuple[str, ...]] = ()
    _ctx: WorkerContext | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.remote_methods = registered_methods(cls)

    @classmethod
    def declare_layouts(cls, *args: Any, **kwargs: Any) -> dict[str, int]:
        """Extra (TP-strided) layouts of this role, name -> TP size, from the constructor's
        arguments; called on every rank at launch, before the worker exists."""
        return {}

    @classmethod
    def declare_reads(cls, *args: Any, **kwargs: Any) -> dict[str, tuple[str, ...]]:
        """Batch keys a method reads beyond its ``@register(reads=...)``, method name -> keys,
        from the constructor's arguments (a recipe's loss that reads a teacher's tensors);
        called on rank 0 at launch."""
        return {}

    def link(self, role: str) -> Any:
        """The process group over this role's ranks and ``role``'s (``linked_roles``)."""
        if role not in self.ctx.links:
            raise ControllerError(f"role {self.role!r} has no link to role {role!r}: it is not in "
                                  f"the job, or neither worker class names the other in linked_roles "
                                  f"(links: {sorted(self.ctx.links)})")
        return self.ctx.links[role]

    def parallel(self, layout: str = DEFAULT_LAYOUT) -> ParallelInfo:
        """This rank's DP/TP ranks and groups in ``layout``."""
        return self.ctx.parallel(layout)

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

    # -- every role's: a profile of this process (trainer.profile_steps) ------------------
    @register()
    def start_profile(self, out_dir: str) -> bool:
        """Profile this process into ``out_dir`` (``minihf.utils.profiling``); False where a
        colocated role's worker started it already."""
        from minihf.utils import profiling

        return profiling.start(out_dir, f"rank{self.rank}", self.device.type == "cuda")

    @register()
    def stop_profile(self) -> str | None:
        """Stop this process's profile and write it; the table's path, or None."""
        from minihf.utils import profiling

        return profiling.stop()


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> spec of every ``@register`` method of ``cls`` and its bases (a subclass's
    entry wins); every worker class's ``remote_methods``, the base's included."""
    table: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        table.update((n, v.spec) for n, v in vars(klass).items() if isinstance(v, RemoteMethod))
    return table


Worker.remote_methods = registered_methods(Worker)  # subclasses get theirs in __init_subclass__


def create_worker(cls: type[Worker], ctx: WorkerContext, args: tuple = (),
                  kwargs: dict | None = None) -> Worker:
    """Construct ``cls(*args, **kwargs)`` with ``ctx`` bound before ``__init__`` runs."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ControllerError(f"role {ctx.layout.role!r}: {cls!r} is not a Worker subclass")
    worker = cls.__new__(cls)
    worker._ctx = ctx
    worker.__init__(*args, **(kwargs or {}))
    return worker
