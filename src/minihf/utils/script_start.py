"""What a script does first, before its imports (torch, transformers) take seconds.

``scripts/train_*.py`` import this module before anything else, for its effect (the library never
imports it: a notebook's Ctrl-C and process stay its own; the functions live in
``minihf.utils.process_exit``):

* Ctrl-C in those seconds is one line and exit 130, not an import traceback per rank;
  ``minihf.controller.run_script`` gives Ctrl-C back to Python (``KeyboardInterrupt``) as
  the job starts, and the job reports an interrupt itself from there;
* under torchrun, Linux kills this rank when its launcher dies (``die_with_launcher``):
  a torchrun SIGKILLed in those seconds left its ranks waiting for a rendezvous that could
  not come, up to ``controller.timeout_s`` (10 minutes by default), holding its output
  pipes open.
"""

from __future__ import annotations

from minihf.utils.process_exit import die_with_launcher, quiet_ctrl_c_while_starting

quiet_ctrl_c_while_starting()
die_with_launcher()
