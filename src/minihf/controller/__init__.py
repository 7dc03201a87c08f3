"""minihf.controller: the single controller over torch.distributed.

Rank 0 runs the driver (a plain sequential program) and calls role worker groups as if
they were local objects; every other rank serves commands until STOP. See ``launch`` (entry,
threads), ``setup`` (roles, layouts, process groups, building the workers), ``worker`` (``Worker``, ``@register``), ``dispatch`` (the dispatch/collect
table), ``layout`` (DP x TP arrangements of a role's ranks), ``group`` (``WorkerGroup``),
``driver`` (futures, ordering, heartbeat), ``peer`` (rank 0's link to one worker rank),
``transport`` (wire format), ``serve`` (the worker-side loop), ``ranks`` (ending an
orphaned or frozen rank's process), ``rendezvous`` (the launcher's nodes meeting, said while
they wait) and ``config`` (``ControllerConfig``, role placement).
"""

from minihf.controller.dispatch import (
    DISPATCH_MODES,
    Dispatch,
    DispatchMode,
    Plan,
    get_dispatch_mode,
    register_dispatch_mode,
)
from minihf.controller.driver import CallFuture
from minihf.controller.errors import ControllerAborted, ControllerError, RankLostError, RemoteError
from minihf.controller.group import WorkerGroup
from minihf.controller.launch import launch, launch_job, resolve_backend, run, run_script
from minihf.controller.layout import DEFAULT_LAYOUT, RoleLayout
from minihf.controller.setup import Role
from minihf.controller.worker import (MethodSpec, ParallelInfo, Worker, WorkerContext,
                                      create_worker, register)

__all__ = [
    "CallFuture", "ControllerAborted", "ControllerError", "DEFAULT_LAYOUT", "DISPATCH_MODES",
    "Dispatch", "DispatchMode", "MethodSpec", "ParallelInfo", "Plan", "RankLostError",
    "RemoteError", "Role", "RoleLayout", "Worker", "WorkerContext", "WorkerGroup",
    "create_worker", "get_dispatch_mode", "launch", "launch_job", "register",
    "register_dispatch_mode", "resolve_backend", "run", "run_script",
]
