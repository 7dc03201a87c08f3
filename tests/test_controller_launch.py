"""The launch helper as scripts use it: `python` (one process) and real torchrun jobs.

torchrun runs ``--standalone``: its rendezvous store binds a port the OS picks, so no port
chosen in advance can be taken by another process before the job binds it. Each job gets
a generous deadline (CI is a loaded 2-core box: a job takes ~4 s idle, ~15 s loaded); on
a failure or a timeout the assertion shows the job's full stdout and stderr.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--local-addr=127.0.0.1", "--nproc_per_node=2"]


class Job:
    """A finished job: return code, output, wall time; ``log`` (all of it) for assert messages
    (a str: pytest would shorten any other object's repr)."""

    def __init__(self, cmd, returncode, stdout, stderr, elapsed):
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr
        self.elapsed = elapsed

    @property
    def log(self) -> str:
        return (f"job {' '.join(map(str, self.cmd))}\nexit {self.returncode} after "
                f"{self.elapsed:.1f}s\n--- stdout ---\n{self.stdout}\n"
                f"--- stderr ---\n{self.stderr}")


def _run(cmd, timeout=300) -> Job:
    """Run ``cmd``; past ``timeout`` stop it (torchrun's workers too, not only the agent)
    and return what it printed, with returncode None."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes SIGTERM on to its workers (own sessions)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        code, err = None, err + f"\n[test] stopped after the {timeout}s deadline"
    return Job(cmd, code, out, err, time.monotonic() - t0)


def test_train_ppo_smoke_one_process():
    job = _run([sys.executable, "scripts/train_ppo.py"])
    assert job.returncode == 0, job.log
    assert "row sums: [6.0, 24.0, 42.0, 60.0, 78.0]" in job.stdout, job.log
    assert "controller smoke job OK" in job.stdout, job.log


def test_train_ppo_smoke_torchrun_two_ranks():
    job = _run(TORCHRUN + ["scripts/train_ppo.py"])
    assert job.returncode == 0, job.log
    assert "double rank 1 (role rank 1/2, dp 1/2" in job.stdout, job.log
    assert "group totals over 2 rank(s): [3.0, 3.0]" in job.stdout, job.log
    assert "controller smoke job OK" in job.stdout, job.log


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
    job = _run(TORCHRUN + [str(script)])
    assert job.returncode not in (0, None), job.log
    assert "launch returned" not in job.stdout, job.log
    assert "RemoteError: bad.boom failed on rank 1" in job.stderr, job.log
    assert "KeyError: 'broken on purpose'" in job.stderr, job.log
    assert job.elapsed < 200, job  # ends at once, not after the 600 s default timeout_s


USER_ERROR_JOB = """
from minihf.controller import Worker, launch

def load_rows(path):
    raise FileNotFoundError(f"data file {path} does not exist; check data.train_files")

def driver(groups):
    load_rows("missing.parquet")

launch(driver, {"w": Worker})
"""


def test_user_error_in_driver_prints_one_line_not_a_traceback(tmp_path):
    script = tmp_path / "user_error_job.py"
    script.write_text(textwrap.dedent(USER_ERROR_JOB))
    job = _run([sys.executable, str(script)])
    assert job.returncode == 1, job.log
    assert ("FileNotFoundError: data file missing.parquet does not exist; check "
            "data.train_files") in job.stderr, job.log
    assert f"raised at {script}:5 (in load_rows)" in job.stderr, job.log
    assert "Traceback" not in job.stderr, job.log
