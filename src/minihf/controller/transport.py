"""Messages between the driver (rank 0) and one worker rank, over torch.distributed p2p.

A message is any picklable object; its tensors travel as tensors, never pickled. Packing
pickles the object with pickle's ``persistent_id`` hook replacing every tensor by an index,
so any structure (``Batch``, dicts, dataclasses) works without this module knowing it.
The tensors then go in as few buffers as is cheap: tensors of at least ``BIG_TENSOR_BYTES``
travel as their own buffer (no copy), the smaller ones are packed into one flat buffer per
dtype (one copy, far fewer messages). On the wire, one message is

    uint8[HEADER_BYTES] header: the control record's length n (8 bytes, little endian),
                        then the record itself when it fits (the common case: one message)
    uint8[n] control record, only when it did not fit in the header
    one tensor per buffer spec, in order

The control record is a pickle of (payload bytes, tensor table, buffer specs).

Receiving in place: ``Channel.recv(into)`` first rebuilds the object with a ``TensorStub``
per tensor (``peek``), asks ``into(stubs_object)`` for destination tensors, and receives
every buffer that holds exactly one such tensor straight into its destination (no copy
later); the rest goes into new memory. The DP_COMPUTE collect uses it to receive remote
results into slices of the concatenated output.

Ordering and concurrency: each (driver, worker rank) pair has two ``Channel``s, one per
direction, each on its own two-rank process group. Messages on one channel are matched in
send order (torch.distributed p2p is FIFO per group and peer), so no tags are needed, and
the driver can send on the "down" channel from the calling thread while a per-peer thread
receives on the "up" channel: the two never share a communicator (NCCL forbids concurrent
use of one communicator from two threads). With NCCL the groups are "cpu:gloo,cuda:nccl":
header, control record and CPU tensors go over gloo, CUDA tensors over NCCL.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from minihf.controller.messages import TensorStub

BIG_TENSOR_BYTES = 1 << 20
HEADER_BYTES = 4096


@dataclass
class Packed:
    """A packed message: the control record and the tensors to send after it."""
    control: torch.Tensor  # uint8, CPU
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.control.numel() + sum(b.numel() * b.element_size() for b in self.buffers)


class DecodeError(RuntimeError):
    """A message arrived whole but could not be unpickled (the channel is still in sync)."""


class _TensorPickler(pickle.Pickler):
    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"cannot send a {obj.layout} tensor; convert it to dense "
                                "(tensor.to_dense()) first")
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any):
        return self.tensors[pid]


def pack(obj: Any, cuda: torch.device | None) -> Packed:
    """Pickle ``obj`` without its tensors and put the tensors into buffers.

    With a ``cuda`` device (NCCL available), CUDA tensors travel as CUDA buffers and CPU
    tensors as CPU buffers (over gloo); without one, everything travels on the CPU. Either
    way a tensor arrives on the same kind of device it was sent from, like a local call.
    """
    tensors: list[torch.Tensor] = []
    payload = io.BytesIO()
    _TensorPickler(payload, tensors).dump(obj)
    table: list[tuple] = []  # per tensor: buffer index, offset, shape, dtype, on cuda
    buffers: list[torch.Tensor] = []
    small: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        on_cuda = t.is_cuda and cuda is not None
        table.append((-1, 0, tuple(t.shape), t.dtype, on_cuda))
        if t.numel() == 0:
            continue
        if t.numel() * t.element_size() >= BIG_TENSOR_BYTES:
            table[i] = (len(buffers), 0, tuple(t.shape), t.dtype, on_cuda)
            buffers.append(t.detach().to(cuda if on_cuda else "cpu").contiguous().view(-1))
        else:
            small.setdefault((t.dtype, on_cuda), []).append(i)
    for (dtype, on_cuda), idx in small.items():
        offset = 0
        for i in idx:
            table[i] = (len(buffers), offset, tuple(tensors[i].shape), dtype, on_cuda)
            offset += tensors[i].numel()
        flat = [tensors[i].detach().reshape(-1).to(cuda if on_cuda else "cpu") for i in idx]
        buffers.append(torch.cat(flat) if len(flat) > 1 else flat[0].contiguous())
    specs = [(b.dtype, b.numel(), b.is_cuda) for b in buffers]
    control = pickle.dumps((payload.getvalue(), table, specs), protocol=pickle.HIGHEST_PROTOCOL)
    return Packed(torch.frombuffer(bytearray(control), dtype=torch.uint8), buffers)


def unpack_control(control: torch.Tensor) -> tuple[bytes, list, list]:
    """(payload, tensor table, buffer specs) from a received control record."""
    return pickle.loads(control.numpy().tobytes())


def empty_buffers(specs: list, cuda: torch.device | None) -> list[torch.Tensor]:
    """Receive buffers for ``specs``: CUDA ones on this rank's ``cuda`` device."""
    return [torch.empty(numel, dtype=dtype, device=cuda if on_cuda else "cpu")
            for dtype, numel, on_cuda in specs]


def unpack(payload: bytes, table: list, buffers: list[torch.Tensor],
           cuda: torch.device | None) -> Any:
    """Rebuild the object from its payload and received buffers (tensors are views)."""
    tensors = []
    for buf_idx, offset, shape, dtype, on_cuda in table:
        if buf_idx < 0:
            tensors.append(torch.empty(shape, dtype=dtype, device=cuda if on_cuda else "cpu"))
            continue
        numel = 1
        for s in shape:
            numel *= s
        tensors.append(buffers[buf_idx][offset:offset + numel].view(shape))
    return _TensorUnpickler(io.BytesIO(payload), tensors).load()


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, file, table: list, cuda: torch.device | None):
        super().__init__(file)
        self.table, self.cuda = table, cuda

    def persistent_load(self, pid: Any):
        _, _, shape, dtype, on_cuda = self.table[pid]
        device = self.cuda if on_cuda else torch.device("cpu")
        return TensorStub(pid, tuple(shape), dtype, device)


def peek(payload: bytes, table: list, cuda: torch.device | None) -> Any:
    """The object with a ``TensorStub`` in place of each tensor (before any buffer arrives)."""
    return _StubUnpickler(io.BytesIO(payload), table, cuda).load()


Into = Callable[[Any], "dict[int, torch.Tensor]"]


def receive_buffers(payload: bytes, table: list, specs: list, cuda: torch.device | None,
                    into: Into | None = None) -> list[torch.Tensor]:
    """Buffers to receive ``specs`` into: ``into``'s destinations where a buffer holds exactly
    that one tensor (same dtype, device and size, contiguous), new memory otherwise."""
    buffers: list[torch.Tensor | None] = [None] * len(specs)
    if into is not None:
        try:
            dest = into(peek(payload, table, cuda))
        except Exception:  # noqa: BLE001 - no destinations: the plain path still works
            dest = {}
        for i, t in dest.items():
            buf_idx, offset, shape, dtype, on_cuda = table[i]
            if buf_idx < 0 or offset or buffers[buf_idx] is not None:
                continue
            b_dtype, b_numel, _ = specs[buf_idx]
            device = cuda if on_cuda else torch.device("cpu")
            if (t.dtype == b_dtype == dtype and t.numel() == b_numel and t.device == device
                    and tuple(t.shape) == tuple(shape) and t.is_contiguous()):
                buffers[buf_idx] = t.view(-1)
    fresh = iter(empty_buffers([s for s, b in zip(specs, buffers) if b is None], cuda))
    return [b if b is not None else next(fresh) for b in buffers]


def roundtrip(obj: Any, cuda: torch.device | None = None) -> Any:
    """pack + unpack in one process (what a peer would rebuild); used by tests."""
    packed = pack(obj, cuda)
    payload, table, specs = unpack_control(packed.control)
    buffers = empty_buffers(specs, cuda)
    for b, src in zip(buffers, packed.buffers):
        b.copy_(src)
    return unpack(payload, table, buffers, cuda)


class Channel:
    """One direction of the link between this rank and ``peer`` on a two-rank ``group``."""

    def __init__(self, group: Any, peer: int, cuda: torch.device | None, timeout_s: float):
        self.group, self.peer, self.cuda = group, peer, cuda  # cuda: None without NCCL
        self.timeout = timedelta(seconds=timeout_s)

    def isend(self, packed: Packed) -> list:
        """Start sending; returns the works (keep ``packed`` alive until they complete)."""
        n = packed.control.numel()
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
        inline = n <= HEADER_BYTES - 8
        if inline:
            header[8:8 + n] = packed.control
        works = [dist.isend(header, self.peer, group=self.group)]
        if not inline:
            works.append(dist.isend(packed.control, self.peer, group=self.group))
        works += [dist.isend(b, self.peer, group=self.group) for b in packed.buffers]
        works.append(header)  # keeps the header tensor alive with the works
        return works

    def wait(self, works: list, timeout: timedelta | None = None) -> None:
        for w in works:
            if not isinstance(w, torch.Tensor):
                w.wait(timeout or self.timeout)

    def send(self, obj: Any) -> None:
        packed = pack(obj, self.cuda)
        self.wait(self.isend(packed))

    def _recv_into(self, tensor: torch.Tensor) -> None:
        dist.irecv(tensor, self.peer, group=self.group).wait(self.timeout)

    def recv(self, into: Into | None = None, timeout_s: float | None = None) -> Any:
        """The next message; ``into`` may name destination tensors (see the docstring).

        ``timeout_s``: how long to wait for the message to start (default: the channel's
        timeout, which also bounds the rest of the message)."""
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        wait = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        dist.irecv(header, self.peer, group=self.group).wait(wait)
        n = int.from_bytes(header[:8].numpy().tobytes(), "little")
        if n <= HEADER_BYTES - 8:
            control = header[8:8 + n]
        else:
            control = torch.empty(n, dtype=torch.uint8)
            self._recv_into(control)
        payload, table, specs = unpack_control(control)
        buffers = receive_buffers(payload, table, specs, self.cuda, into)
        works = [dist.irecv(b, self.peer, group=self.group) for b in buffers]
        for w in works:
            w.wait(self.timeout)
        try:  # the message was read whole: the channel stays usable if this fails
            return unpack(payload, table, buffers, self.cuda)
        except Exception as e:  # noqa: BLE001 - e.g. a class that does not exist here
            raise DecodeError(f"could not unpickle a message from rank {self.peer}: "
                              f"{type(e).__name__}: {e} (classes in messages must be "
                              "importable on every rank)") from e
