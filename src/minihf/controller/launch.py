"""Starting a controller job: process groups, workers on every rank, driver or serve loop.

``launch`` is the entry helper for scripts run with ``python`` or ``torchrun``
(``launch_job`` for a job of several runs, e.g. SFT then RL); it is the only place in
minihf that reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``;
``MASTER_ADDR``/``MASTER_PORT`` via ``env://``). Without them it starts a one-process job. It exits the process non-zero on any error, on every rank, so a failure
never leaves a job hanging; a user error (bad value, missing file) is printed as one line
and where it was raised, anything else with its full traceback (``failure_report``).
``run`` is the same job on an already initialised default process group (used by
``launch`` and by multi-process tests); it raises instead of exiting. A placement that
leaves ranks without a role is run, with one warning line from rank 0 naming them.

The roles, their layouts, the process groups and the workers are set up by
``minihf.controller.setup``. With CUDA the backend is "cpu:gloo,cuda:nccl": pickled control
records go over gloo, tensors over NCCL.

Threads: on every rank, workers are built and their methods run on one thread owned by the
run (rank 0's local executor, the serve loop elsewhere), never on the caller's long-lived
thread. torch keeps per-thread caches keyed by objects that compare equal across runs:
DTensor's sharding cache hands back output specs holding the ``DeviceMesh`` current when an
entry was made, and meshes over the same ranks built on the same thread are equal even
when their process groups differ. A second ``run`` in the same processes would otherwise
send FSDP's collectives over the previous run's destroyed groups (a hang, or "could not
resolve the process group"). A fresh thread per run starts every rank with empty caches.
On a machine without a GPU, torch 2.11's CUDA wheels (the PyPI default) segfault when a
run's thread enters FakeTensorMode (DTensor's sharding propagation does, inside FSDP) after
an earlier run's thread that did has exited; ``run`` first sets the no-op CUDA device guard
that FakeTensorMode installs on first use from the calling thread (``_cuda_guard_off_gpu``).

One OpenMP team: each thread that opens an OpenMP parallel region gets its own team of
helper threads, and once a process has more of them than CPUs, libgomp (torch's OpenMP on
Linux) cuts their spinning to ~100 iterations, so every parallel region wakes sleeping
threads. The worker thread computes; the caller's thread (rank 0's driver) had usually
opened a region of its own before the run. So ``run`` gives the worker thread the caller's
thread count and sets the caller's to 1 until the run ends (torch's default for a thread
started meanwhile is then 1 too; the caller's count comes back after). Measured
(SmolLM2-135M, batch 16, 2 threads, 2-core AMD EPYC): a decode step 84-98 ms on the main
thread, 133-148 ms on a pool thread after the main thread had run one parallel region; in
``bench_step.py --model``'s job 147 -> 104 ms, and the step's ``ref`` 1.64 -> 1.37 s.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from minihf.controller.config import ControllerConfig, idle_warning, resolve_placement
from minihf.controller.layout import DEFAULT_LAYOUT
from minihf.controller.ranks import kill_lost_rank, rank_processes
from minihf.controller.driver import Driver, run_driver
from minihf.controller.errors import ControllerAborted, ControllerError, RemoteError
from minihf.controller.group import WorkerGroup
from minihf.controller.serve import serve
from minihf.controller.setup import Role, build_workers, make_groups, role_layouts, role_links
from minihf.controller.worker import Worker
from minihf.utils.host_memory import tune_malloc
from minihf.utils.process_exit import die_with_launcher, restore_ctrl_c, skip_final_gc
from minihf.utils.locks import release_all


DriverFn = Callable[[dict[str, WorkerGroup]], Any]


def resolve_backend(backend: str, cuda_available: bool) -> str:
    """The process-group backend string for ``ControllerConfig.backend``."""
    if backend == "auto":
        backend = "nccl" if cuda_available else "gloo"
    if backend == "nccl":
        if not cuda_available:
            raise ControllerError("controller backend 'nccl' needs CUDA, and torch sees no GPU; "
                                  "use backend 'gloo' or 'auto'")
        return "cpu:gloo,cuda:nccl"
    if backend != "gloo":
        raise ControllerError(f"unknown controller backend {backend!r}; use auto, gloo or nccl")
    return "gloo"


def _cuda_guard_off_gpu() -> None:
    """On a CUDA build of torch without a usable GPU, install the no-op CUDA device guard from
    this (long-lived) thread. FakeTensorMode does it on first use, from whichever thread;
    torch 2.11 then segfaulted in the next thread that entered it once the first had ended
    (the second run of an SFT-then-RL job); torch 2.13 does not. A no-op elsewhere."""
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


def run(driver_fn: DriverFn, roles: Mapping[str, Role | type[Worker]],
        config: ControllerConfig | None = None, *, device: torch.device | None = None) -> Any:
    """Run a controller job on the initialised default group; the driver's result on rank 0.

    ``driver_fn(groups)`` runs on rank 0 with a ``WorkerGroup`` per role; other ranks serve
    until it returns (then STOP) or raises (then every rank raises: the driver's error on
    rank 0, ``ControllerAborted`` elsewhere). Returns ``None`` on ranks other than 0.
    """
    if not dist.is_initialized():
        raise ControllerError("minihf.controller.run needs an initialised default process "
                              "group; scripts should call minihf.controller.launch instead")
    config = config or ControllerConfig()
    rank, world = dist.get_rank(), dist.get_world_size()
    roles = {name: r if isinstance(r, Role) else Role(r) for name, r in roles.items()}
    placed = resolve_placement(config.placement, world, roles=list(roles))
    warning = idle_warning(placed, world) if rank == 0 else None
    if warning:
        print(warning, file=sys.stderr, flush=True)
    layouts = role_layouts(roles, placed)
    on_cuda = "nccl" in str(dist.get_backend())
    cuda = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
    device = device or cuda or torch.device("cpu")

    contexts, links, created = make_groups(rank, world, layouts, cuda, device,
                                            config.timeout_s, role_links(roles))
    _cuda_guard_off_gpu()
    # this run's worker thread (see the module docstring); the current device and the
    # OpenMP thread count are per thread
    threads = torch.get_num_threads()

    def init_worker_thread() -> None:
        torch.set_num_threads(threads)
        # torch's per-thread first-use init, done now: it copies the last value set anywhere
        torch.get_num_threads()
        if cuda is not None:
            torch.cuda.set_device(cuda)
    pool = ThreadPoolExecutor(1, thread_name_prefix="minihf-worker", initializer=init_worker_thread)
    try:
        workers = pool.submit(build_workers, roles, contexts).result()
        torch.set_num_threads(1)  # the caller's thread: see "one OpenMP team" above
        if rank == 0:
            driver = Driver(rank, links, workers, cuda, config.timeout_s, pool)
            groups = {n: WorkerGroup(layouts[n][DEFAULT_LAYOUT], roles[n].worker_cls, driver, layouts[n],
                                     roles[n].worker_cls.declare_reads(*roles[n].args, **roles[n].kwargs))
                      for n in sorted(layouts)}
            result = run_driver(driver, lambda: driver_fn(groups))
        else:
            serve(*links[0], workers, rank, config.idle_timeout_s, pool)
            result = None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        torch.set_num_threads(threads)
    for g in created:  # only after a clean STOP: on errors peers may be gone
        dist.destroy_process_group(g)
    return result


ABORTED_GRACE_S = 10.0  # how long an aborted worker rank leaves rank 0 to report and exit first
USER_ERRORS = (ValueError, OSError)  # bad config (ConfigError), data rows, missing files


def failure_report(e: BaseException) -> str:
    """What ``launch`` prints for the error that ended this rank.

    A user error (``USER_ERRORS``) gets ``Type: message`` and where it was raised: its
    message names the bad value and the fix, a stack would bury that. Anything else (a bug,
    a ``RemoteError`` carrying the worker's traceback) gets the full traceback; Ctrl-C
    (``KeyboardInterrupt``) one line on how to resume.
    """
    if isinstance(e, ControllerAborted):
        return str(e)
    if isinstance(e, RemoteError) and e.summary:  # a user error on a worker rank: its line
        return f"job failed: {e.role}.{e.method} failed on rank {e.rank}: {e.summary}"
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C reaches every rank: no traceback to read
        return ("interrupted (SIGINT); rerun the same command to resume from the run's latest "
                "checkpoint (trainer.save_freq)")
    if isinstance(e, USER_ERRORS) and e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return (f"job failed: {type(e).__name__}: {e}\n  raised at {frame.filename}:"
                f"{frame.lineno} (in {frame.name})")
    return "job failed:\n" + "".join(traceback.format_exception(e))


def _init_from_env(config: ControllerConfig) -> tuple[int, torch.device]:
    """Initialise the default process group from torchrun's env (or a one-process group)."""
    cuda = torch.cuda.is_available()
    backend = resolve_backend(config.backend, cuda)
    timeout = timedelta(seconds=config.timeout_s)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
    else:
        rank, local_rank = 0, 0
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return rank, torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def join_launcher_group(timeout_s: float = 1800.0) -> bool:
    """For a command that also runs alone (``minihf eval``): under torchrun, initialise the
    default process group from its env (gloo; this rank's GPU pinned) and return True;
    alone, do nothing and return False."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    config = ControllerConfig(backend="gloo", timeout_s=timeout_s)
    set_threads(config)  # each rank's share of the host's cores, as a job's ranks get
    _init_from_env(config)
    return True


# how long a rank != 0 leaves rank 0 to report a shared start-up error: 3 s was too short
# on a loaded 2-core machine, where the ranks' imports finished seconds apart (CI saw
# both ranks report); only an error of one rank alone waits this long to be reported
PEER_REPORT_WAIT_S = 10.0


def run_script(main: Callable[[list[str]], Any], argv: list[str]) -> None:
    """Entry of ``scripts/*.py``: ``main(argv)``; an error raised before the job starts (a
    bad config key, a missing file) is reported like a job failure (``failure_report``: one
    line for user errors) and the process exits 1.

    Under torchrun every rank usually hits the same error, and rank 0 reports it. The other
    ranks wait ``PEER_REPORT_WAIT_S`` before exiting: a rank that exited first would have
    torchrun SIGTERM rank 0 before it printed (seen as a flaky one-line-error test). When
    rank 0 exits, torchrun ends the waiting ranks. A rank still alive after the wait hit an
    error of its own (a file missing on its node only), and reports it, naming itself.

    ``-h``/``--help`` prints the script's docstring and where every key is explained, and
    exits 0 (rank 0 prints under torchrun); it starts nothing."""
    restore_ctrl_c()  # the script's imports are done: Ctrl-C is the job's to report from here
    if any(a in ("-h", "--help") for a in argv):
        if int(os.environ.get("RANK", "0")) == 0:
            doc = (sys.modules[main.__module__].__doc__ or "").strip()
            print(f"{doc}\n\nEvery key with its default and help: docs/config.md. A recipe's "
                  "resolved values: `minihf config show RECIPE [overrides]` (add `--kind sft` "
                  "or `--kind rm` for those trainers' recipes).")
        return
    try:
        main(argv)
    except Exception as e:  # noqa: BLE001 - the job itself exits through launch_job
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0:
            time.sleep(PEER_REPORT_WAIT_S)
        who = "" if rank == 0 else f"rank {rank}: "
        print(f"[minihf] {who}{failure_report(e)}", file=sys.stderr)
        sys.exit(1)


def set_threads(config: ControllerConfig, local_ranks: int | None = None, interop: bool = True) -> None:
    """This rank's CPU threads from ``config.threads`` (``minihf.utils.threads``), before the
    job builds anything; each host's local rank 0 prints the figure, or the warning of an
    oversubscribed host (naming the host when the job spans several)."""
    from minihf.utils.threads import apply

    plan = apply(config.threads, local_ranks, interop=interop)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        env = os.environ
        many = env.get("WORLD_SIZE", "1") != env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))
        line = plan.line.replace("this host", f"host {socket.gethostname()}") if many else plan.line
        print(line, file=sys.stderr, flush=True)


def launch_job(job: Callable[[torch.device], Any], config: ControllerConfig | None = None,
               *, in_process: bool = False) -> Any:
    """Like ``launch``, for a job of several controller runs: ``job(device)`` runs on every
    rank inside the initialised default group and calls ``run`` as often as it needs (e.g.
    an SFT warm start, then RL). Returns its result on rank 0, ``None`` elsewhere; any error
    on any rank prints the error and exits the process with status 1 (rank 0 first stops a
    lost rank still running on its host, see ``kill_lost_rank``).

    ``in_process``: the Python entry points (``minihf.train``): one rank in the calling
    process, which the job leaves as it found it: an error is raised, not an exit, and
    nothing process-wide is installed (no parent-death signal, no ``gc.freeze`` at exit, no
    malloc settings)."""
    config = config or ControllerConfig()
    if in_process:
        return _job_in_process(job, config)
    die_with_launcher()  # again: a job not started by one of the scripts
    skip_final_gc()  # a torchrun job ends when its slowest rank has exited
    set_threads(config)
    rank, device = _init_from_env(config)
    if device.type == "cpu":
        tune_malloc()  # large blocks from the heap, kept mapped when freed (minihf.utils.host_memory)
    processes = rank_processes()
    try:
        result = job(device)
    except BaseException as e:  # noqa: BLE001 - every failure ends this rank non-zero
        print(f"[minihf rank {rank}] {failure_report(e)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == 0:
            kill_lost_rank(e, processes)
        elif isinstance(e, ControllerAborted):
            # rank 0 prints the failing rank's traceback just after it aborts the others: a rank
            # that exited first would have torchrun stop rank 0 before it could (a race CI lost)
            time.sleep(ABORTED_GRACE_S)  # ends sooner: torchrun stops this rank once rank 0 exits
        release_all()  # this job's run-dir locks: the next run starts without a takeover message
        # not sys.exit: threads blocked in a receive must not delay the exit; 130 = SIGINT's
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)
    dist.destroy_process_group()
    return result if rank == 0 else None


def _job_in_process(job: Callable[[torch.device], Any], config: ControllerConfig) -> Any:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise RuntimeError("the Python entry points run the job in this one process; under torchrun, "
                           "run scripts/train_ppo.py (train_sft.py, train_rm.py) instead")
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed process group; the Python "
                           "entry points need a process without one (destroy it first)")
    before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    set_threads(config, local_ranks=1, interop=False)  # restored below; the inter-op pool cannot be
    try:
        _, device = _init_from_env(config)
        try:
            return job(device)
        finally:
            release_all()
            dist.destroy_process_group()
    finally:  # the caller's process as it was
        torch.set_num_threads(before[0])
        if before[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before[1]


def launch(driver_fn: DriverFn, roles: Mapping[str, Role | type[Worker]],
           config: ControllerConfig | None = None) -> Any:
    """Entry helper for scripts: init the process group from torchrun's env, ``run``, exit.

    Works with ``python script.py`` (one process) and ``torchrun --nproc_per_node=N``.
    Returns the driver's result on rank 0 and ``None`` elsewhere; on any error it prints
    the error and exits the process with status 1, on every rank.
    """
    config = config or ControllerConfig()
    return launch_job(lambda device: run(driver_fn, roles, config, device=device), config)
