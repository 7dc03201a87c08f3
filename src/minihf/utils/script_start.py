"""What a script does first, before its imports (torch, transformers) take seconds.

``scripts/train_*.py`` import this module before anything else (for its effect):

* Ctrl-C in those seconds is one line and exit 130, not an import traceback per rank;
  ``minihf.controller.run_script`` gives Ctrl-C back to Python (``KeyboardInterrupt``) as
  the job starts, and the job reports an interrupt itself from there (``restore``);
* under torchrun, Linux kills this rank when its launcher dies (``die_with_launcher``):
  a torchrun SIGKILLed in those seconds left its ranks waiting for a rendezvous that could
  not come, up to ``controller.timeout_s`` (10 minutes by default), holding its output
  pipes open.
"""

from __future__ import annotations

import os
import signal
import sys


def _quit(signum, frame):
    sys.stderr.write("[minihf] interrupted (SIGINT) while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def restore() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` again (a no-op if this module's handler is not set)."""
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


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _quit)
die_with_launcher()
