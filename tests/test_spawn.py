"""The multi-process test harness itself: results come back, failures and hangs are reported,
ranks see the caller's environment and output at the call (they fork from a server started
earlier); a job process skips the final GC pass at exit (``skip_final_gc``)."""

import os
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


AT_IMPORT = os.environ.get("SPAWN_PROBE")  # what a rank read when it imported this module


def _report(rank, world_size):
    print(f"rank {rank} says {os.environ.get('SPAWN_PROBE')}\n", end="", flush=True)  # one write:
    print(f"rank {rank} to stderr\n", end="", file=sys.stderr, flush=True)  # the ranks' lines whole
    return os.getppid(), AT_IMPORT


def test_ranks_see_the_callers_environment_and_output_at_the_call(monkeypatch, tmp_path):
    """The fork server (Linux) starts at the first call, with the environment and stdout of
    then: the second call's ranks still get the variable set after it, and print where the
    caller's stdout and stderr point at the second call."""
    first = spawn_ranks(_report, 2)
    monkeypatch.setenv("SPAWN_PROBE", "hello")
    saved = os.dup(1), os.dup(2)
    files = [open(tmp_path / name, "w") for name in ("out", "err")]
    try:
        for f, fd in zip(files, (1, 2)):
            os.dup2(f.fileno(), fd)
        again = spawn_ranks(_report, 2)
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        for f in files:
            f.close()
    out, err = ((tmp_path / name).read_text().splitlines() for name in ("out", "err"))
    assert sorted(out) == ["rank 0 says hello", "rank 1 says hello"], out
    assert sorted(err) == ["rank 0 to stderr", "rank 1 to stderr"], err
    assert [seen for _, seen in again] == ["hello", "hello"]  # at the import of fn's module too
    if sys.platform == "linux":  # both calls' ranks are children of the one fork server
        parents = {parent for parent, _ in first + again}
        assert len(parents) == 1 and os.getpid() not in parents


def test_spawn_method_can_be_chosen_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("MINIHF_SPAWN_METHOD", "spawn")  # every rank a fresh child of this process
    assert spawn_ranks(_report, 2) == [(os.getpid(), None)] * 2
    monkeypatch.setenv("MINIHF_SPAWN_METHOD", "fork")
    with pytest.raises(ValueError, match="MINIHF_SPAWN_METHOD='fork': use one of forkserver, spawn"):
        spawn_ranks(_report, 2)


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
