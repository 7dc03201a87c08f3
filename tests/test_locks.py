"""One job per run dir (``minihf.utils.locks``, docs/reliability.md): a second job is
refused in one line naming the holder; a lock left by a killed job is taken over with a
message; on a filesystem without locking the recorded holder decides."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from minihf.utils import locks
from minihf.utils.locks import HeldByAnotherJob, acquire, hold, lock_path, release

from test_controller_launch import ROOT, _run

HOLDER = """
import sys, time
from minihf.utils.locks import acquire
acquire(sys.argv[1], "x", "y")
print("held", flush=True)
time.sleep(600)
"""


def holder(path):
    """A process that holds ``path`` until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_dir_is_refused_naming_the_holder_and_taken_over_when_it_dies(tmp_path):
    run = tmp_path / "run"
    proc = holder(run)
    try:
        with pytest.raises(HeldByAnotherJob, match=rf"the run dir is in use by another job: pid {proc.pid} "
                                                   rf"on host {socket.gethostname()}, started 20\d\d-.* UTC "
                                                   r"\(-c .*\); pass another dir"):
            acquire(run, "the run dir", "pass another dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    said = []
    with hold(run, "the run dir", "fix", log=said.append):     # the dead job's lock is taken over
        assert f"took over the lock {lock_path(run)} of a job that ended without releasing it (pid {proc.pid}" in said[0]
        assert json.loads(lock_path(run).read_text())["pid"] == os.getpid()
        with hold(run, "the run dir", "fix"):                    # re-entrant in one process
            pass
        assert lock_path(run).exists()
    assert not lock_path(run).exists()                          # released: removed
    said.clear()
    with hold(run, "the run dir", "fix", log=said.append):      # a clean release: no takeover message
        assert said == []


def test_a_symlink_to_a_held_dir_is_the_same_dir(tmp_path):
    """Two names of one run dir (a symlink, a path through a linked parent, ``..``) are one
    lock: a job given the link is refused while another holds the target (it used to take a
    lock of its own, and both jobs wrote every metrics row into the one directory)."""
    run = tmp_path / "outputs" / "run"
    run.mkdir(parents=True)
    (tmp_path / "outputs" / "link").symlink_to(run)
    (tmp_path / "parent_link").symlink_to(tmp_path / "outputs")
    proc = holder(run)
    try:
        for name in (tmp_path / "outputs" / "link", tmp_path / "parent_link" / "run",
                     tmp_path / "outputs" / "x" / ".." / "run"):
            assert lock_path(name) == lock_path(run)
            with pytest.raises(HeldByAnotherJob, match=rf"in use by another job: pid {proc.pid} "):
                acquire(name, "the run dir", "pass another dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_without_file_locking_the_recorded_holder_decides(tmp_path, monkeypatch):
    def no_locking(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(locks.fcntl, "flock", no_locking)
    run = tmp_path / "run"
    lock_path(run).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": 0,
                                          "command": "train_ppo.py"}))
    with pytest.raises(HeldByAnotherJob, match=rf"pid {os.getppid()} .* \(this filesystem has no file "
                                               rf"locking: if that job is gone, delete {lock_path(run)}\)"):
        acquire(run, "the run dir", "fix")
    lock_path(run).write_text(json.dumps({"host": "another-host", "pid": 1, "started": 0, "command": "x"}))
    with pytest.raises(HeldByAnotherJob, match=r"pid 1 on host another-host"):
        acquire(run, "the run dir", "fix")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_path(run).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0,
                                          "command": "x"}))
    said = []
    acquire(run, "the run dir", "fix", log=said.append)         # its holder is gone: taken over
    release(run)
    assert "took over the lock" in said[0] and not lock_path(run).exists()


def _args(root, run_dir, steps):
    return [sys.executable, "scripts/train_ppo.py", "recipe=grpo", f"actor_rollout_ref.model.path={root}/model",
            f"data.train_files={root}/data/train.parquet", f"data.val_files={root}/data/test.parquet",
            "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.test_freq=-1", "prepare.task=null", "prepare.sft_recipe=null",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}"]


def test_two_rl_jobs_in_one_run_dir(tmp_path):
    """The second job started in a busy run dir is refused at once, in one line naming the
    first; after the first is killed (its lock left behind), the next job takes it over,
    saying so, and runs (it wrote every step twice, and replaced the first's checkpoints)."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp_path / "model", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "data", 16, 4, seed=0)
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(_args(tmp_path, run_dir, 500), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert first.poll() is None, "the first job ended early"
            time.sleep(0.1)
        second = _run(_args(tmp_path, run_dir, 2), timeout=120)
        assert second.returncode == 1, second.log
        assert (f"HeldByAnotherJob: the run dir trainer.default_local_dir='{run_dir}' is in use by another "
                f"job: pid {first.pid} on host {socket.gethostname()}") in second.stderr, second.log
        assert "Traceback" not in second.stderr, second.log
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = _run(_args(tmp_path, run_dir, 1), timeout=180)
    assert third.returncode == 0, third.log
    assert f"took over the lock {lock_path(run_dir)} of a job that ended without releasing it (pid {first.pid}" \
        in third.stdout, third.log
    assert not lock_path(run_dir).exists()


def test_a_warm_start_being_built_by_another_job_is_refused(tmp_path):
    """Two recipes started together share the SFT warm start (outputs/sft_sort): the one that
    finds it being built is refused naming the builder, before it trains anything."""
    from minihf.data import make_task_data

    make_task_data("sort", tmp_path / "outputs" / "data" / "sort", 64, 4, seed=0)
    proc = holder(tmp_path / "outputs" / "sft_sort")
    try:
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_ppo.py"), "prepare.size=tiny",
                              "trainer.default_local_dir=outputs/mine"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        proc.kill()
        proc.wait()
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"the run dir trainer.default_local_dir='outputs/sft_sort' is in use by another job: pid {proc.pid}" \
        in res.stderr, res.stderr
    assert not (tmp_path / "outputs" / "sft_sort" / "hf").exists()
    assert not lock_path(tmp_path / "outputs" / "mine").exists()  # its own run dir: released on the way out
