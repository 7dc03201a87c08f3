"""Reading the files minihf depends on, with one clear line when one is broken.

A half-written, empty or hand-edited file (``config.json``, a safetensors shard, a
checkpoint's metadata, ``latest_checkpointed_iteration.txt``) raises ``CorruptFileError``
naming the path, what is wrong, and the way out the caller gives (``fix``), instead of a
decoder's traceback without the file name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


MODEL_FIX = "re-export or re-download the model dir (`minihf export CKPT OUT` writes one from a checkpoint)"


class CorruptFileError(ValueError):
    """A file exists but cannot be read as what it should be."""


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON in ``path``; ``CorruptFileError`` if it is empty, not UTF-8 or not JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise CorruptFileError(f"{path} is not UTF-8 text (a binary or damaged file); {fix}") from None
    if not text.strip():
        raise CorruptFileError(f"{path} is empty (written only in part?); {fix}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptFileError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                               f"{exc.colno}); {fix}") from None


def open_safetensors(path: str | Path, fix: str):
    """``safetensors.safe_open`` of ``path`` (torch tensors); ``CorruptFileError`` for an
    empty, truncated or foreign file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptFileError(f"{path} is not a readable safetensors file ({reason}; "
                               f"{Path(path).stat().st_size} bytes); {fix}") from None


def read_int(path: str | Path, fix: str) -> int:
    """The integer that is the whole content of ``path`` (e.g. the latest checkpoint step)."""
    text = Path(path).read_text(errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        shown = repr(text[:40]) if text else "nothing"
        raise CorruptFileError(f"{path} holds {shown}, not a step number; {fix}") from None


def check_output_dir(path: str | Path, what: str) -> None:
    """A FileExistsError naming ``what`` if directory ``path`` cannot be created because it, or
    one of its parents, is a file (e.g. ``minihf export CKPT afile/sub``)."""
    path = Path(path)
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                raise FileExistsError(f"{what} {path}: {p} is a file, not a directory; choose "
                                      "another path")
            return


def check_writable_file(path: str | Path, what: str) -> None:
    """A ValueError naming ``what`` unless ``path`` can be written as a file: not a
    directory, in an existing, writable directory (checked before long work, not after)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise ValueError(f"{what} {path}: {path.parent} does not exist (or is a file); create "
                         "the directory first or choose another path")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"{what} {path}: {path.parent} is not writable")
