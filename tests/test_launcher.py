"""``minihf train --nproc-per-node N`` (``minihf.launcher``): the config is checked before any
rank starts (one line, exit 2); the ranks run through torch's elastic launch API; a failed
job is the rank's own line and one launcher line with its exit code, no launcher traceback
or failure table; two launchers on loopback form a two-node job."""

import os
import subprocess
import sys

import pytest

from minihf.testing import free_port

from test_controller_launch import ROOT
from test_locks import _args


def minihf(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.Popen([sys.executable, "-m", "minihf.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def job_args(tmp_path, run_dir, steps=2):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    if not (tmp_path / "model").exists():
        init_model(tmp_path / "model", size="tiny", task="sort")
        make_task_data("sort", tmp_path / "data", 16, 4, seed=0)
    return ["grpo", *_args(tmp_path, run_dir, steps)[3:]]  # the overrides of test_locks' tiny job


def test_a_bad_value_is_one_line_before_any_rank_starts():
    code, out, err = finish(minihf("train", "--nproc-per-node", "2", "actor_rollout_ref.actor.optim.lr=banana"))
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()] and "actor_rollout_ref.actor.optim.lr" in err, err
    assert "banana" in err and "Traceback" not in err


def test_two_ranks_run_and_a_failed_job_is_one_line_per_rank(tmp_path):
    args = job_args(tmp_path, tmp_path / "run")
    code, out, err = finish(minihf("train", "--nproc-per-node", "2", *args))
    assert code == 0, err
    assert "OMP_NUM_THREADS=" in err and "step=2" in out, out + err
    assert (tmp_path / "run" / "global_step_2").is_dir()
    missing = [a if not a.startswith("data.val_files=") else f"data.val_files={tmp_path}/nope.parquet" for a in args]
    code, out, err = finish(minihf("train", "--nproc-per-node", "2", *missing, f"trainer.default_local_dir={tmp_path}/r2"))
    assert code == 1, err
    assert "nope.parquet' does not exist" in err and "[minihf] the job failed: rank" in err, err
    assert "exited with code 1 (its message is above)" in err, err
    assert "ChildFailedError" not in err and "Traceback" not in err and len(err.splitlines()) <= 8, err
    assert not [line for line in err.splitlines() if line.startswith(("W1", "E1", "I1"))], err  # no launcher log


def test_several_nodes_need_an_endpoint(tmp_path):
    code, _, err = finish(minihf("train", "--nnodes", "2", "trainer.total_training_steps=1"))
    assert code == 2 and "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in err, err


@pytest.mark.slow  # ~12 s; test_controller_launch.py::test_train_ppo_two_simulated_nodes runs torchrun's in CI
def test_two_launchers_on_loopback_are_a_two_node_job(tmp_path):
    args = job_args(tmp_path, tmp_path / "run")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [minihf("train", "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", endpoint, "--nproc-per-node",
                    "1", *args) for r in (0, 1)]
    results = [finish(p) for p in nodes]
    assert [r[0] for r in results] == [0, 0], results
    assert "step=2" in results[0][1]                    # rank 0, the driver, is on node 0
    assert (tmp_path / "run" / "global_step_2").is_dir()
