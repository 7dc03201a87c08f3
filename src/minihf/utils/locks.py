"""One job per run dir: a lock file beside each directory a job writes.

A run dir (``trainer.default_local_dir``) and each artefact a job prepares (task data, a
random-init model, the SFT warm start, a converted GGUF) is held by one job at a time, on
rank 0, for as long as it writes there. A second job is refused in one line naming the
holder (host, pid, start time, command); a lock left by a job that died (SIGKILL, a lost
host) is taken over with a message.

The lock is ``.<name>.lock`` beside ``<name>`` (``outputs/.grpo_sort.lock``; symlinks resolved
first, so two names of one directory share its lock), held with
``flock``: the kernel drops it when the holding process dies, however it dies, so a stale
lock is recognised without guessing. The file records who holds it; it is removed on
release, and taken over when found without a live holder.

Limits: ``flock`` is only as good as the filesystem's locking. Local filesystems and NFSv4
(Linux clients map ``flock`` to NFS byte-range locks) hold it across processes and hosts.
Where the filesystem has no locking at all (``flock`` fails with ENOLCK / EOPNOTSUPP), the
recorded holder decides: a live pid on this host holds it, a dead one is taken over, and a
holder on another host cannot be checked, so the job is refused and the message says to
delete the lock file if that job is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from minihf.utils.files import resolve_links

UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class HeldByAnotherJob(OSError):
    """The directory is held by another job (a one-line user error)."""


class LockFileError(OSError):
    """The lock file cannot be made (a one-line user error: the path, and why)."""


def lock_path(path: str | Path) -> Path:
    """The lock file of ``path``, beside the directory it names once symlinks and ``..`` are
    resolved: a job given ``outputs/link`` (a symlink to ``outputs/run``) and a job given
    ``outputs/run`` write into one directory, so they must take one lock. Callers check
    the path first (``minihf.trainer.common.check_run_dir``); what slips through is still
    one line here, a ``LockFileError``."""
    try:
        resolved = resolve_links(path)
    except (RuntimeError, OSError) as exc:  # a symlink loop
        raise LockFileError(f"{path} cannot be resolved ({exc}); fix the symlinks or choose "
                            "another path") from None
    if resolved == resolved.parent:
        raise LockFileError(f"{path} is the filesystem root; choose a directory in it")
    return resolved.with_name(f".{resolved.name}.lock")


def _holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("started", 0)))
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {started}"
            f" ({info.get('command', '?')})")


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return {"host": "?", "pid": "?", "command": f"unreadable lock file content {raw[:40]!r}"}


def _alive_here(info: dict) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # cannot be checked from here: assume it lives
    try:
        os.kill(int(info["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError, TypeError):
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def _open(lock: Path, what: str) -> int:
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise LockFileError(f"{what}: cannot create its lock file {lock} ({exc.strerror or exc}); "
                            "choose a path you can write to") from None


class _Held:
    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.count = path, fd, 1


_held: dict[Path, _Held] = {}


def acquire(path: str | Path, what: str, fix: str, log=print) -> None:
    """Hold ``path`` for this process (re-entrant), or raise ``HeldByAnotherJob`` naming
    ``what`` (e.g. ``trainer.default_local_dir=outputs/grpo_sort``), the holder and ``fix``."""
    lock = lock_path(path)
    if lock in _held:
        _held[lock].count += 1
        return
    while True:
        fd = _open(lock, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_holder(fd) or {}
            os.close(fd)
            raise HeldByAnotherJob(f"{what} is in use by another job: {_holder_text(info)}; {fix}") from None
        except OSError as exc:
            if exc.errno not in UNSUPPORTED:
                os.close(fd)
                raise
            info = _read_holder(fd)  # no locking on this filesystem: the recorded holder decides
            if info is not None and _alive_here(info) and info.get("pid") != os.getpid():
                os.close(fd)
                raise HeldByAnotherJob(
                    f"{what} is in use by another job: {_holder_text(info)}; {fix} (this filesystem "
                    f"has no file locking: if that job is gone, delete {lock})") from None
        try:  # the file may have been released (removed) between our open and our lock
            if os.fstat(fd).st_ino != os.stat(lock).st_ino:
                raise FileNotFoundError
        except FileNotFoundError:
            os.close(fd)
            continue
        break
    stale = _read_holder(fd)
    if stale is not None:
        log(f"[minihf] {what}: took over the lock {lock} of a job that ended without "
            f"releasing it ({_holder_text(stale)})")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
          "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:80]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    _held[lock] = _Held(lock, fd)


def release(path: str | Path) -> None:
    """Give up one hold of ``path``; the last one removes the lock file."""
    try:
        lock = lock_path(path)
    except LockFileError:  # never held: a release in a ``finally`` must not hide the error
        return
    held = _held.get(lock)
    if held is None:
        return
    held.count -= 1
    if held.count == 0:
        _drop(_held.pop(lock))


def _drop(held: _Held) -> None:
    with contextlib.suppress(OSError):
        os.unlink(held.path)  # while still locked: a waiter re-checks the inode
    os.close(held.fd)


def release_all() -> None:
    """Every lock of this process (a job ending through ``os._exit``)."""
    while _held:
        _drop(_held.popitem()[1])


@contextlib.contextmanager
def hold(path: str | Path, what: str, fix: str, log=print):
    """``acquire`` for the block."""
    acquire(path, what, fix, log)
    try:
        yield
    finally:
        release(path)
