"""The launch helper as scripts use it: `python` (one process) and real torchrun jobs."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from minihf.utils.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def _torchrun():
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def _run(cmd, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_train_ppo_smoke_one_process():
    proc, _ = _run([sys.executable, "scripts/train_ppo.py"])
    assert proc.returncode == 0, proc.stderr
    assert "row sums: [6.0, 24.0, 42.0, 60.0, 78.0]" in proc.stdout
    assert "controller smoke job OK" in proc.stdout


def test_train_ppo_smoke_torchrun_two_ranks():
    proc, _ = _run(_torchrun() + ["scripts/train_ppo.py"])
    assert proc.returncode == 0, proc.stderr
    assert "double rank 1 (role rank 1/2, dp 1/2" in proc.stdout
    assert "group totals over 2 rank(s): [3.0, 3.0]" in proc.stdout
    assert "controller smoke job OK" in proc.stdout


FAILING_JOB = """
from minihf.controller import Dispatch, Worker, launch, register

class Bad(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def boom(self):
        if self.rank == 1:
            raise KeyError("broken on purpose")
        return self.rank

def driver(groups):
    groups["bad"].boom()

launch(driver, {"bad": Bad})
print("launch returned")  # must not be reached on any rank
"""


def test_worker_error_ends_torchrun_job_non_zero(tmp_path):
    script = tmp_path / "failing_job.py"
    script.write_text(textwrap.dedent(FAILING_JOB))
    proc, elapsed = _run(_torchrun() + [str(script)])
    assert proc.returncode != 0
    assert "launch returned" not in proc.stdout
    assert "RemoteError: bad.boom failed on rank 1" in proc.stderr
    assert "KeyError: 'broken on purpose'" in proc.stderr
    assert elapsed < 60
