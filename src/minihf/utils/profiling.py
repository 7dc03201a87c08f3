"""``trainer.profile_steps``: torch.profiler over chosen RL steps, one trace per process.

The driver asks every role's workers to start a profile before such a step and to stop it
after (``Worker.start_profile`` / ``stop_profile``). The profiler is per process, and
colocated roles share one, so the first start in a process profiles it and the others are
no-ops; the first stop writes, into ``<run dir>/profile/step_<N>/``:

* ``rank<R>.json``: the Chrome trace (chrome://tracing or https://ui.perfetto.dev), every
  thread of the process: the driver's on rank 0, the worker's everywhere;
* ``rank<R>.txt``: the ops by their own time, most first (the device's time on CUDA,
  the CPU's otherwise), with how often each ran: a first look without a trace viewer.

CUDA kernels are recorded where the process has a GPU. A profiled step runs slower than
the others (the profiler records every op), and its ``timing_s/*`` say so.
"""

from __future__ import annotations

from pathlib import Path

import torch

TABLE_ROWS = 40
_active: dict = {}  # this process's profile: {"prof", "dir", "name", "cuda"}


def start(out_dir: str | Path, name: str, cuda: bool) -> bool:
    """Start profiling this process into ``out_dir`` (files ``<name>.json/.txt``); False if a
    profile is already running here (a colocated role started it)."""
    if _active:
        return False
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, record_shapes=False)
    prof.start()
    _active.update(prof=prof, dir=Path(out_dir), name=name, cuda=cuda)
    return True


def stop() -> str | None:
    """Stop this process's profile and write its trace and table; the table's path, or
    None where no profile was running (a colocated role's stop wrote it already)."""
    if not _active:
        return None
    prof, out, name, cuda = (_active.pop(k) for k in ("prof", "dir", "name", "cuda"))
    if cuda:
        torch.cuda.synchronize()
    prof.stop()
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"{name}.json"))
    table = out / f"{name}.txt"
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table.write_text(prof.key_averages().table(sort_by=key, row_limit=TABLE_ROWS) + "\n")
    return str(table)


def check_steps(steps: list, total_steps: int | None = None) -> list[int]:
    """``trainer.profile_steps`` as a sorted list of distinct steps (1-based); a clear
    error for anything else, and for a step past ``total_steps`` when given."""
    if not isinstance(steps, (list, tuple)):
        raise ValueError(f"trainer.profile_steps must be a list of step numbers (e.g. [2, 50]), got {steps!r}")
    bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"trainer.profile_steps holds {bad}: steps are integers from 1 (the first step); "
                         "e.g. trainer.profile_steps=[2]")
    late = [s for s in steps if total_steps is not None and s > total_steps]
    if late:
        raise ValueError(f"trainer.profile_steps {late} lie past this run's last step ({total_steps}); "
                         "name steps the run reaches")
    return sorted(set(steps))
