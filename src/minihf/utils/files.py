"""Reading the files minihf depends on, with one clear line when one is broken.

A half-written, empty or hand-edited file (``config.json``, a safetensors shard, a
checkpoint's metadata, ``latest_checkpointed_iteration.txt``) raises ``CorruptFileError``
naming the path, what is wrong, and the way out the caller gives (``fix``), instead of a
decoder's traceback without the file name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


MODEL_FIX = "re-export or re-download the model dir (`minihf export CKPT OUT` writes one from a checkpoint)"


class CorruptFileError(ValueError):
    """A file exists but cannot be read as what it should be."""


class WriteFailedError(OSError):
    """A file could not be written completely (a full disk, a quota)."""


def _chain(exc: BaseException):
    """``exc``, its causes and contexts, and the per-rank errors DCP wraps."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in getattr(e, "failures", {}).values()]


def short_write(exc: BaseException, path: str | Path, what: str, kept: str) -> WriteFailedError | None:
    """A one-line ``WriteFailedError`` for ``exc`` if it is a write that stopped short (no
    space left, a quota, torch's "unexpected pos" of a torn file), naming ``what`` at
    ``path``, the free space there and what was ``kept``; None for any other error."""
    full = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
               for e in _chain(exc))
    torn = any("unexpected pos" in str(e) for e in _chain(exc))
    if not (full or torn):
        return None
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free / 2**20
    why = "no space left on device" if full else "a write stopped short (disk full or over quota?)"
    return WriteFailedError(f"could not write {what} {path}: {why}, {free:.0f} MiB free there now; "
                            f"{kept}")


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


class UnwritablePathError(ValueError):
    """An output path that cannot be created or written (a one-line user error)."""


def cannot_create_in(directory: str | Path) -> str | None:
    """Why no new entry can be made in the existing directory ``directory`` (the error's
    text), or None when one can. A real directory is made and removed: ``os.access`` says yes
    to root everywhere, also under ``/proc`` or on a read-only mount, where creating fails."""
    try:
        probe = tempfile.mkdtemp(prefix=".minihf-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.rmdir(probe)
    return None


def resolve_links(path: str | Path) -> Path:
    """``Path(path).resolve()``, raising a ``RuntimeError`` that says "Symlink loop" for a
    loop on every Python: before 3.13 ``resolve`` raises it itself ("Symlink loop from ...");
    from 3.13 it returns the path with the looping link left in it, and this raises instead."""
    resolved = Path(path).resolve()
    if any(p.is_symlink() for p in [resolved, *resolved.parents]):
        raise RuntimeError(f"Symlink loop at {resolved}")
    return resolved


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    for p in [path, *path.parents]:
        if p.exists():
            return p
    return Path(path.anchor or ".")


def check_output_dir(path: str | Path, what: str, staged: bool = True) -> None:
    """One line naming ``what`` if directory ``path`` cannot be made: it, or one of its
    parents, is a file (``FileExistsError``, e.g. ``minihf export CKPT afile/sub``), or it
    cannot be created there (``UnwritablePathError``: not writable, ``/proc``, a read-only
    mount). ``staged``: the dir is built beside its final name (``staged_dir``), so its
    parent must take new entries, also when ``path`` exists; else the files are written
    into ``path`` itself (it must take them, or be creatable)."""
    path = Path(path)
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                raise FileExistsError(f"{what} {path}: {p} is a file, not a directory; choose "
                                      "another path")
            break
    where = nearest_existing(path.absolute().parent if staged else path.absolute())
    why = cannot_create_in(where)
    if why is not None:
        cannot = "cannot be written" if where == path.absolute() else "cannot be created"
        raise UnwritablePathError(f"{what} {path} {cannot}: making an entry in {where} fails ({why}); "
                                  "choose a path you can write to")


def check_writable_file(path: str | Path, what: str) -> None:
    """A ValueError naming ``what`` unless ``path`` can be written as a file: not a
    directory, in an existing directory that takes new files (checked before long work, not
    after; a file is made and removed there, see :func:`cannot_create_in`)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise ValueError(f"{what} {path}: {path.parent} does not exist (or is a file); create "
                         "the directory first or choose another path")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"{what} {path}: {path.parent} is not writable")
    why = cannot_create_in(path.parent)
    if why is not None:
        raise UnwritablePathError(f"{what} {path} cannot be written: making a file in {path.parent} "
                                  f"fails ({why}); choose a path you can write to")
    if path.exists() and not os.access(path, os.W_OK):
        raise UnwritablePathError(f"{what} {path} exists and is not writable; choose another path")


@contextlib.contextmanager
def staged_dir(final: str | Path, replace: bool = True):
    """Build a directory under a temporary sibling name (yielded) and move it to ``final``
    when the block completes: a reader of ``final`` (a rerun deciding what to redo) never
    sees it half written. An error or an interrupt removes the temporary dir, and a
    leftover of a killed build is removed by the next one (the caller holds the artefact's
    lock, ``minihf.utils.locks``). ``replace``: an existing ``final`` is replaced as a
    whole; otherwise the new files are moved into it one by one (e.g. a data dir that
    holds other files)."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.is_dir() and not replace:
        for entry in sorted(tmp.iterdir()):
            if (final / entry.name).is_dir():
                shutil.rmtree(final / entry.name)
            os.replace(entry, final / entry.name)
        tmp.rmdir()
        return
    if final.is_dir():
        shutil.rmtree(final)  # a kill from here to the rename leaves no final: a rerun rebuilds
    os.replace(tmp, final)
