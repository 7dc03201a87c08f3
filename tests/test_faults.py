"""Faults in real RL jobs (torchrun, 2 processes, the grpo recipe on a tiny model):

* an exception in a worker method on rank 1 only (the actor's policy loss) ends the job
  promptly and non-zero, rank 0 showing the remote traceback with rank, role and method;
* SIGKILL of the whole job at a random point after a checkpoint, then the same command
  again: it resumes from the last complete checkpoint and ends with the parameters and
  metrics of an uninterrupted run, bitwise.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from test_controller_launch import ROOT, TORCHRUN, _run

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
    from minihf.data import init_model, make_task_data

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
    from minihf.utils.checkpoint import export_hf

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
    while time.monotonic() < deadline and not (latest.exists() and latest.read_text().strip() == "2"):
        time.sleep(0.05)
    time.sleep(0.3)                                      # somewhere in step 3 (or in its checkpoint)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert latest.read_text().strip() in ("2", "3")       # the pointer only names complete checkpoints
    rerun = _run(cmd)
    assert rerun.returncode == 0, rerun.log
    assert "resumed from" in rerun.stdout, rerun.log
    assert _metrics(killed) == _metrics(tmp_path / "full")
    a, b = _params(tmp_path / "full" / "global_step_5" / "actor"), _params(killed / "global_step_5" / "actor")
    assert all(torch.equal(a[k], b[k]) for k in a)
