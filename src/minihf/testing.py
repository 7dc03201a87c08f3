"""Run one function on N local processes that form a torch.distributed group.

Used by the tests (gloo on CPU) and by benchmarks. Every child initialises the process
group itself, runs ``fn(rank, world_size, *args)`` and sends back either its return value
or its traceback. The parent waits with a deadline, so a broken or hung rank fails the
call instead of hanging CI; when one rank fails, the others are killed.

Where the platform has it (Linux), the children fork from multiprocessing's fork server,
which imported torch once when the first call started it: a later call's ranks start in
about 0.1 s instead of the 1.5 s a fresh interpreter takes to import torch (the suite starts
about 160 ranks this way). The server runs no torch ops before it forks. A rank gets the
caller's environment, stdout and stderr as they are at the call, before ``fn``'s module is
imported. What differs from a fresh interpreter: what torch and the interpreter read at
their start (``PYTHONHASHSEED``, ``OMP_*``, ``TORCH_*``) is the server's, and every rank has
the same string-hash seed, so a rank-dependent set order cannot show here.
``MINIHF_SPAWN_METHOD=spawn`` starts each rank as a fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable

from minihf.controller.ranks import free_port  # noqa: F401  (tests and benchmarks import it from here)


class SpawnError(RuntimeError):
    """A spawned rank raised, died, or did not finish before the deadline."""


PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp"]  # what every child imports
METHODS = ("forkserver", "spawn")


def _context():
    method = os.environ.get("MINIHF_SPAWN_METHOD") or "forkserver"
    if method not in METHODS:
        raise ValueError(f"MINIHF_SPAWN_METHOD={method!r}: use one of {', '.join(METHODS)} (spawn: every rank a "
                         "fresh interpreter, as before the fork server)")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read once, when the first call starts the server
    return ctx


class _Callers:
    """The caller's environment, stdout and stderr, sent to a child as its first argument (the
    fds as multiprocessing sends a pipe) and put in place as it is unpickled: before ``fn``'s
    module is imported, a rank has what a spawned one would have had, not what the fork
    server had when it started."""

    def __reduce__(self):
        fds = [fd for fd in (1, 2) if _is_open(fd)]
        return _put_in_place, (dict(os.environ), fds, [reduction.DupFd(fd) for fd in fds])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _put_in_place(env: dict, fds: list[int], dups: list) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in zip(fds, dups):
        received = dup.detach()
        if received != fd:  # a spawned child receives the fd itself, at its number
            os.dup2(received, fd)
            os.close(received)


def _child(callers, fn, rank, world_size, port, backend, threads, pg_timeout_s, args, results):
    del callers  # in place already: unpickled first (see _Callers)
    import torch
    import torch.distributed as dist

    from minihf.utils.process_exit import skip_final_gc

    skip_final_gc()  # the parent joins each child: its exit is part of every call
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may already be gone
                pass


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return per-rank results.

    ``fn`` must be importable by module name (a module-level function). Raises
    :class:`SpawnError` with the failing rank's traceback if any rank raises or dies, or if
    the whole run takes longer than ``timeout_s`` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(_Callers(), fn, r, world_size, port, backend, threads, pg_timeout_s, args, results),
            daemon=False,
        )
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for r, p in enumerate(procs):
            try:
                p.start()
            except Exception as e:  # the fork server could not start (or died): not a rank's failure
                raise SpawnError(f"spawn_ranks: could not start rank {r} ({type(e).__name__}: {e}); "
                                 "MINIHF_SPAWN_METHOD=spawn starts each rank as a fresh interpreter") from e
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SpawnError(
                    f"spawn_ranks: ranks {sorted(set(range(world_size)) - set(out))} did not "
                    f"finish within {timeout_s:.0f}s"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    # Give the queue a moment: a rank may have reported just before exiting.
                    time.sleep(0.5)
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise SpawnError(f"spawn_ranks: rank(s) died without a result: exit codes {codes}")
                continue
            if not ok:
                raise SpawnError(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = payload
    finally:
        procs = [p for p in procs if p.pid is not None]  # started
        for p in procs:
            p.join(timeout=10 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]

