"""The built-in ``python`` tool: model-written code in an isolated process tree.

**Isolated** (the default, ``rollout.multi_turn.sandbox=isolated``): each call runs under
``unshare`` (util-linux, present on every Linux distribution) in its own PID, network,
mount, IPC and UTS namespaces. Inside, before the code starts:

* the filesystem is a new root holding read-only binds of what Python needs (``/usr``,
  ``/etc``, the interpreter's prefix), ``/dev/null|zero|random|urandom``, a ``/proc`` that
  shows only the sandbox's processes, and a private writable ``/tmp`` (tmpfs, ``disk_mb`` in
  all): the trainer's files, run dir, processes and environment are out of sight;
* no network: the namespace has a loopback device, down;
* the code runs as a uid of the call's own, no account's (when the trainer runs as root:
  ``_call_uid``), with no capabilities and
  ``no_new_privs``, under rlimits on CPU seconds, address space, processes, file size and
  open files;
* when the call ends, the namespace's first process exits or is killed, and the kernel kills
  every process left in it (a daemon, a new session, a fork bomb's children).

The code reaches the child through a pipe and its output comes back through pipes the
caller owns, read with a byte cap (``output_bytes``) and a deadline (``wall_s``): nothing
the code does can block the caller, fill its memory or make it raise. Whatever happens, the
model reads stdout or an ``error: ...`` observation and the job goes on.

What isolation does not cover: the code can read world-readable files under the bound
directories (``/usr``, ``/etc``, the Python prefix), and its memory is bounded per process
(``memory_mb`` x ``processes`` for the tree), not by a cgroup. An audit hook (refusing
process creation, ``ctypes``, ``setrlimit`` and signals) stays as a second line of defence,
not as the boundary.

**process** (``rollout.multi_turn.sandbox=process``), for hosts without namespaces (a
locked-down container, another OS): the same rlimits, the audit hook and an empty
environment in a fresh process group, nothing more. There the code can read and write any
file the trainer's user can, open network connections, and signal the trainer's processes
(``pidfd_send_signal`` is not audited).
Without namespaces the tool refuses to start (``check``) unless this mode is chosen.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from contextlib import contextmanager

from minihf.utils.threads import sandbox_env

LIMITS = {"wall_s": 10.0, "cpu_s": 5, "memory_mb": 1024, "output_bytes": 1 << 16, "open_files": 64,
          "processes": 8, "disk_mb": 16}
MODES = ("isolated", "process")
NOBODY = 65534
# As root, each call in flight runs as a uid of its own, unused by any account: the kernel
# counts RLIMIT_NPROC per uid over the whole host, so under one shared uid (nobody) the
# concurrent calls of a batch shared one process limit and a call's threads failed or not
# with its batch-mates. Slot ``s`` of process ``pid``: UID_BASE + (pid mod 2^20) * 2^10 + s.
UID_BASE, UID_SLOTS = 1 << 30, 1 << 10
_free_slots = list(range(UID_SLOTS))
_slots_lock = threading.Lock()
KILLED = "minihf-sandbox: killed by signal "  # the namespace's first process reports a signal

# the child's first Python: limits, then the audit hook, then the code read from stdin
_LAUNCHER = r'''
import os, resource, sys
LIMITS, WORKDIR = {limits!r}, {workdir!r}
code = sys.stdin.buffer.read({code_cap})
os.close(0)
os.chdir(WORKDIR)
for name, soft, hard in LIMITS:
    resource.setrlimit(getattr(resource, name), (soft, hard))
blocked = {{"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
           "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit"}}
def guard(event, args, blocked=frozenset(blocked)):
    if event in blocked:
        raise PermissionError(f"the python tool does not allow {{event}}")
sys.addaudithook(guard)
del guard, blocked, name, soft, hard, resource, LIMITS, WORKDIR
exec(compile(code, "code.py", "exec"), {{"__name__": "__main__"}})
'''

# runs as the PID namespace's first process (root in the new mount namespace): builds the
# new root under a tmpfs that hides the host's /tmp in this namespace only, runs the
# launcher (chroot, then setpriv: drop the user, capabilities and new privileges) and
# names the signal that ended it, if one did (the code cannot signal this root process;
# when it exits, the kernel ends every process left in the namespace)
_SETUP = r'''
set -eu
prefix=$1; uid=$2; disk=$3; python=$4; shift 4
mount -t tmpfs -o size=1m,mode=755 minihf-host-tmp /tmp
r=/tmp/root
mkdir $r
mount -t tmpfs -o size=1m,mode=755 minihf-root $r
for d in usr bin sbin lib lib32 lib64 libx32 etc; do
  if [ -L /$d ]; then ln -s "$(readlink /$d)" $r/$d
  elif [ -d /$d ]; then mkdir $r/$d; mount --bind -o ro /$d $r/$d; fi
done
case "$prefix" in
  /usr|/usr/*|/etc/*) ;;
  *) mkdir -p "$r$prefix"; mount --bind -o ro "$prefix" "$r$prefix" ;;
esac
mkdir $r/dev $r/proc $r/tmp
for n in null zero random urandom; do touch $r/dev/$n; mount --bind /dev/$n $r/dev/$n; done
mount -t proc -o nosuid,nodev,noexec minihf-proc $r/proc
mount -t tmpfs -o size=$disk,mode=1777,nosuid,nodev minihf-work $r/tmp
mount -o remount,ro,bind $r
if [ "$uid" = keep ]; then user=""; else user="--reuid=$uid --regid=$uid --clear-groups"; fi
status=0
chroot $r setpriv $user --no-new-privs --inh-caps=-all --bounding-set=-all -- \
  env -i "$@" "$python" -I -S -c "$LAUNCHER" || status=$?
if [ $status -gt 128 ]; then echo "minihf-sandbox: killed by signal $((status - 128))" >&2; fi
exit $status
'''


def _base_python() -> tuple[str, str]:
    """The interpreter a sandbox runs (the base one: a virtualenv's site-packages stay out)
    and the prefix holding it and its standard library."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _unshare_argv() -> list[str]:
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--mount",
            "--propagation", "private"]
    if os.geteuid() != 0:  # an unprivileged user namespace, where the host allows them
        argv += ["--user", "--map-root-user"]
    return argv


@functools.cache
def isolation_missing() -> str | None:
    """Why isolated runs cannot work on this host (None: they can), found by running one."""
    if not sys.platform.startswith("linux"):
        return f"namespaces are a Linux feature and this is {sys.platform}"
    for tool in ("unshare", "setpriv", "chroot", "mount"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"the {tool!r} command (util-linux) is not installed"
    out = run_python("print(6 * 7)", mode="isolated", wall_s=30.0)
    if out.strip() != "42":
        return f"a trial run failed: {out.strip()[:300]}"
    return None


def check(mode: str) -> None:
    """Before a job uses the tool: a ValueError naming the setting when ``mode`` is unknown,
    or isolated runs are impossible here."""
    if mode not in MODES:
        raise ValueError(f"rollout.multi_turn.sandbox={mode!r}; choose isolated (namespaces, the default) or "
                         "process (rlimits and an audit hook only)")
    if mode == "isolated":
        why = isolation_missing()
        if why is not None:
            raise ValueError(
                f"the python tool runs model-written code in Linux namespaces (unshare), and this host cannot: "
                f"{why}. Allow them (root, or unprivileged user namespaces: sysctl "
                "kernel.unprivileged_userns_clone=1), or set rollout.multi_turn.sandbox=process to accept the "
                "weaker mode (the code can then read and write the trainer's files and use the network: "
                "docs/multi-turn.md)")


_mode = "isolated"


def configure(mode: str, verify: bool = True) -> None:
    """Set the mode of ``run_python`` (the ``python`` tool's) in this process, ``check``-ed
    first (``verify=False``: only a known name; a run without the built-in tool does not
    need namespaces until its own code calls ``run_python``)."""
    global _mode
    if verify:
        check(mode)
    elif mode not in MODES:
        raise ValueError(f"rollout.multi_turn.sandbox={mode!r}; choose one of {MODES}")
    _mode = mode


def _limits(cfg: dict) -> list[tuple[str, int, int]]:
    mem, cpu = cfg["memory_mb"] << 20, int(cfg["cpu_s"])  # past the soft CPU limit SIGXCPU, then SIGKILL
    return [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", mem, mem),
            ("RLIMIT_FSIZE", cfg["disk_mb"] << 20, cfg["disk_mb"] << 20),
            ("RLIMIT_NOFILE", cfg["open_files"], cfg["open_files"]),
            ("RLIMIT_NPROC", cfg["processes"], cfg["processes"]), ("RLIMIT_CORE", 0, 0)]


@contextmanager
def _call_uid():
    """The uid a call runs as, held while it runs: as root, one of this process's own
    (nobody when all are in use); otherwise the caller's, mapped to root in a user
    namespace of the call's own (where the kernel counts the call's processes apart)."""
    if os.geteuid() != 0:
        yield "keep"
        return
    with _slots_lock:
        slot = _free_slots.pop() if _free_slots else None
    try:
        yield str(NOBODY if slot is None else UID_BASE + (os.getpid() % (1 << 20)) * UID_SLOTS + slot)
    finally:
        if slot is not None:
            with _slots_lock:
                _free_slots.append(slot)


def _argv(cfg: dict, mode: str, code_cap: int, workdir: str | None, uid: str) -> tuple[list[str], dict | None]:
    python, prefix = _base_python()
    env = [f"{k}={v}" for k, v in {**sandbox_env(), "HOME": "/tmp", "PATH": "/usr/bin:/bin"}.items()]
    if mode == "isolated":
        launcher = _LAUNCHER.format(limits=_limits(cfg), workdir="/tmp", code_cap=code_cap)
        return ([*_unshare_argv(), "env", f"LAUNCHER={launcher}", "sh", "-c", _SETUP, "sh", prefix, uid,
                 f"{cfg['disk_mb']}m", python, *env], {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    launcher = _LAUNCHER.format(limits=_limits(cfg), workdir=workdir, code_cap=code_cap)
    return [python, "-I", "-S", "-c", launcher], dict(e.split("=", 1) for e in env)


def _read(proc: subprocess.Popen, code: bytes, cap: int, deadline: float) -> tuple[bytes, bytes, str | None]:
    """Feed ``code`` and read stdout and stderr until both close, the deadline passes or
    stdout passes ``cap`` bytes; (stdout, stderr's last 4 KB, why it was stopped or None)."""
    out, err, stopped = bytearray(), bytearray(), None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    os.set_blocking(proc.stdin.fileno(), False)
    pending = memoryview(code)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    open_reads = 2
    while open_reads and stopped is None:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = "wall"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            if key.data == "in":
                try:
                    pending = pending[os.write(proc.stdin.fileno(), pending[:1 << 16]):]
                except (BrokenPipeError, BlockingIOError) as exc:
                    pending = pending[:0] if isinstance(exc, BrokenPipeError) else pending
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fileobj.fileno(), 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
                open_reads -= 1
            elif key.data == "out":
                out += chunk
                if len(out) > cap:
                    stopped = "output"
            else:
                err = (err + chunk)[-4096:]
    sel.close()
    return bytes(out[:cap]), bytes(err), stopped


def _stop(proc: subprocess.Popen) -> None:
    """Kill the call's process tree: its process group, ended or not (what the code left in
    it, in the process mode; isolated, ``unshare`` passes the kill to the namespace's first
    process, whose exit ends every process in the namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


def _remove(path: str) -> None:
    """Remove the process mode's working directory, however deep the code nested it
    (``shutil.rmtree`` recurses, and 3000 levels pass Python's recursion limit)."""
    try:
        shutil.rmtree(path)
    except (OSError, RecursionError):
        subprocess.run(["rm", "-rf", path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name in the enum
        return f"signal {number}"


def run_python(code: str, mode: str | None = None, **limits) -> str:
    """Run ``code`` under :data:`LIMITS` (overridden by ``limits``) in ``mode`` (this
    process's configured mode by default); its stdout, or an ``error: ...`` line saying what
    went wrong, with the end of its stderr. Never raises for anything the code does."""
    cfg = {**LIMITS, **limits}
    mode = mode or _mode
    if mode not in MODES:
        raise ValueError(f"run_python(mode={mode!r}): choose one of {MODES}")
    data = code.encode("utf-8", errors="replace")
    with _call_uid() as uid:
        return _run(cfg, mode, data, uid)


def _run(cfg: dict, mode: str, data: bytes, uid: str) -> str:
    workdir = tempfile.mkdtemp(prefix="minihf-python-") if mode == "process" else None
    try:
        argv, env = _argv(cfg, mode, len(data), workdir, uid)
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as exc:
            return f"error: the sandbox could not start ({exc})"
        deadline = time.monotonic() + cfg["wall_s"]
        try:
            stdout, stderr, stopped = _read(proc, data, cfg["output_bytes"], deadline)
            if stopped is None:  # its output closed: it may still run (a process that closed fds 1 and 2)
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    stopped = "wall"
        finally:
            _stop(proc)
    finally:
        if workdir is not None:
            _remove(workdir)
    text = stdout.decode(errors="replace")
    tail = stderr.decode(errors="replace").strip()
    if stopped == "wall":
        return f"error: the code ran past {cfg['wall_s']} s and was stopped"
    if stopped == "output":
        return f"error: the code printed more than {cfg['output_bytes']} bytes and was stopped\n{text}"
    status, lines = proc.returncode, tail.splitlines()
    if lines and lines[-1].startswith(KILLED):
        status = -int(lines[-1][len(KILLED):])
        tail = "\n".join(lines[:-1]).strip()
    if status < 0:
        name = _signal_name(-status)
        why = {"SIGXCPU": f"it used more than {cfg['cpu_s']} s of CPU",
               "SIGXFSZ": f"it wrote a file past {cfg['disk_mb']} MB",
               "SIGKILL": "it was killed (CPU or memory limit)"}.get(name, f"it died of {name}")
        return f"error: {why}" + (f"\n{text}" if text else "")
    if status != 0:
        last = tail.splitlines()[-1] if tail else f"exit status {status}"
        return f"error: {last}" + (f"\n{text}" if text else "")
    return text


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout). It runs alone: no network, no
    other processes, no files kept after the call (a private /tmp of 16 MB is the working
    directory); the standard library only; 5 s of CPU, 10 s in all, 1 GB of memory.

    Args:
        code: the program, e.g. print(sum(range(10)))
    """
    return run_python(code)
