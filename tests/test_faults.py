"""Faults in real RL jobs (torchrun, 2 processes, the grpo recipe on a tiny model):

* an exception in a worker method on rank 1 only (the actor's policy loss) ends the job
  promptly and non-zero, rank 0 showing the remote traceback with rank, role and method;
* SIGKILL of the whole job at a random point after a checkpoint, then the same command
  again: it resumes from the last complete checkpoint and ends with the parameters and
  metrics of an uninterrupted run, bitwise;
* rank 1 killed (SIGKILL) or frozen (SIGSTOP) mid-training: the job ends non-zero within
  about ``controller.timeout_s``, naming rank 1, and leaves no process behind;
* Ctrl-C (SIGINT to the whole job): one line per rank on how to resume, a prompt exit.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from test_controller_launch import ROOT, TORCHRUN, _alive, _run

BOOM = '''
import torch.distributed as dist
from minihf.algorithms import vanilla_policy_loss

def boom(*args, **kwargs):
    if dist.get_rank() == 1:
        raise ZeroDivisionError("broken on rank 1 on purpose")
    return vanilla_policy_loss(*args, **kwargs)
'''


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("faults")
    init_model(root / "model", size="tiny", task="sort")
    make_task_data("sort", root / "data", 32, 4, seed=0)
    return root, ["scripts/train_ppo.py", "recipe=grpo", f"actor_rollout_ref.model.path={root}/model",
                  f"data.train_files={root}/data/train.parquet", f"data.val_files={root}/data/test.parquet",
                  "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
                  "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                  "trainer.test_freq=2", "prepare.task=null", "prepare.sft_recipe=null",
                  "controller.timeout_s=60"]


def test_exception_on_one_rank_ends_the_rl_job_with_its_traceback(job, tmp_path):
    root, args = job
    (tmp_path / "boom.py").write_text(BOOM)
    run = _run(TORCHRUN + args + [f"actor_rollout_ref.actor.policy_loss.loss_mode={tmp_path}/boom.py:boom",
                                  "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}/run"])
    assert run.returncode not in (0, None), run.log
    assert "failed on rank 1" in run.stderr and "update_actor" in run.stderr, run.log
    assert "ZeroDivisionError: broken on rank 1 on purpose" in run.stderr, run.log
    assert run.elapsed < 90, run.log                      # promptly: not after a timeout


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/throughput"))} for r in rows]


def _params(ckpt):
    from minihf.models import load_hf
    from minihf.hub import export_hf

    export_hf(ckpt, ckpt.parent / "export")
    return load_hf(ckpt.parent / "export").state_dict()


def test_killed_job_rerun_resumes_and_equals_an_uninterrupted_run(job, tmp_path):
    root, args = job
    steps = ["trainer.total_training_steps=5", "trainer.save_freq=1"]
    full = _run(TORCHRUN + args + steps + [f"trainer.default_local_dir={tmp_path}/full"])
    assert full.returncode == 0, full.log
    killed = tmp_path / "killed"
    cmd = TORCHRUN + args + steps + [f"trainer.default_local_dir={killed}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = killed / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 240

    def reached(step: int) -> float:  # when the pointer first names step or a later one
        while time.monotonic() < deadline and not (latest.exists() and latest.read_text().strip()
                                                   and int(latest.read_text()) >= step):
            time.sleep(0.01)
        return time.monotonic()
    t1 = reached(1)
    t2 = reached(2)
    # half a step (as long as step 2 took, on this machine today) into step 3 or its checkpoint
    time.sleep((t2 - t1) / 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert latest.read_text().strip() in ("2", "3")       # the pointer only names complete checkpoints
    rerun = _run(cmd)
    assert rerun.returncode == 0, rerun.log
    assert "resumed from" in rerun.stdout, rerun.log
    assert _metrics(killed) == _metrics(tmp_path / "full")
    a, b = _params(tmp_path / "full" / "global_step_5" / "actor"), _params(killed / "global_step_5" / "actor")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _rank_pids(agent_pid: int, timeout: float = 120) -> dict[int, int]:
    """RANK -> pid of a torchrun agent's worker processes (from their environment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {}
        for child in Path("/proc").glob("[0-9]*"):
            try:
                if int(child.joinpath("stat").read_text().split()[3]) != agent_pid:
                    continue
                env = dict(x.split("=", 1) for x in child.joinpath("environ").read_bytes().decode(
                    errors="replace").split("\0") if "=" in x)
            except (OSError, ValueError, IndexError):
                continue
            if "RANK" in env:
                pids[int(env["RANK"])] = int(child.name)
        if len(pids) == 2:
            return pids
        time.sleep(0.2)
    raise AssertionError("the job's two ranks never started")


LOST_TIMEOUT_S = 12  # a frozen rank is reported after this; the tiny job's calls take milliseconds


def _interrupt_in_training(cmd, run_dir, hit, timeout=150):
    """Start ``cmd`` (a 2-rank job writing to ``run_dir``), wait until step 1 is logged, call
    ``hit(proc, pids)``; return (stderr, seconds from the hit to the exit, ranks still alive,
    return code). Every process it started is gone afterwards, whatever happened."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids: dict[int, int] = {}
    try:
        pids = _rank_pids(proc.pid)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.1)                                   # in training (step 1 logged)
        hit(proc, pids)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=timeout)
        elapsed = time.monotonic() - t0
        time.sleep(1)
        alive = [p for p in pids.values() if _alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)                  # never leave a stopped rank behind
            except ProcessLookupError:
                pass
    return err, elapsed, alive, proc.returncode


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_lost_rank_ends_the_rl_job_naming_it(job, tmp_path, sig):
    """Rank 1 killed, or frozen, during training: the job ends non-zero within about
    controller.timeout_s, rank 0 names rank 1, and no process is left behind."""
    root, args = job
    run_dir = tmp_path / "run"
    cmd = TORCHRUN + args + ["trainer.total_training_steps=200", f"controller.timeout_s={LOST_TIMEOUT_S}",
                             f"trainer.default_local_dir={run_dir}"]
    err, elapsed, alive, code = _interrupt_in_training(
        cmd, run_dir, lambda proc, pids: os.kill(pids[1], sig))
    assert code != 0, err
    # rank 0 names it (RankLostError), or torchrun does first: on a SIGKILL its agent may stop
    # rank 0 before rank 0 prints, reporting "Root Cause ... rank : 1 ... SIGKILL" itself
    assert re.search(r"rank 1\b|Root Cause[\s\S]*rank\s*:\s*1 ", err), err
    # timeout_s, the cause grace (<= 10 s), the slow 2-core box; rank 0 SIGKILLs a frozen rank
    # on its host, else torchrun would wait ~30 s more for it to act on SIGTERM
    assert elapsed < LOST_TIMEOUT_S + 25, (elapsed, err)
    assert not alive, (alive, err)                            # no process left behind


def test_ctrl_c_ends_the_rl_job_with_one_line_per_rank(job, tmp_path):
    """SIGINT to the whole job (Ctrl-C in its terminal) mid-training: it ends within
    seconds, each rank says in one line that it was interrupted and how to resume (no
    traceback of ours), and no process is left behind."""
    root, args = job
    run_dir = tmp_path / "run"
    cmd = TORCHRUN + args + ["trainer.total_training_steps=200", f"trainer.default_local_dir={run_dir}"]
    err, elapsed, alive, code = _interrupt_in_training(   # SIGINT: what the terminal sends
        cmd, run_dir, lambda proc, pids: os.killpg(proc.pid, signal.SIGINT), timeout=60)
    assert code != 0, err
    for rank in (0, 1):
        assert f"[minihf rank {rank}] interrupted (SIGINT); rerun the same command to resume" in err, err
    assert "KeyboardInterrupt" not in err and "job failed" not in err, err
    assert elapsed < 20, (elapsed, err)
    assert not alive, (alive, err)
