"""The driver side of the controller (rank 0): sends commands, matches replies to futures.

Concurrency model. Every call is dispatched under one lock, so all ranks see commands in
one global order (two roles sharing ranks can never receive two calls in opposite orders,
which could deadlock their collectives). Sends are non-blocking (``isend``): dispatching
never waits for a busy worker. Each worker rank has a ``Peer`` (``peer``) with a FIFO of the calls
it has not answered yet and a receiver thread that, while that FIFO is non-empty, receives
the next ``Reply`` on the rank's "up" channel and resolves the oldest future; worker ranks
execute in order, so replies arrive in FIFO order and need no ids. Calls to different
ranks are therefore in flight at the same time. Rank 0's own workers run on one local
executor thread, in order, like a worker rank's serve loop.

Failure: a receive that fails (peer closed its connection: a killed rank is seen at once)
or exceeds ``timeout_s`` marks the peer lost; its pending and later calls raise
``RankLostError``. Like torch's collective timeout, ``timeout_s`` bounds every single wait,
so it must exceed the longest single call. Idle workers are not bounded by it: a heartbeat
thread sends a ``Ping`` every ``timeout_s / 4`` to each worker rank with no call in flight
(under the dispatch lock, so pings never reorder commands), and a worker waits for its next
message at most ``timeout_s``; ``idle_timeout_s`` optionally bounds the wait for a command.

Traffic: a method registered with ``reads`` receives only those columns of its ``Batch``
arguments; ``sent_bytes`` counts the bytes of the commands sent to each role's method.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, Callable

import torch

from minihf.controller.dispatch import RoleLayout, get_dispatch_mode
from minihf.controller.errors import ControllerError, RankLostError, RemoteError
from minihf.controller.messages import Abort, Command, Ping, Reply, Stop
from minihf.controller.peer import Peer
from minihf.controller.serve import execute
from minihf.controller.transport import Channel, Packed, pack
from minihf.controller.worker import MethodSpec, Worker
from minihf.protocol import Batch


def _reply_into(receive_into: Callable, k: int, reply: Any) -> dict:
    """Destinations for a reply's tensors (``reply`` holds ``TensorStub``s); k: collect index."""
    if not isinstance(reply, Reply) or reply.error is not None:
        return {}
    return receive_into(k, reply.value)


def _only(value: Any, keys: tuple[str, ...]) -> Any:
    """A ``Batch`` argument cut to the columns ``keys`` names (the ones it holds), its meta
    kept; anything else as it is."""
    if not isinstance(value, Batch):
        return value
    return Batch({k: v for k, v in value.tensors.items() if k in keys},
                 {k: v for k, v in value.non_tensors.items() if k in keys}, value.meta)


CAUSE_GRACE_S = 10.0  # how long a collective's timeout waits for the failure that caused it
FALLOUT = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
           "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def _rank(error: BaseException) -> int:
    """Which of several failures of one call to report: 0 a rank's own error, 1 a lost rank,
    2 a collective that failed because its peer was gone (the fallout of the others)."""
    if isinstance(error, RankLostError):
        return 1
    text = getattr(error, "traceback", "") or str(error)
    return 2 if any(marker in text for marker in FALLOUT) else 0


class CallFuture:
    """The result of one driver call: wait for every rank's part, then collect once."""

    def __init__(self, layout: RoleLayout, spec: MethodSpec, collect_from: list[int],
                 ctx: Any, parts: dict[int, Future]):
        self.layout, self.spec, self._collect_from, self._ctx = layout, spec, collect_from, ctx
        self._parts = parts
        self._finished = False
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """True once ``result`` has been called and has collected (or raised)."""
        return self._finished

    def done(self) -> bool:
        return all(f.done() for f in self._parts.values())

    def failed_unseen(self) -> bool | None:
        """True: an error nobody has seen yet; False: nothing to report; None: running."""
        if self._finished:
            return False
        if not self.done():
            return None
        return any(f.exception() is not None for f in self._parts.values())

    def result(self, timeout: float | None = None) -> Any:
        """Every rank's part, collected; the first failure as soon as one part fails (the
        others may be waiting in a collective for the failed rank, and would only end with
        a timeout of their own, a consequence that would hide the cause)."""
        if not self._finished:
            done, pending = wait(list(self._parts.values()), timeout, return_when=FIRST_EXCEPTION)
            errors = [f.exception() for f in done if f.exception() is not None]
            if errors and pending and all(_rank(e) == 2 for e in errors):
                # a collective that timed out waits for a rank that is about to be declared
                # lost (or to report its own error): give the cause a moment to arrive
                more, pending = wait(pending, CAUSE_GRACE_S, return_when=FIRST_EXCEPTION)
                errors += [f.exception() for f in more if f.exception() is not None]
            if not errors and pending:
                raise TimeoutError(f"{self.layout.role}.{self.spec.name}: no reply within {timeout}s")
            values = {i: f.result() for i, f in self._parts.items() if not errors}
            if errors:  # the cause first: a rank's own error, a lost rank, then collective fallout
                errors.sort(key=_rank)
                if not isinstance(errors[0], RemoteError):
                    raise errors[0]
                self._error = errors[0]
            else:
                collect = self.spec.collect_fn()
                self._value = collect(self.layout, [values[i] for i in self._collect_from],
                                      self._ctx)
            self._finished = True
            self._parts = {}  # the parts' values are not needed any more
        if self._error is not None:
            raise self._error
        return self._value


class Driver:
    """Rank 0's runtime: peers for the other ranks, a local executor for its own workers.

    ``local``: a one-thread executor owned by this run (see ``launch``); the driver shuts it
    down when it stops or aborts."""

    def __init__(self, rank: int, links: dict[int, tuple[Channel, Channel]],
                 local_workers: dict[str, Worker], cuda: torch.device | None, timeout_s: float,
                 local: ThreadPoolExecutor):
        self.rank, self.cuda, self.timeout_s = rank, cuda, timeout_s  # cuda: None without NCCL
        self._peers = {r: Peer(r, down, up, timeout_s) for r, (down, up) in links.items()}
        self._local_workers = local_workers
        self._local = local
        self._lock = threading.Lock()
        self._closed = False
        self._unawaited: list[CallFuture] = []  # checked at the end: no error goes unseen
        self.sent_bytes: dict[str, int] = {}  # "role.method" -> bytes of commands sent to other ranks
        self._ping = pack(Ping(), None)
        self._stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name="minihf-heartbeat")
        if self._peers:
            self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        """Ping idle worker ranks every ``timeout_s / 4`` so they know the driver is alive."""
        interval = self.timeout_s / 4
        while not self._stopping.wait(interval):
            with self._lock:
                if self._closed:
                    return
                sent = [(p, p.ping(self._ping)) for p in self._peers.values()]
            for peer, works in sent:  # an idle worker takes a ping at once
                if works:
                    try:
                        peer.down.wait(works, timedelta(seconds=interval))
                    except Exception:  # noqa: BLE001 - its next call finds the peer lost
                        peer.late_pings.append(works)  # gloo may still read the buffers

    def _run_local(self, cmd: Command, place: Callable[[Any], Any] | None = None) -> Any:
        reply = execute(self._local_workers, cmd, self.rank)
        if reply.error is not None:
            raise reply.error
        return reply.value if place is None else place(reply.value)

    def call(self, layout: RoleLayout, spec: MethodSpec, args: tuple, kwargs: dict,
             track: bool = True) -> CallFuture:
        """Dispatch ``spec`` on ``layout``'s ranks; returns at once with a ``CallFuture``.

        ``track``: remember the future until it is awaited, so that an error in a call
        whose result nobody asks for still ends the job (blocking calls do not need it).
        """
        if self._closed:
            raise ControllerError(f"{layout.role}.{spec.name}: the controller is stopped")
        if spec.reads is not None:
            args = tuple(_only(a, spec.reads) for a in args)
            kwargs = {k: _only(v, spec.reads) for k, v in kwargs.items()}
        try:
            plan = get_dispatch_mode(spec.dispatch).dispatch_fn(layout, args, kwargs)
        except ControllerError as e:  # name the method: the mode only knows the role
            raise ControllerError(f"{layout.role}.{spec.name}: {e}") from None
        if len(plan.calls) != layout.size:
            raise ControllerError(f"dispatch mode {spec.dispatch!r} planned {len(plan.calls)} "
                                  f"calls for role {layout.role!r} of {layout.size} ranks")
        missing = [i for i in plan.collect_from if plan.calls[i] is None]
        if missing:
            raise ControllerError(f"dispatch mode {spec.dispatch!r} collects from role ranks "
                                  f"{missing} that it does not call")
        collect_from = spec.replies(plan.collect_from)  # the collect mode picks who replies
        replying = set(collect_from)
        # the mode's own collect may receive replies in place; a user's collect gets plain ones
        own_collect = spec.collect is None
        receive_into = plan.receive_into if own_collect else None
        place_local = plan.place_local if own_collect else None
        parts: dict[int, Future] = {}
        memo: dict[tuple[int, bool], Packed] = {}  # one pack per distinct call object
        with self._lock:
            for i, call in enumerate(plan.calls):
                if call is None:
                    continue
                cmd = Command(layout.role, spec.name, call[0], call[1], i in replying)
                rank = layout.ranks[i]
                if rank == self.rank:
                    place = None
                    if place_local is not None and cmd.reply:
                        place = functools.partial(place_local, collect_from.index(i))
                    parts[i] = self._local.submit(self._run_local, cmd, place)
                    continue
                key = (id(call), cmd.reply)
                if key not in memo:
                    memo[key] = pack(cmd, self.cuda)
                name = f"{layout.role}.{spec.name}"
                self.sent_bytes[name] = self.sent_bytes.get(name, 0) + memo[key].nbytes
                into = None
                if receive_into is not None and cmd.reply:
                    into = functools.partial(_reply_into, receive_into,
                                             collect_from.index(i))
                parts[i] = self._peers[rank].send(memo[key], layout.role, spec.name, into)
            fut = CallFuture(layout, spec, collect_from, plan.ctx, parts)
            # keep only calls still running or holding an unseen error (never their values);
            # under the lock: the driver may call from two threads (trainer.staleness)
            self._unawaited = [f for f in self._unawaited if f.failed_unseen() is not False]
            if track:
                self._unawaited.append(fut)
        return fut

    def raise_unawaited_errors(self) -> None:
        """Wait for calls whose result nobody asked for; raise the first error among them."""
        for fut in self._unawaited:
            if not fut.finished:  # a finished one was seen by the driver already
                fut.result()  # raises its error, if any
        self._unawaited.clear()

    def stop(self) -> None:
        """Send STOP to every worker rank, wait for their acknowledgements, end threads.

        A rank already lost raises first, so that ``abort`` still reaches every other rank
        (a job that lost a rank must end non-zero everywhere, not STOP cleanly)."""
        with self._lock:
            lost = [p for p in self._peers.values() if p.lost]
            if lost:
                raise lost[0]._lost_error("<controller>", "stop")
            self._closed = True
            stop = pack(Stop(), self.cuda)
            acks = [(p, p.send(stop, "<controller>", "stop")) for p in self._peers.values()]
        self._stopping.set()
        if self._heartbeat.is_alive():  # no thread may sit in a send when the groups go
            self._heartbeat.join(timeout=self.timeout_s)
        self._local.shutdown(wait=True)
        for peer, fut in acks:
            fut.result(timeout=self.timeout_s)
            peer.stopped = True
        for peer in self._peers.values():
            peer.close()

    def abort(self, reason: str, wait_s: float = 5.0) -> None:
        """Best effort: tell every reachable worker rank to exit with an error."""
        self._closed = True
        self._stopping.set()
        self._local.shutdown(wait=False, cancel_futures=True)
        msg = pack(Abort(reason), self.cuda)
        sends = []
        for peer in self._peers.values():
            if not (peer.lost or peer.stopped):
                try:
                    sends.append((peer, peer.down.isend(msg)))
                except Exception:  # noqa: BLE001 - that peer is gone already
                    pass
        for peer, works in sends:
            try:  # a busy worker reads it when its current method returns
                peer.down.wait(works, timedelta(seconds=wait_s))
            except Exception:  # noqa: BLE001
                pass


def run_driver(driver: Driver, body: Callable[[], Any]) -> Any:
    """Run ``body``; then STOP everyone, or on any exception abort everyone and re-raise."""
    try:
        result = body()
        driver.raise_unawaited_errors()
        driver.stop()  # raises if a rank was lost: the others must be aborted then
    except BaseException as e:
        driver.abort(f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    return result
