"""``WorkerGroup``: rank 0's proxy for one role, so driver calls look like local calls.

``critic.compute_values(batch)`` looks ``compute_values`` up in the worker class's explicit
``remote_methods`` table and returns the collected result; a method registered with
``blocking=False`` returns a ``CallFuture`` instead, and ``critic.compute_values.future(batch)``
always does. Calls to groups on disjoint ranks run at the same time.
"""

from __future__ import annotations

from typing import Any

from minihf.controller.driver import CallFuture, Driver
from minihf.controller.errors import ControllerError
from minihf.controller.layout import DEFAULT_LAYOUT, RoleLayout
from minihf.controller.worker import MethodSpec, Worker


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
                 layouts: dict[str, RoleLayout] | None = None):
        self.layout, self.worker_cls, self._driver = layout, worker_cls, driver
        self.layouts = {DEFAULT_LAYOUT: layout, **(layouts or {})}  # name -> layout

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
        return RemoteCall(self, spec)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.method_names()))

    def __repr__(self) -> str:
        return (f"WorkerGroup(role={self.role!r}, ranks={list(self.ranks)}, "
                f"tp_size={self.tp_size}, worker={self.worker_cls.__name__})")
