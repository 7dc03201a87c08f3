"""The multi-process test harness itself: results come back, failures and hangs are reported;
a job process skips the final GC pass at exit (``skip_final_gc``)."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from minihf.testing import SpawnError, spawn_ranks


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness killing it
    return rank


def test_spawn_collects_results():
    assert spawn_ranks(_allreduce, 2) == [3.0, 3.0]


def test_spawn_reports_failing_rank_traceback():
    with pytest.raises(SpawnError, match="rank 1 of 2 failed(.|\n)*boom on rank one"):
        spawn_ranks(_raise_on_one, 2, timeout_s=60, pg_timeout_s=20)


EXIT_PROBE = """
import atexit, gc
freezes = []
real_freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), real_freeze())  # counts the calls, still freezes
atexit.register(lambda: print("freezes:", len(freezes), "frozen:", gc.get_freeze_count() > 0))  # runs last
from minihf.utils.process_exit import skip_final_gc
skip_final_gc()
skip_final_gc()  # a process running several jobs freezes once
"""


def test_skip_final_gc_freezes_the_objects_alive_at_exit_once():
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "freezes: 1 frozen: True", out.stdout
