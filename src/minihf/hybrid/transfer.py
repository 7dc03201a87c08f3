"""Weight sync across two rank sets: the actor's FSDP shards -> a standalone rollout's TP shards.

With ``controller.placement.rollout`` the rollout engine runs on ranks of its own
(``minihf.workers.RolloutWorker``, docs/async.md). Each sync, every rollout rank receives
exactly its TP slice of every weight, once, straight from the training ranks that hold
its rows: a *piece* is the intersection of training rank t's FSDP shard (rows
``[t*chunk, (t+1)*chunk)`` along the FSDP dim) with rollout rank r's TP slice (rows
``[j*s, (j+1)*s)`` along the TP dim for TP rank j, or the whole tensor when TP replicates
it), a box in the parameter's coordinates. The pieces from t to r travel as one flat
message per bucket (point-to-point, in the rollout dtype), in an order both sides derive
from the plan alone. A rollout rank therefore receives its slice bytes and nothing more
(``received_bytes``); a training rank sends each replica its share of its shard.

``plan_transfer`` is pure (names, shapes, rank lists; no torch), so it is unit-tested
alone; ``send_weights`` / ``receive_weights`` execute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minihf.hybrid.plan import plan_tensor
from minihf.parallel.placement import chunk_rows, fsdp_dim


@dataclass(frozen=True)
class Piece:
    """One box of one parameter, from a training rank's shard into an engine parameter."""
    name: str                                # the FSDP (training) parameter
    target: str                              # the engine parameter it fills
    box: tuple[tuple[int, int], ...]         # global (start, stop) per dim
    src_origin: tuple[int, ...]              # global coords of the sender shard's [0, 0, ...]
    dst_origin: tuple[int, ...]              # global coords of the engine slice's [0, 0, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Message:
    """The pieces training rank ``src`` sends rollout rank ``dst`` in one bucket."""
    src: int
    dst: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def _box(shape, dim: int | None, start: int, stop: int) -> tuple[tuple[int, int], ...]:
    return tuple((start, stop) if d == dim else (0, s) for d, s in enumerate(shape))


def _intersect(a, b) -> tuple[tuple[int, int], ...] | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def plan_transfer(shapes: dict[str, tuple[int, ...]], train_ranks: list[int],
                  rollout_tp_ranks: dict[int, int], tp: int, *, tied_lm_head: bool = False,
                  itemsize: int = 4, bucket_bytes: int = 32 << 20) -> list[list[Message]]:
    """Rounds of messages covering every rollout rank's slice of every parameter.

    ``shapes``: FSDP names -> full shapes, in order; ``train_ranks``: the actor's global
    ranks in role order (FSDP shard i lives on ``train_ranks[i]``); ``rollout_tp_ranks``:
    each rollout rank's TP rank; ``tp``: the rollout TP size. A round holds at most one
    message per (src, dst) pair, of at most ``bucket_bytes`` unless one piece is larger;
    both sides run the rounds in order.
    """
    world = len(train_ranks)
    pieces: dict[tuple[int, int], list[Piece]] = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        fdim = fsdp_dim(name, shape, world)
        chunk = chunk_rows(shape[fdim], world)
        targets = plan_tensor(name, shape, world, tp, "naive", tied_lm_head).targets
        for target, tdim in targets:
            tdim = tdim if tp > 1 else None
            for dst, j in rollout_tp_ranks.items():
                size = shape[tdim] // tp if tdim is not None else 0
                want = _box(shape, tdim, j * size, (j + 1) * size)
                dst_origin = tuple(lo for lo, _ in want)
                for i, src in enumerate(train_ranks):
                    have = _box(shape, fdim, i * chunk, min((i + 1) * chunk, shape[fdim]))
                    box = _intersect(want, have)
                    if box is not None:
                        pieces.setdefault((src, dst), []).append(
                            Piece(name, target, box, tuple(lo for lo, _ in have), dst_origin))
    rounds: list[list[Message]] = []
    for (src, dst), todo in sorted(pieces.items()):
        k = 0
        while todo:
            take, size = [], 0
            while todo and (not take or (size + todo[0].numel) * itemsize <= bucket_bytes):
                size += todo[0].numel
                take.append(todo.pop(0))
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(Message(src, dst, tuple(take)))
            k += 1
    return rounds


def received_bytes(rounds: list[list[Message]], rank: int, itemsize: int) -> int:
    return sum(m.numel for r in rounds for m in r if m.dst == rank) * itemsize


def sent_bytes(rounds: list[list[Message]], rank: int, itemsize: int) -> int:
    return sum(m.numel for r in rounds for m in r if m.src == rank) * itemsize


def _view(t: torch.Tensor, box, origin) -> torch.Tensor:
    for d, ((lo, hi), o) in enumerate(zip(box, origin)):
        t = t.narrow(d, lo - o, hi - lo)
    return t


def _exchange(ops: list) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


@torch.no_grad()
def send_weights(params: dict[str, torch.Tensor], rounds: list[list[Message]], rank: int, group,
                 dtype: torch.dtype, device: torch.device | None = None) -> int:
    """Send this training rank's pieces (``params``: name -> its local FSDP shard) from
    ``device`` (the backend's: shards offloaded to the host go to the GPU for NCCL);
    returns the bytes sent."""
    sent = 0
    for messages in rounds:
        ops, keep = [], []
        for m in messages:
            if m.src != rank:
                continue
            flat = torch.cat([_view(params[p.name], p.box, p.src_origin).to(device=device, dtype=dtype)
                              .reshape(-1) for p in m.pieces])
            keep.append(flat)
            ops.append(dist.P2POp(dist.isend, flat, m.dst, group))
            sent += flat.numel() * flat.element_size()
        _exchange(ops)
    return sent


@torch.no_grad()
def receive_weights(dest: dict[str, torch.Tensor], rounds: list[list[Message]], rank: int, group
                    ) -> int:
    """Receive this rollout rank's pieces into the engine's parameters ``dest`` (name ->
    this rank's TP slice); returns the bytes received."""
    received = 0
    for messages in rounds:
        mine = [m for m in messages if m.dst == rank]
        if not mine:
            continue
        dtype = dest[mine[0].pieces[0].target].dtype
        device = dest[mine[0].pieces[0].target].device
        bufs = [torch.empty(m.numel, dtype=dtype, device=device) for m in mine]
        _exchange([dist.P2POp(dist.irecv, b, m.src, group) for m, b in zip(mine, bufs)])
        for m, buf in zip(mine, bufs):
            offset = 0
            for p in m.pieces:
                _view(dest[p.target], p.box, p.dst_origin).copy_(
                    buf[offset:offset + p.numel].view(p.shape))
                offset += p.numel
            received += buf.numel() * buf.element_size()
    return received
