"""The built-in ``python`` tool: model-written code in a limited subprocess.

Each call runs ``python -I`` (isolated: no user site, no ``PYTHON*`` variables) with an
environment holding only one thread per numeric library (``OMP_NUM_THREADS=1`` and its
kin: a call must not start a full team of threads beside the rank's own) in a fresh temporary working directory that is deleted afterwards, in a
new process group, under resource limits: CPU seconds, address space, the size of any file
it writes (stdout and stderr go to files, so a flood stops at the limit instead of filling
the parent's memory) and open files. An audit hook installed before the code runs refuses
process creation (fork, exec, spawn, ``subprocess``, ``os.system``) and loading native code
through ``ctypes``, which is what a fork bomb or a jump past the limits needs; ``RLIMIT_NPROC``
is set too but does not bind root. Past the wall-clock limit the whole process group is
killed. Whatever happens (an infinite loop, a fork bomb, a 10 GB allocation, a segfault,
output flooding) the model reads an ``error: ...`` observation and the job goes on
(docs/reliability.md).

This is a guard against a policy's mistakes and accidents, not against a determined
adversary: run untrusted tools in a container or a VM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from minihf.utils.threads import sandbox_env

LIMITS = {"wall_s": 10.0, "cpu_s": 5, "memory_mb": 1024, "output_bytes": 1 << 16, "open_files": 64}

# runs first in the child: its own limits (no preexec_fn: the parent has threads), then an
# audit hook that refuses new processes, native code and raising the limits again (root could)
_PRELUDE = r'''
import resource, sys
for _name, _soft, _hard in LIMITS:
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
_BLOCKED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
            "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit"}
def _guard(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"the python tool does not allow {event}")
sys.addaudithook(_guard)
del _guard, _name, _soft, _hard, resource
_code = open("code.py").read()
exec(compile(_code, "code.py", "exec"), {"__name__": "__main__"})
'''


def _prelude(cfg: dict) -> str:
    mem = cfg["memory_mb"] << 20
    cpu = cfg["cpu_s"]  # past the soft limit SIGXCPU (reported), a second later SIGKILL
    limits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", mem, mem),
              ("RLIMIT_FSIZE", cfg["output_bytes"], cfg["output_bytes"]),
              ("RLIMIT_NOFILE", cfg["open_files"], cfg["open_files"]), ("RLIMIT_NPROC", 32, 32),
              ("RLIMIT_CORE", 0, 0)]
    return f"LIMITS = {limits!r}\n" + _PRELUDE


def run_python(code: str, **limits) -> str:
    """Run ``code`` under :data:`LIMITS` (overridden by ``limits``); its stdout, or an
    ``error: ...`` line with what went wrong and the end of its stderr."""
    cfg = {**LIMITS, **limits}
    with tempfile.TemporaryDirectory(prefix="minihf-python-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        (Path(tmp) / "main.py").write_text(_prelude(cfg))
        (Path(tmp) / "code.py").write_text(code)
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen([sys.executable, "-I", "main.py"], cwd=tmp, env=sandbox_env(),
                                    stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, start_new_session=True)
            try:
                code_ = proc.wait(timeout=cfg["wall_s"])
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: whatever it started dies too
                except ProcessLookupError:
                    pass
                proc.wait()
                code_ = proc.returncode
        stdout = out.read_bytes()[: cfg["output_bytes"]].decode(errors="replace")
        stderr = err.read_bytes()[-2000:].decode(errors="replace").strip()
    if timed_out:
        return f"error: the code ran past {cfg['wall_s']} s and was stopped"
    if code_ < 0:
        name = signal.Signals(-code_).name
        why = {"SIGXCPU": f"it used more than {cfg['cpu_s']} s of CPU",
               "SIGXFSZ": f"it wrote more than {cfg['output_bytes']} bytes of output",
               "SIGKILL": "it was killed"}.get(name, f"it died of {name}")
        return f"error: {why}" + (f"\n{stdout}" if stdout else "")
    if code_ != 0:
        last = stderr.splitlines()[-1] if stderr else f"exit status {code_}"
        return f"error: {last}" + (f"\n{stdout}" if stdout else "")
    return stdout


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout). No network, no files kept, no
    subprocesses; a few seconds and 1 GB at most.

    Args:
        code: the program, e.g. print(sum(range(10)))
    """
    return run_python(code)
