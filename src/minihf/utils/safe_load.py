"""Loading checkpoint files without running code from them.

A checkpoint is handed around like a model dir, so loading one must not execute anything a
stranger put in it. Three places in a minihf checkpoint are pickles:

* ``extra/rank_N.pt`` (LR-scheduler state, RNG states, the driver's counters): loaded with
  ``torch.load(weights_only=True)``, which admits tensors, containers and numbers only; the
  RNG states are stored as those (NumPy's as a tensor), and NumPy arrays, as checkpoints of
  earlier versions hold them, are admitted by name (:func:`load_extra`);
* ``model/.metadata`` and ``optim/.metadata`` (DCP's index of the shards): DCP reads them
  with a plain ``pickle.load``; :class:`SafeFileSystemReader` reads them with an unpickler
  that admits DCP's own metadata classes, ``torch.Size``, dtypes and paths, nothing else;
* DCP's byte items (the optimizer's ``param_groups``: learning rates, betas, flags): DCP
  loads them with ``torch.load(weights_only=False)``; :class:`SafeLoadPlanner` with
  ``weights_only=True``.

Chosen over a new pickle-free format: the checkpoints stay DCP's (resharding on load,
written in parallel by every rank) and earlier checkpoints still load. The tensor shards
themselves DCP already reads with ``weights_only=True``. A refused file raises
:class:`UnsafeCheckpointError` naming the file and the global it asked for. The planner also
keeps its refusal (``refusal``) for the caller to raise, and the caller reads ``.metadata``
through the reader before DCP does: DCP's versions differ in what they make of an exception
raised inside them (torch 2.11 drops the reader's and reports "metadata is None"; 2.13 logs
its traceback and folds its text into an ``AssertionError``).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from minihf.utils.files import CorruptFileError


class UnsafeCheckpointError(CorruptFileError):
    """A checkpoint file asked to load something other than data (a crafted pickle?)."""


_NUMPY_CORE = getattr(np, "_core", None) or np.core
# NumPy's pieces of an ndarray pickle (earlier checkpoints' RNG state): construction only
NUMPY_ARRAY_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype,
                       type(np.dtype(np.uint32))]

_DCP_CLASSES = {name for name, obj in vars(dcp_metadata).items() if isinstance(obj, type)}
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
# DCP's metadata holds paths; Python 3.13 pickles them as ``pathlib._local.<name>`` (pathlib
# became a package), earlier Pythons as ``pathlib.<name>``: either is read as ``pathlib.<name>``,
# so a checkpoint written under one Python loads under the other
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


def _refuse(path, what: str, why: object = None) -> UnsafeCheckpointError:
    detail = f" ({why})" if why is not None else ""
    return UnsafeCheckpointError(
        f"refusing to load {path}: it asks for {what}, which is not checkpoint data{detail}. "
        "minihf never runs code from a checkpoint; this file was not written by minihf (or was "
        "altered): use a checkpoint from a source you trust, or an earlier global_step_N")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch sizes, dtypes, layouts and paths only."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module == dcp_metadata.__name__ and name in _DCP_CLASSES) or (module, name) in _ALLOWED \
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        raise _refuse(self.path, f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, path).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise _refuse(path, type(metadata).__name__)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, loading byte items (non-tensor state) with ``weights_only=True``."""

    refusal: UnsafeCheckpointError | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refusal = _refuse(f"the item {read_item.dest_index.fqn!r}", "a non-data object",
                                   str(exc).split("\n")[0])
            raise self.refusal from None
        # hand the parent the vetted object re-saved (plain data: its unpickle runs nothing),
        # so where it goes in the state dict stays DCP's business
        super().load_bytes(read_item, io.BytesIO(_dump(obj)))


def _dump(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_data(path: str | Path):
    """``torch.load(path)``, data only (tensors, containers, numbers, strings, NumPy arrays):
    a file asking for anything else is refused, a damaged one named."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise _damaged(path, exc) from None
        raise _refuse(path, "a non-data object", str(exc).split("\n")[0]) from None
    except Exception as exc:  # empty, truncated, not a torch file (EOFError, KeyError, ...)
        raise _damaged(path, exc) from None


def load_extra(path: str | Path) -> dict:
    """``torch.load(path)`` of an ``extra/rank_N.pt``, data only (NumPy arrays admitted)."""
    saved = load_data(path)
    if not isinstance(saved, dict) or not {"lr_scheduler", "rng", "extra"} <= saved.keys():
        raise CorruptFileError(f"{path} is not a minihf extra-state file (it holds "
                               f"{type(saved).__name__}); resume an earlier global_step_N or "
                               "start fresh (trainer.resume_mode=disable)")
    return saved


def _damaged(path, exc: BaseException) -> CorruptFileError:
    first = str(exc).strip().split("\n")[0][:160] or type(exc).__name__
    return CorruptFileError(f"{path} is empty, truncated or damaged ({first}); resume an earlier "
                            "global_step_N or start fresh (trainer.resume_mode=disable)")
