"""How one driver call is split over a role's ranks, and how the answers are joined.

Pure functions on Python objects: no processes, no torch.distributed, so the arithmetic is
unit-tested alone. A dispatch mode is a pair of plain functions kept in one explicit table
(``DISPATCH_MODES``); ``register_dispatch_mode`` adds a pair:

* ``dispatch_fn(layout, args, kwargs) -> Plan``: the ``(args, kwargs)`` for every role rank
  (``None`` = that rank is not called), which role ranks send their return value back
  (``collect_from``; the others only acknowledge), and a ``ctx`` handed to collect.
* ``collect_fn(layout, outputs, ctx) -> result``: ``outputs`` are the return values of the
  ``collect_from`` ranks, in that order.

A plan may also carry ``receive_into(k, value) -> {stub index: tensor}``: given the k-th
collected reply with a ``TensorStub`` per tensor (before its bytes arrive), destination
tensors to receive them into, and ``place_local(k, value) -> value``, run on rank 0's
worker thread right after its own part. DP_COMPUTE uses them to land remote results
directly in slices of the concatenated output (``DPOutputs``) and to copy rank 0's part
there while the remote ones are still in flight, so collecting copies nothing more.

Which ranks form a DP rank's replica (TP peers receive the same data) is the
``RoleLayout``'s business (``minihf.controller.layout``): the method's layout is passed in.
When a method's ``collect`` is another mode, that mode's ``replies`` picks which of the
dispatch's ``collect_from`` ranks send data back (RANK_ZERO: only the first), so ranks
whose results would be thrown away only acknowledge.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from minihf.controller.errors import ControllerError
from minihf.controller.layout import RoleLayout
from minihf.protocol import Batch


Call = tuple[tuple, dict]


@dataclass
class Plan:
    """Per-role-rank calls (``None``: not called), which ranks reply with data, collect ctx."""
    calls: list[Call | None]
    collect_from: list[int]
    ctx: Any = None
    receive_into: Callable[[int, Any], dict] | None = None  # see the module docstring
    place_local: Callable[[int, Any], Any] | None = None  # same, for rank 0's own results


DispatchFn = Callable[[RoleLayout, tuple, dict], Plan]
CollectFn = Callable[[RoleLayout, list, Any], Any]


RepliesFn = Callable[[list[int]], list[int]]


def all_replies(collect_from: list[int]) -> list[int]:
    return collect_from


def first_reply(collect_from: list[int]) -> list[int]:
    return collect_from[:1]


@dataclass(frozen=True)
class DispatchMode:
    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    replies: RepliesFn = all_replies  # as a collect: which of collect_from reply


class Dispatch:
    """Names of the built-in modes (plain strings: user modes are strings too)."""
    ONE_TO_ALL = "one_to_all"    # same arguments on every rank; list of all results
    DP_COMPUTE = "dp_compute"    # Batch args chunked over DP ranks; results concatenated
    DP_COMPUTE_EXACT = "dp_compute_exact"  # DP_COMPUTE that refuses to pad (for updates)
    RANK_ZERO = "rank_zero"      # only role rank 0 runs; its result
    ALL_TO_ALL = "all_to_all"    # each argument is a list with one entry per rank; list of results


# --- built-in pairs ---------------------------------------------------------------------

def dispatch_one_to_all(layout: RoleLayout, args: tuple, kwargs: dict) -> Plan:
    call = (args, kwargs)  # one object for every rank: the transport packs it once
    return Plan([call] * layout.size, list(range(layout.size)))


def collect_all(layout: RoleLayout, outputs: list, ctx: Any) -> list:
    return list(outputs)


def dispatch_rank_zero(layout: RoleLayout, args: tuple, kwargs: dict) -> Plan:
    return Plan([(args, kwargs)] + [None] * (layout.size - 1), [0])


def collect_first(layout: RoleLayout, outputs: list, ctx: Any) -> Any:
    return outputs[0]


def dispatch_all_to_all(layout: RoleLayout, args: tuple, kwargs: dict) -> Plan:
    for name, value in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != layout.size:
            raise ControllerError(
                f"ALL_TO_ALL on role {layout.role!r}: {name} must be a list with one entry per "
                f"rank ({layout.size}), got {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else ""))
    calls = [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()})
             for i in range(layout.size)]
    return Plan(calls, list(range(layout.size)))


def dispatch_dp_compute(layout: RoleLayout, args: tuple, kwargs: dict) -> Plan:
    """Chunk every Batch argument over the DP ranks (others go to all ranks unchanged).

    Batches whose length is not a multiple of ``dp_size`` are padded with
    ``Batch.pad_to_multiple``; the pad count travels to ``collect_dp_compute`` as ``ctx``.
    """
    batches = [v for v in (*args, *kwargs.values()) if isinstance(v, Batch)]
    if not batches:
        raise ControllerError(f"DP_COMPUTE on role {layout.role!r} needs at least one Batch "
                              "argument; use ONE_TO_ALL for calls without data")
    lengths = sorted({len(b) for b in batches})
    if len(lengths) > 1:
        raise ControllerError(f"DP_COMPUTE on role {layout.role!r}: Batch arguments have "
                              f"different lengths {lengths}; they must be equal")
    dp = layout.dp_size
    pad = -lengths[0] % dp

    def chunks(value: Any) -> list:
        if not isinstance(value, Batch):
            return [value] * dp
        padded, _ = value.pad_to_multiple(dp)
        return padded.chunk(dp)

    arg_chunks = [chunks(a) for a in args]
    kwarg_chunks = {k: chunks(v) for k, v in kwargs.items()}
    # One call object per DP rank, shared by its TP peers (the transport packs it once).
    per_dp = [(tuple(c[d] for c in arg_chunks), {k: c[d] for k, c in kwarg_chunks.items()})
              for d in range(dp)]
    calls = [per_dp[layout.dp_rank(i)] for i in range(layout.size)]
    collect_from = [i for i in range(layout.size) if layout.tp_rank(i) == 0]
    ctx = DPOutputs(pad, [(lengths[0] + pad) // dp] * dp)
    if dp == 1:  # its result is the output as it is
        return Plan(calls, collect_from, ctx=ctx)
    return Plan(calls, collect_from, ctx=ctx, receive_into=ctx.receive_into,
                place_local=ctx.place_local)


def dispatch_dp_compute_exact(layout: RoleLayout, args: tuple, kwargs: dict) -> Plan:
    """DP_COMPUTE that refuses uneven batches (on the driver, before sending): padding
    repeats rows, which inference strips from its results but an update counts twice."""
    dp = layout.dp_size
    lengths = sorted({len(v) for v in (*args, *kwargs.values()) if isinstance(v, Batch)})
    uneven = [n for n in lengths if n % dp]
    if uneven:
        raise ControllerError(
            f"DP_COMPUTE_EXACT on role {layout.role!r}: len(batch)={uneven[0]} does not split "
            f"evenly over the {dp} DP ranks, and this method does not pad (repeated rows "
            f"would count twice in an update); make the batch size a multiple of {dp}, e.g. "
            "ppo_mini_batch_size (or the SFT batch size)")
    return dispatch_dp_compute(layout, args, kwargs)


class DPOutputs:
    """DP_COMPUTE's collect context: the pad count and the concatenated output tensors.

    A result tensor with as many rows as its rank's chunk is received straight into its rows
    of one output tensor per key, allocated when the first such result announces its shape;
    ``concat`` then copies only the parts that are not in place yet (rank 0's own, small
    packed ones). Anything else (other row counts, shapes, dtypes, devices; non-Batch
    results) takes the plain ``Batch.concat`` path.
    """

    def __init__(self, pad: int, rows: list[int]):
        self.pad, self.rows = pad, rows
        self.starts = [sum(rows[:k]) for k in range(len(rows))]
        self.out: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # receive_into runs on one receiver thread per rank

    def _fits(self, out: torch.Tensor, t: Any, k: int) -> bool:
        return (tuple(t.shape[:1]) == (self.rows[k],) and tuple(t.shape[1:]) == out.shape[1:]
                and t.dtype == out.dtype and t.device == out.device)

    def _rows(self, k: int, key: str, t: Any) -> torch.Tensor | None:
        """The k-th DP rank's rows of output ``key`` for a tensor (or stub) ``t`` that fits,
        allocating the output on first use; None if ``t`` does not fit. Hold the lock."""
        if len(t.shape) < 1 or t.shape[0] != self.rows[k]:
            return None
        out = self.out.get(key)
        if out is None:
            out = self.out[key] = torch.empty((sum(self.rows), *t.shape[1:]), dtype=t.dtype,
                                              device=t.device)
        return out[self.starts[k]:self.starts[k] + self.rows[k]] if self._fits(out, t, k) else None

    def receive_into(self, k: int, value: Any) -> dict[int, torch.Tensor]:
        """Destinations (rows of the outputs) for the k-th DP rank's result ``value``."""
        if not isinstance(value, Batch):
            return {}
        with self._lock:
            dest = {stub.index: self._rows(k, key, stub) for key, stub in value.tensors.items()}
        return {i: t for i, t in dest.items() if t is not None}

    def place_local(self, k: int, value: Any) -> Any:
        """Copy rank 0's own (k-th) result into its rows as soon as it exists, on its worker
        thread while remote results are still in flight; returns it with those rows."""
        if not isinstance(value, Batch):
            return value
        with self._lock:
            rows = {key: self._rows(k, key, t) for key, t in value.tensors.items()}
        for key, r in rows.items():
            if r is not None:
                r.copy_(value.tensors[key])
        return Batch({key: t if rows[key] is None else rows[key]
                      for key, t in value.tensors.items()}, value.non_tensors, value.meta)

    def concat(self, parts: list[Batch]) -> Batch:
        """``Batch.concat(parts)``, filling the preallocated outputs where every part fits."""
        if len(parts) == 1:
            return parts[0]
        done: dict[str, torch.Tensor] = {}
        for key, out in self.out.items():
            ts = [p.tensors.get(key) for p in parts]
            if len(ts) != len(self.rows) or not all(
                    t is not None and self._fits(out, t, k) for k, t in enumerate(ts)):
                continue
            for k, t in enumerate(ts):
                rows = out[self.starts[k]:self.starts[k] + self.rows[k]]
                if t.data_ptr() != rows.data_ptr():  # not received in place
                    rows.copy_(t)
            done[key] = out
        rest = Batch.concat([Batch({k: v for k, v in p.tensors.items() if k not in done},
                                   p.non_tensors, p.meta) for p in parts])
        tensors = {k: done[k] if k in done else rest.tensors[k] for k in parts[0].tensors}
        return Batch(tensors, rest.non_tensors, rest.meta)


def collect_dp_compute(layout: RoleLayout, outputs: list, ctx: Any) -> Any:
    """Concatenate Batch results in DP order and strip the padding; else list per DP rank.

    ``ctx``: the ``DPOutputs`` of the dispatch (or just a pad count)."""
    if outputs and all(isinstance(o, Batch) for o in outputs):
        if isinstance(ctx, DPOutputs):
            return ctx.concat(outputs).unpad(ctx.pad)
        out = outputs[0] if len(outputs) == 1 else Batch.concat(outputs)
        return out.unpad(ctx or 0)
    return list(outputs)


# --- the table ----------------------------------------------------------------------------

DISPATCH_MODES: dict[str, DispatchMode] = {
    m.name: m for m in (
        DispatchMode(Dispatch.ONE_TO_ALL, dispatch_one_to_all, collect_all),
        DispatchMode(Dispatch.DP_COMPUTE, dispatch_dp_compute, collect_dp_compute),
        DispatchMode(Dispatch.DP_COMPUTE_EXACT, dispatch_dp_compute_exact, collect_dp_compute),
        DispatchMode(Dispatch.RANK_ZERO, dispatch_rank_zero, collect_first, first_reply),
        DispatchMode(Dispatch.ALL_TO_ALL, dispatch_all_to_all, collect_all),
    )
}


def register_dispatch_mode(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn,
                           *, replace: bool = False,
                           replies: RepliesFn = all_replies) -> DispatchMode:
    """Add a dispatch/collect pair under ``name`` (before classes using it are defined);
    ``replies`` says which ranks reply when the mode is another method's ``collect``."""
    if name in DISPATCH_MODES and not replace:
        raise ControllerError(f"dispatch mode {name!r} already exists; pass replace=True to "
                              "override it")
    mode = DispatchMode(name, dispatch_fn, collect_fn, replies)
    DISPATCH_MODES[name] = mode
    return mode


def get_dispatch_mode(name: str) -> DispatchMode:
    try:
        return DISPATCH_MODES[name]
    except KeyError:
        raise ControllerError(f"unknown dispatch mode {name!r}; known: {sorted(DISPATCH_MODES)}; "
                              "add one with register_dispatch_mode") from None
