"""The controller when a rank fails outright: a worker rank that dies mid-call, and a driver
that freezes (alive but silent). Both must end the job within the timeout, never hang."""

import functools
import os
import signal
import time

import pytest

from minihf.controller import ControllerError, RankLostError, RemoteError, run
from minihf.controller.config import ControllerConfig
from minihf.testing import SpawnError, spawn_ranks

from test_controller import EchoWorker


def _killed_driver(groups, path):
    t0 = time.monotonic()
    try:
        groups["a"].die_on(1)
        msg = "no error"
    except RemoteError as e:
        msg = f"{type(e).__name__} rank={e.rank} method={e.method}"
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - t0:.3f} {msg}")


def _killed(rank, world_size, path):
    try:  # rank 0 reports normally, so the harness reports rank 1's death
        run(functools.partial(_killed_driver, path=path), {"a": EchoWorker},
            ControllerConfig(timeout_s=10))
    except RankLostError:  # STOP cannot reach the dead rank
        pass


def test_killed_rank_raises_on_driver_within_timeout(tmp_path):
    path = tmp_path / "driver.txt"
    with pytest.raises(SpawnError, match="died"):
        spawn_ranks(_killed, 2, str(path), timeout_s=60)
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    elapsed, msg = path.read_text().split(" ", 1)
    assert msg == f"{RankLostError.__name__} rank=1 method=die_on"
    assert float(elapsed) < 10


def _frozen_driver(groups, path):
    groups["w"].nap(0.0).result()
    with open(path + ".driver", "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: no heartbeat any more


def _frozen(rank, world_size, path):
    t0 = time.monotonic()
    try:
        run(functools.partial(_frozen_driver, path=path), {"w": EchoWorker},
            ControllerConfig(timeout_s=1.0))
    except ControllerError as e:  # rank 1 only: rank 0 never gets here
        with open(path, "w") as f:
            f.write(f"{time.monotonic() - t0:.3f} {e}")
        with open(path + ".driver") as f:
            os.kill(int(f.read()), signal.SIGKILL)  # end the frozen driver


def test_frozen_driver_is_detected_by_the_missing_heartbeat(tmp_path):
    path = str(tmp_path / "worker.txt")
    with pytest.raises(SpawnError, match=r"\{0: -9\}"):  # the worker ended the driver
        spawn_ranks(_frozen, 2, path, timeout_s=60)
    elapsed, msg = open(path).read().split(" ", 1)
    assert "heard nothing from the driver (rank 0), not even its heartbeat" in msg
    assert 0.9 < float(elapsed) < 8
