"""A script's process: how it starts and ends (``minihf.utils.script_start`` applies the first
part; the Python entry points, ``minihf.train``, apply none of it).

Ending a job's process without CPython's last garbage-collection pass.

When the interpreter shuts down it tears down its modules and runs a full cyclic-GC pass
over every object still alive. After a job (torch's and transformers' modules, a model,
optimizer state) that pass took ~1.4 s of the ~1.7 s a process spent exiting here (a 2-step
GRPO job on the tiny model, 2 cores), for every rank, and a torchrun job ends when its
slowest rank does. :func:`skip_final_gc` has ``gc.freeze()`` run at exit: what is alive then
moves to the permanent generation, which that pass does not scan.

Nothing is lost: reference counting still frees objects as the modules go, the files minihf
writes are closed where they are written (``with`` blocks, trackers closed by the trainer),
and the process's memory goes back to the OS as always. Only ``__del__`` of objects caught in
reference cycles at exit may not run, which CPython does not promise anyway.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys


def skip_final_gc() -> None:
    """Freeze the objects alive at exit so shutdown skips the final GC pass (idempotent)."""
    atexit.unregister(gc.freeze)  # one registration however many jobs this process runs
    atexit.register(gc.freeze)


def _quit(signum, frame):
    sys.stderr.write("[minihf] interrupted (SIGINT) while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def quiet_ctrl_c_while_starting() -> None:
    """Ctrl-C exits 130 with one line (``_quit``) until ``restore_ctrl_c``; only where Ctrl-C
    still raises ``KeyboardInterrupt`` (a handler of the caller's own is kept)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quit)


def restore_ctrl_c() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` again (a no-op if ``_quit`` is not the handler)."""
    if signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def die_with_launcher() -> None:
    """Under torchrun, have Linux SIGKILL this worker when its launcher dies (a SIGKILLed
    torchrun cannot stop its workers, which would otherwise run on as orphans)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        return  # best effort: the controller's timeouts still end the job
    if os.getppid() != parent:  # the launcher died before the request was in place
        os._exit(1)
