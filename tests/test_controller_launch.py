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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def tiny_rl(tmp_path_factory):
    """A tiny model and digits data, and the overrides that make the grpo recipe use them
    for a 2-step run."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("main_job")
    init_model(root / "model", size="tiny", task="digits")
    make_task_data("digits", root / "data", 32, 8, seed=0)
    return root, [
        f"actor_rollout_ref.model.path={root}/model", f"data.train_files={root}/data/train.parquet",
        f"data.val_files={root}/data/test.parquet", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.total_training_steps=2", "prepare.task=null", "prepare.sft_recipe=null",
        "controller.timeout_s=120"]


def test_train_ppo_one_process(tiny_rl, tmp_path):
    root, overrides = tiny_rl
    job = _run([sys.executable, "scripts/train_ppo.py", "recipe=grpo", *overrides,
                f"trainer.default_local_dir={tmp_path}/run"])
    assert job.returncode == 0, job.log
    assert "step=2 score=" in job.stdout and "validation score: " in job.stdout, job.log
    assert (tmp_path / "run" / "global_step_2" / "actor").is_dir(), job.log


def test_train_ppo_two_simulated_nodes(tiny_rl, tmp_path):
    """Two torchrun launchers (--nnodes=2, one process each) rendezvous on 127.0.0.1 and run
    2 steps of grpo: nothing in minihf assumes one node."""
    from minihf.testing import free_port

    root, overrides = tiny_rl
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}",
             "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
             "scripts/train_ppo.py", "recipe=grpo", *overrides,
             f"trainer.default_local_dir={tmp_path}/run"] for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(_run, cmds))
    for job in jobs:
        assert job.returncode == 0, job.log
    assert "step=2 score=" in jobs[0].stdout, jobs[0].log
    assert "actor/pg_loss" in (tmp_path / "run" / "metrics.jsonl").read_text()


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


GUARD_JOB = """
import threading

import torch

from minihf.controller import Dispatch, Worker, launch, register

calls = []
torch._C._ensureCUDADeviceGuardSet = lambda: calls.append(threading.current_thread().name)

class W(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def hi(self):
        return threading.current_thread().name

for _ in range(2):  # two runs in one process, as SFT then RL
    print("worker thread", launch(lambda groups: groups["w"].hi()[0], {"w": W}))
print("guard set from", calls)
"""


def test_runs_set_the_cuda_guard_from_the_main_thread(tmp_path):
    # torch 2.11's CUDA wheels without a GPU segfaulted in the second run's worker thread
    # (FakeTensorMode, under FSDP) unless the no-op CUDA guard was set before on a live
    # thread; reproduced and fixed on torch 2.11.0+cu130 here, this checks the call is made
    script = tmp_path / "guard_job.py"
    script.write_text(textwrap.dedent(GUARD_JOB))
    job = _run([sys.executable, str(script)])
    assert job.returncode == 0, job.log
    assert job.stdout.count("worker thread minihf-worker") == 2, job.log
    assert "guard set from ['MainThread', 'MainThread']" in job.stdout, job.log


def run_main_job(cwd, *overrides) -> tuple[float, float, float, str]:
    """The README's main job (2 processes) in ``cwd`` with ``overrides``, to the end:
    (first validation, last validation, seconds, log); fails the test if it fails."""
    import re

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
           "--nproc_per_node=2", str(ROOT / "scripts" / "train_ppo.py"), *overrides]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=1200)
    elapsed = time.monotonic() - t0
    log = f"exit {proc.returncode} after {elapsed:.0f}s\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, log
    found = re.search(r"validation score: ([0-9.]+) \(first\) -> ([0-9.]+) \(last\)", proc.stdout)
    assert found, log
    return float(found.group(1)), float(found.group(2)), elapsed, log


@pytest.mark.slow
def test_main_job_learns(tmp_path):
    """The README's main job from scratch (in an empty dir, so everything under outputs/ is
    built: data, base model, SFT warm start): the validation score rises by >= 0.3 over
    the warm-started policy and ends >= 0.75 (the digits reward's maximum is 1), within
    10 minutes of wall time. With ``rollout.check_log_probs=error`` (an observation: the
    same training), so every step's rollout log-probs are also within rounding of the
    trainer's."""
    before, after, elapsed, log = run_main_job(tmp_path, "actor_rollout_ref.rollout.check_log_probs=error")
    print(f"main job: validation {before:.3f} -> {after:.3f} in {elapsed:.0f}s")
    assert after - before >= 0.3 and after >= 0.75, log
    assert elapsed <= 600, log
    import json

    rows = [json.loads(line) for line in
            (tmp_path / "outputs" / "grpo_sort" / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["training/rollout_log_prob_bound_ratio"] for r in rows
              if "training/rollout_log_prob_bound_ratio" in r]
    print(f"rollout vs trainer log-probs: worst token {max(ratios):.2f} of the rounding bound")
    assert len(ratios) == 150 and max(ratios) <= 1.0


LONG_JOB = """
import os, sys, time
from minihf.controller import Dispatch, Worker, launch, register

class Slow(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def work(self, out):
        open(f"{out}/pid{self.rank}", "w").write(str(os.getpid()))
        time.sleep(120)

def driver(groups):
    groups["slow"].work(sys.argv[1])

launch(driver, {"slow": Slow})
"""


IMPORTING = """
import minihf.utils.script_start  # as the scripts do, first
import os, sys, time
open(f"{sys.argv[1]}/pid{os.environ['RANK']}", "w").write(str(os.getpid()))
time.sleep(120)  # still importing torch: no process group, no job yet
"""


@pytest.mark.parametrize("when", ["running", "importing"])
def test_workers_exit_when_torchrun_is_killed(tmp_path, when):
    """SIGKILL of the launcher (torchrun) takes its workers down with it, at once: in a
    job, and in a script's first seconds, while its imports run (those ranks waited for a
    rendezvous that could not come, up to controller.timeout_s)."""
    script = tmp_path / "long_job.py"
    script.write_text(textwrap.dedent(LONG_JOB if when == "running" else IMPORTING))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(TORCHRUN + [str(script), str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
            time.sleep(0.5)
        assert len(pids) == 2, "the workers never started"
        os.kill(proc.pid, signal.SIGKILL)  # the torchrun agent
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.2)
        assert not alive, f"workers {alive} outlived their launcher"
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
