"""Planning a reshard: which tensor is gathered over which ranks, into which bucket.

A pure function of parameter names, shapes, the role's N ranks and the generation TP size
t (no torch, no processes), so every decision is unit-tested alone. ``reshard.py`` executes
the plan.

Layouts (``minihf.controller.layout``): training shards every parameter over all N ranks
(FSDP2, dim from ``placement.fsdp_dim``); generation runs N/t replicas of TP size t with
*strided* TP groups, so TP rank j lives on the contiguous ranks ``j*g .. (j+1)*g - 1``
(``g = N/t``, the rank's *gather group*). For a parameter whose FSDP dim is its TP dim and
whose size divides by N, the g FSDP shards of a gather group are exactly TP shard j:
all-gathering inside the group yields the rank's TP slice and nothing more (``over =
"gather"``). Everything else is gathered whole over all N ranks (``over = "all"``) and
sliced locally: replicated tensors (norms, the embedding, row-parallel biases, an LM head
whose vocabulary does not divide by t) and the rare misaligned ones (a row-parallel
weight that FSDP had to shard on dim 0). ``mode="naive"`` gathers every tensor whole, the
baseline (what syncing FSDP weights into a separate inference engine usually costs).

Small tensors share a bucket (one collective per bucket); a bucket's gathered size is at
most ``bucket_bytes`` unless one tensor alone is larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minihf.parallel.placement import chunk_rows, fsdp_dim, tp_dim, vocab_parallel

MODES = ("hybrid", "naive")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class TensorPlan:
    """One FSDP parameter: how it is gathered and which engine parameters it fills."""
    name: str                       # the FSDP (training) parameter
    shape: tuple[int, ...]          # its full shape
    fsdp_dim: int
    chunk: int                      # rows of every (padded) FSDP shard along fsdp_dim
    over: str                       # "gather" (the rank's gather group) | "all" (all N ranks)
    targets: tuple[tuple[str, int | None], ...]  # (engine parameter, TP dim to slice or None)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one rank's padded shard, as gathered."""
        return tuple(self.chunk if d == self.fsdp_dim else s for d, s in enumerate(self.shape))

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class Bucket:
    over: str                       # every tensor of a bucket is gathered over the same ranks
    tensors: tuple[TensorPlan, ...]

    @property
    def local_numel(self) -> int:
        return sum(t.local_numel for t in self.tensors)


def plan_tensor(name: str, shape: tuple[int, ...], world: int, tp: int, mode: str = "hybrid",
                tied_lm_head: bool = False) -> TensorPlan:
    """The plan of one FSDP parameter (``tied_lm_head``: the engine's vocab-parallel LM head
    is a slice of this embedding)."""
    fdim = fsdp_dim(name, shape, world)
    targets = [(name, tp_dim(name, shape, tp) if tp > 1 else None)]
    if tied_lm_head and name == EMBED and tp > 1 and vocab_parallel(shape[0], tp):
        targets.append((LM_HEAD, 0))
    tdim = targets[0][1]
    aligned = (len(targets) == 1 and tdim is not None and tdim == fdim
               and shape[fdim] % world == 0)
    over = "gather" if mode == "hybrid" and (aligned or tp == 1) else "all"
    if over == "gather":
        targets = [(name, None)]  # the gathered rows are the slice
    return TensorPlan(name, tuple(shape), fdim, chunk_rows(shape[fdim], world), over,
                      tuple(targets))


def plan_reshard(shapes: dict[str, tuple[int, ...]], world: int, tp: int, *,
                 mode: str = "hybrid", tied_lm_head: bool = False, itemsize: int = 4,
                 bucket_bytes: int = 32 << 20) -> list[Bucket]:
    """Buckets covering every parameter in ``shapes`` (FSDP names -> full shapes), in order.

    ``world``: the role's N ranks; ``tp``: the generation TP size (divides N); ``itemsize``:
    bytes per element of the rollout dtype (what travels).
    """
    if mode not in MODES:
        raise ValueError(f"rollout.reshard={mode!r}; choose one of {list(MODES)}")
    if tp < 1 or world % tp:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} must divide the actor's "
                         f"{world} ranks; use one of {[d for d in range(1, world + 1) if world % d == 0]}")
    sizes = {"gather": world // tp, "all": world}
    buckets: list[Bucket] = []
    open_: dict[str, list[TensorPlan]] = {"gather": [], "all": []}

    def close(over: str) -> None:
        if open_[over]:
            buckets.append(Bucket(over, tuple(open_[over])))
            open_[over] = []

    for name, shape in shapes.items():
        t = plan_tensor(name, tuple(shape), world, tp, mode, tied_lm_head)
        gathered = t.local_numel * sizes[t.over] * itemsize
        current = sum(x.local_numel for x in open_[t.over]) * sizes[t.over] * itemsize
        if open_[t.over] and current + gathered > bucket_bytes:
            close(t.over)
        open_[t.over].append(t)
    close("gather")
    close("all")
    return buckets


def traffic(buckets: list[Bucket], world: int, tp: int, itemsize: int) -> dict[str, int]:
    """Bytes one rank receives (ring all-gather: (g - 1) x its shard per collective, g the
    group size) and the number of collectives, from the plan alone."""
    sizes = {"gather": world // tp, "all": world}
    received = sum((sizes[b.over] - 1) * b.local_numel * itemsize for b in buckets)
    collectives = sum(1 for b in buckets if sizes[b.over] > 1)
    return {"bytes_received": received, "collectives": collectives}
