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


START_ERROR = """
import os, sys, time
from minihf.controller.launch import run_script

def main(argv):
    rank = int(os.environ["RANK"])
    if rank == 0 and argv[0] == "slow":      # rank 0 reaches the shared error last
        time.sleep(2)
    if rank == 0 and argv[0] == "alone":     # only rank 1 fails; rank 0 would wait for it
        time.sleep(120)
    raise ValueError(f"bad value on rank {rank}; use another")

run_script(main, sys.argv[1:])
"""


@pytest.mark.parametrize("case", ["slow", "alone"])
def test_start_up_errors_of_scripts_are_reported_once(case, tmp_path):
    """An error every rank hits is reported once, by rank 0, even when rank 1 gets there
    first (it waits for rank 0); an error of one rank only is reported by that rank."""
    script = tmp_path / "start.py"
    script.write_text(START_ERROR)
    job = _run(TORCHRUN + [str(script), case], timeout=60)
    assert job.returncode not in (0, None), job.log
    reports = [line for line in job.stderr.splitlines() if line.startswith("[minihf]")]
    want = ("[minihf] job failed: ValueError: bad value on rank 0; use another" if case == "slow"
            else "[minihf] rank 1: job failed: ValueError: bad value on rank 1; use another")
    assert reports == [want], job.log
    assert job.elapsed < 30, job.log  # "alone": ended by rank 1's exit, not rank 0's sleep


def test_script_config_error_is_one_line_from_rank_zero():
    job = _run(TORCHRUN + ["scripts/train_ppo.py", "algorithm.adv_estimatr=gae"])
    assert job.returncode not in (0, None), job.log
    assert job.stderr.count("job failed: ConfigError: unknown key 'algorithm.adv_estimatr'; "
                            "did you mean 'adv_estimator'?") == 1, job.log
    # a traceback frame of minihf's own code (the package or the scripts), matched by
    # directory: torchrun's own report of the failed child has a traceback, and its frames
    # under site-packages may contain "minihf" too (a virtualenv named minihf)
    import minihf

    own = (str(Path(minihf.__file__).resolve().parent), str(ROOT / "scripts"))
    ours = [line for line in job.stderr.splitlines()
            if line.strip().startswith('File "') and line.split('"')[1].startswith(own)]
    assert not ours, job.log


@pytest.mark.parametrize("script", ["train_ppo.py", "train_sft.py", "train_rm.py"])
def test_scripts_print_help_and_start_nothing(script, tmp_path, monkeypatch, capsys):
    """``--help`` prints the script's docstring and where the keys are explained and starts
    no job (the run dir is not created); under torchrun rank 0 alone prints it, exit 0."""
    import runpy

    run_dir = tmp_path / "run"
    path = ROOT / "scripts" / script
    first = path.read_text().split('"""')[1].strip().splitlines()[0]
    monkeypatch.setattr(sys, "argv", [str(path), "--help", f"trainer.default_local_dir={run_dir}"])
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith(first) and "docs/config.md" in out, out
    assert not run_dir.exists()
    if script == "train_ppo.py":
        job = _run(TORCHRUN + [str(path), "-h"], timeout=120)
        assert job.returncode == 0 and job.stdout.count(first) == 1, job.log


CTRL_C_WHILE_IMPORTING = """
import os, signal, sys, time
import minihf.utils.script_start  # as the scripts do, first
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the imports below would run
time.sleep(float(sys.argv[1]))
print("still here")
"""


def _with_sigint(disposition):
    """A child's SIGINT as its shell would leave it: the default in a terminal's foreground
    job; ignored in a background job of a non-interactive shell (`bash -c 'cmd &'`, nohup,
    many job runners), which this suite itself may be, so the child sets it, not inherits it."""
    return lambda: signal.signal(signal.SIGINT, disposition)


def test_ctrl_c_while_a_script_imports_is_one_line():
    """A script's first seconds import torch: Ctrl-C there is one line, not an import
    traceback per rank; once the job starts (run_script), Ctrl-C is Python's again. A SIGINT
    the script was started with ignored (a background job) stays ignored."""
    res = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, "30"], capture_output=True, text=True,
                         timeout=60, preexec_fn=_with_sigint(signal.SIG_DFL))
    assert res.returncode == 130 and res.stderr == "[minihf] interrupted (SIGINT) while starting; nothing was written\n"
    res = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, "0.2"], capture_output=True, text=True,
                         timeout=60, preexec_fn=_with_sigint(signal.SIG_IGN))
    assert res.returncode == 0 and res.stdout == "still here\n", res
    from minihf.controller.launch import run_script
    from minihf.utils import process_exit

    previous = signal.signal(signal.SIGINT, process_exit._quit)
    try:
        run_script(lambda argv: None, [])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    for script in ("train_ppo.py", "train_sft.py", "train_rm.py"):
        assert "import minihf.utils.script_start" in (ROOT / "scripts" / script).read_text().split("from minihf")[0]
