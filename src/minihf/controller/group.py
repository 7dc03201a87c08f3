"""``WorkerGroup``: rank 0's proxy for one role, so driver calls look like local calls.

``critic.compute_values(batch)`` looks ``compute_values`` up in the worker class's explicit
``remote_methods`` table and returns the collected result; a method registered with
``blocking=False`` returns a ``CallFuture`` instead, and ``critic.compute_values.future(batch)``
always does. Calls to groups on disjoint ranks run at the same time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from minihf.controller.driver import CallFuture, Driver
from minihf.controller.errors import ControllerError
from minihf.controller.layout import DEFAULT_LAYOUT, RoleLayout
from minihf.controller.worker import MethodSpec, Worker
from minihf.protocol import Batch


class RemoteCall:
    """One registered method of a ``WorkerGroup``, bound and ready to call."""

    def __init__(self, group: WorkerGroup, spec: MethodSpec):
        self._group, self.spec = group, spec

    def future(self, *args: Any, **kwargs: Any) -> CallFuture:
        g = self._group
        return g._driver.call(g.layout_of(self.spec), self.spec, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.spec.blocking:
            return self.future(*args, **kwargs)
        g = self._group
        return g._driver.call(g.layout_of(self.spec), self.spec, args, kwargs,
                              track=False).result()

    def __repr__(self) -> str:
        return f"<remote {self._group.role}.{self.spec.name} dispatch={self.spec.dispatch}>"


class WorkerGroup:
    """The workers of one role, seen from the driver."""

    def __init__(self, layout: RoleLayout, worker_cls: type[Worker], driver: Driver,
                 layouts: dict[str, RoleLayout] | None = None,
                 reads: dict[str, tuple[str, ...]] | None = None):
        """``reads``: Batch keys a method reads beyond its registered ones
        (``Worker.declare_reads``), method name -> keys."""
        self.layout, self.worker_cls, self._driver = layout, worker_cls, driver
        self.layouts = {DEFAULT_LAYOUT: layout, **(layouts or {})}  # name -> layout
        self.reads = dict(reads or {})
        unknown = sorted(set(self.reads) - set(worker_cls.remote_methods))
        if unknown:
            raise ControllerError(f"{worker_cls.__name__}.declare_reads names {unknown}, which are not its "
                                  f"remote methods ({self.method_names()})")

    def layout_of(self, spec: MethodSpec) -> RoleLayout:
        """The layout a method is dispatched over."""
        try:
            return self.layouts[spec.layout]
        except KeyError:
            raise ControllerError(
                f"{self.role}.{spec.name} uses layout {spec.layout!r}, which "
                f"{self.worker_cls.__name__} does not declare (declare_layouts gives "
                f"{sorted(self.layouts)})") from None

    @property
    def role(self) -> str:
        return self.layout.role

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.layout.ranks

    @property
    def world_size(self) -> int:
        return self.layout.size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def sent_bytes(self) -> dict[str, int]:
        """Bytes of the commands the driver has sent to this role so far, per method (to
        other ranks; rank 0's own workers get theirs in memory)."""
        prefix = f"{self.role}."
        return {k[len(prefix):]: v for k, v in self._driver.sent_bytes.items() if k.startswith(prefix)}

    def method_names(self) -> list[str]:
        return sorted(self.worker_cls.remote_methods)

    def __getattr__(self, name: str) -> RemoteCall:
        if name.startswith("_"):
            raise AttributeError(name)
        spec = self.worker_cls.remote_methods.get(name)
        if spec is None:
            raise AttributeError(
                f"role {self.role!r} ({self.worker_cls.__name__}) has no remote method "
                f"{name!r}; registered methods: {self.method_names()} (declare one with "
                "@register on the worker class)")
        more = self.reads.get(name, ())
        if more and spec.reads is not None:
            spec = replace(spec, reads=spec.reads + tuple(k for k in more if k not in spec.reads))
        return RemoteCall(self, spec)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.method_names()))

    def __repr__(self) -> str:
        return (f"WorkerGroup(role={self.role!r}, ranks={list(self.ranks)}, "
                f"tp_size={self.tp_size}, worker={self.worker_cls.__name__})")


class _Mapped:
    """A future whose result goes through ``fn``."""

    def __init__(self, future: Any, fn: Any):
        self._future, self._fn = future, fn

    def result(self, timeout: float | None = None) -> Any:
        return self._fn(self._future.result(timeout))


class _RenamedCall:
    """A remote method (or any callable with ``.future``) behind a ``Renamed`` proxy."""

    def __init__(self, call: Any, proxy: Renamed):
        self._call, self._proxy = call, proxy

    def _args(self, args: tuple) -> tuple:
        return tuple(self._proxy.rename_in(a) for a in args)

    def future(self, *args: Any, **kwargs: Any) -> _Mapped:
        return _Mapped(self._call.future(*self._args(args), **kwargs), self._proxy.rename_out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = getattr(self._call, "spec", None)
        if spec is not None and not spec.blocking:
            return self.future(*args, **kwargs)
        return self._proxy.rename_out(self._call(*self._args(args), **kwargs))


class Renamed:
    """A ``WorkerGroup`` whose calls see batch keys under other names, so one worker class
    serves a second role (the cost critic is a ``CriticWorker`` reading ``cost_values`` as
    its ``values``).

    ``inputs`` maps the worker's key to the batch's: a ``Batch`` argument loses the worker's
    key and gets the batch key's tensor under it, when there is one. ``outputs`` maps
    result names back: a ``Batch`` result's keys, or a dict result's keys, renamed where
    they equal an entry (``"values"``) or start with one ending in ``/`` (``"critic/"``).
    Everything else (ranks, sizes, other arguments) is the group's.
    """

    def __init__(self, group: Any, inputs: dict[str, str] | None = None,
                 outputs: dict[str, str] | None = None):
        self._group, self._inputs, self._outputs = group, dict(inputs or {}), dict(outputs or {})

    def rename_in(self, value: Any) -> Any:
        if not isinstance(value, Batch) or not self._inputs:
            return value
        tensors = dict(value.tensors)
        for worker_key, batch_key in self._inputs.items():
            tensors.pop(worker_key, None)
            if batch_key in value.tensors:
                tensors[worker_key] = value.tensors[batch_key]
        return Batch(tensors, value.non_tensors, value.meta)

    def _name(self, key: str) -> str:
        for old, new in self._outputs.items():
            if key == old:
                return new
            if old.endswith("/") and key.startswith(old):
                return new + key[len(old):]
        return key

    def rename_out(self, value: Any) -> Any:
        if isinstance(value, Batch):
            return Batch({self._name(k): v for k, v in value.tensors.items()},
                         {self._name(k): v for k, v in value.non_tensors.items()}, value.meta)
        if isinstance(value, dict):
            return {self._name(k) if isinstance(k, str) else k: v for k, v in value.items()}
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._group, name)
        return _RenamedCall(attr, self) if hasattr(attr, "future") else attr

    def __repr__(self) -> str:
        return f"Renamed({self._group!r}, inputs={self._inputs}, outputs={self._outputs})"
