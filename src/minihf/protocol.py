"""``Batch``: the unit of data passed between the driver and the role workers.

A Batch holds a dict of tensors that share batch dimension 0 (``tensors``), a dict of numpy
object arrays of the same length for everything that is not a tensor (``non_tensors``:
strings, uids, ragged lists), and a free ``meta`` dict for batch-level values (temperature,
global step, ...). It plays the role of verl's ``DataProto`` with fewer concepts: no
TensorDict dependency, indexing always returns a Batch (an int ``i`` gives the 1-row Batch
``[i:i+1]``), and every consistency check raises a ``ValueError`` that names the keys and
sizes involved.

Operations return new Batch objects that share tensor storage where torch does (slicing),
except ``pop`` and ``|=`` which change the Batch in place.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch


def _as_object_array(key: str, value: Any) -> np.ndarray:
    """Store non-tensor values as a numpy object array with the batch on dim 0."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor {key!r} is a 0-d array; it needs a batch dimension")
        return value if value.dtype == object else value.astype(object)
    if isinstance(value, torch.Tensor):
        raise TypeError(f"non-tensor {key!r} is a torch.Tensor; put it in `tensors`")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(
            f"non-tensor {key!r} must be a list or numpy array with one entry per row, "
            f"got {type(value).__name__}") from None
    # Filled one by one so that a list of equal-length lists stays 1-D (one object per row).
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def _equal(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays and plain Python values (same object: equal)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b.to(a.device)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        try:
            return bool(np.array_equal(a, b))
        except (ValueError, TypeError):  # object arrays holding arrays: compare row by row
            return all(_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
    try:
        return bool(a == b)
    except (ValueError, TypeError, RuntimeError):
        return False


def _merge_meta(metas: Iterable[dict]) -> dict:
    out: dict = {}
    for meta in metas:
        for k, v in meta.items():
            if k in out and not _equal(out[k], v):
                raise ValueError(f"meta key {k!r} conflicts: {out[k]!r} vs {v!r}; "
                                 "make the values equal or drop one before merging")
            out[k] = v
    return out


class Batch:
    """Tensors sharing batch dim 0, same-length non-tensor object arrays, and ``meta``."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None,
                 non_tensors: dict[str, Any] | None = None, meta: dict | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = {
            k: _as_object_array(k, v) for k, v in (non_tensors or {}).items()}
        self.meta: dict = dict(meta or {})
        self._check()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None = None, *,
                  tensors: dict[str, torch.Tensor] | None = None,
                  non_tensors: dict[str, Any] | None = None, meta: dict | None = None) -> Batch:
        """Build a Batch; entries of the optional mixed ``data`` dict are sorted by type."""
        tensors, non_tensors = dict(tensors or {}), dict(non_tensors or {})
        for k, v in (data or {}).items():
            (tensors if isinstance(v, torch.Tensor) else non_tensors)[k] = v
        return cls(tensors, non_tensors, meta)

    def _check(self) -> None:
        for k, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {k!r} is a {type(t).__name__}, not a torch.Tensor; "
                                "put it in `non_tensors`")
            if t.dim() == 0:
                raise ValueError(f"tensor {k!r} is 0-d; it needs a batch dimension "
                                 "(use t.unsqueeze(0), or put it in `meta`)")
        both = sorted(set(self.tensors) & set(self.non_tensors))
        if both:
            raise ValueError(f"keys {both} are both tensors and non-tensors")
        sizes = {k: t.shape[0] for k, t in self.tensors.items()}
        sizes.update({k: a.shape[0] for k, a in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{k}={n}" for k, n in sizes.items())
            raise ValueError(f"inconsistent batch sizes along dim 0: {detail}; every tensor "
                             "and non-tensor must have the same number of rows")

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for a in self.non_tensors.values():
            return a.shape[0]
        return 0

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def tensor_items(self) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) pairs in sorted key order, identical on every rank (for transport)."""
        return sorted(self.tensors.items())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __repr__(self) -> str:
        parts = [f"{k}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                 for k, t in self.tensors.items()]
        parts += [f"{k}: object{a.shape}" for k, a in self.non_tensors.items()]
        return f"Batch(len={len(self)}, {{{', '.join(parts)}}}, meta={sorted(self.meta)})"

    def _missing(self, keys: Iterable[str]) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} not in Batch; available: {self.keys()}")

    def __getitem__(self, index: Any) -> Any:
        """``batch["key"]`` -> tensor/array; int, slice, index list/tensor, bool mask -> Batch."""
        if isinstance(index, str):
            self._missing([index])
            return self.tensors[index] if index in self.tensors else self.non_tensors[index]
        n = len(self)
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for Batch of length {n}")
            i %= n
            index = slice(i, i + 1)
        if isinstance(index, slice):
            return Batch({k: t[index] for k, t in self.tensors.items()},
                         {k: a[index] for k, a in self.non_tensors.items()}, self.meta)
        idx = self._index_array(index, n)
        return Batch({k: t[torch.from_numpy(idx).to(t.device)] for k, t in self.tensors.items()},
                     {k: a[idx] for k, a in self.non_tensors.items()}, self.meta)

    @staticmethod
    def _index_array(index: Any, n: int) -> np.ndarray:
        """Turn an index list/array/tensor or a bool mask into an int64 numpy index array."""
        if isinstance(index, torch.Tensor):
            index = index.detach().cpu().numpy()
        idx = np.asarray(index)
        if idx.ndim != 1:
            raise IndexError(f"index must be 1-D, got shape {idx.shape}")
        if idx.dtype == bool:
            if idx.shape[0] != n:
                raise IndexError(f"bool mask has length {idx.shape[0]}, Batch has {n}")
            return np.nonzero(idx)[0]
        if idx.size == 0:
            return idx.astype(np.int64)
        if not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"cannot index a Batch with dtype {idx.dtype}; "
                             "use ints, a bool mask, a slice or a str key")
        bad = idx[(idx < -n) | (idx >= n)]
        if bad.size:
            raise IndexError(f"indices {bad.tolist()} out of range for Batch of length {n}")
        return idx.astype(np.int64) % max(n, 1)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace one entry; its length must match the Batch."""
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = _as_object_array(key, value)
        self._check()

    def select(self, *keys: str) -> Batch:
        self._missing(keys)
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.non_tensors[k] for k in keys if k in self.non_tensors}, self.meta)

    def pop(self, *keys: str) -> Batch:
        """Remove ``keys`` from this Batch and return them as a new Batch (meta copied)."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """Keys of both; a key present in both must hold equal values, or this raises."""
        if not isinstance(other, Batch):
            raise TypeError(f"can only union a Batch with a Batch, got {type(other).__name__}")
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"cannot union Batches of lengths {len(self)} and {len(other)}")
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for src, dst, other_dst in ((other.tensors, tensors, non_tensors),
                                    (other.non_tensors, non_tensors, tensors)):
            for k, v in src.items():
                if k in other_dst:
                    raise ValueError(f"key {k!r} is a tensor on one side of the union "
                                     "and a non-tensor on the other")
                if k in dst and not _equal(dst[k], v):
                    raise ValueError(f"key {k!r} is in both Batches with different values; "
                                     "pop it from one side before the union")
                dst[k] = v
        return Batch(tensors, non_tensors, _merge_meta([self.meta, other.meta]))

    __or__ = union

    def __ior__(self, other: Batch) -> Batch:
        merged = self.union(other)
        self.tensors, self.non_tensors, self.meta = merged.tensors, merged.non_tensors, merged.meta
        return self

    def chunk(self, k: int) -> list[Batch]:
        """Split into ``k`` equal parts; the length must be divisible by ``k``."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"chunk count must be a positive int, got {k!r}")
        n = len(self)
        if n % k:
            raise ValueError(f"Batch of length {n} cannot be split into {k} equal chunks; "
                             f"use `batch, pad = batch.pad_to_multiple({k})` first and "
                             "`unpad(pad)` the result")
        return self.split(n // k) if n else [self[0:0] for _ in range(k)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows; the last one may be shorter."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"split size must be a positive int, got {size!r}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack Batches with the same keys along dim 0; meta is merged (conflicts raise)."""
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one Batch")
        t_keys, n_keys = set(batches[0].tensors), set(batches[0].non_tensors)
        for i, b in enumerate(batches[1:], 1):
            if set(b.tensors) != t_keys or set(b.non_tensors) != n_keys:
                raise ValueError(f"Batch.concat: batch {i} has keys {sorted(b.keys())}, "
                                 f"batch 0 has {sorted(batches[0].keys())}")
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors},
                     {k: np.concatenate([b.non_tensors[k] for b in batches])
                      for k in batches[0].non_tensors},
                     _merge_meta(b.meta for b in batches))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``[a, a, b, b]`` if ``interleave`` else ``[a, b, a, b]``."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"repeat count must be a positive int, got {n!r}")
        if interleave:
            tensors = {k: t.repeat_interleave(n, dim=0) for k, t in self.tensors.items()}
            non_tensors = {k: np.repeat(a, n, axis=0) for k, a in self.non_tensors.items()}
        else:
            tensors = {k: t.repeat(n, *[1] * (t.dim() - 1)) for k, t in self.tensors.items()}
            non_tensors = {k: np.tile(a, (n,) + (1,) * (a.ndim - 1))
                           for k, a in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append rows copied from the start (wrapping) to a multiple of k; -> (Batch, added)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"pad multiple must be a positive int, got {k!r}")
        n = len(self)
        pad = -n % k
        if pad == 0:
            return self, 0
        return Batch.concat([self, self[np.arange(pad) % n]]), pad

    def unpad(self, pad_count: int) -> Batch:
        """Drop the last ``pad_count`` rows added by ``pad_to_multiple``."""
        if not 0 <= pad_count <= len(self):
            raise ValueError(f"pad_count {pad_count} out of range for Batch of length {len(self)}")
        return self if pad_count == 0 else self[:len(self) - pad_count]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Move the tensors; non-tensors stay numpy on the host."""
        return Batch({k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()},
                     self.non_tensors, self.meta)
