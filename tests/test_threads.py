"""Threads per rank (``minihf.utils.threads``): the cores a host may use, each rank's share,
the line that names an oversubscribed host, and a real 2-rank job under ``taskset`` with
``OMP_NUM_THREADS=2`` exported (the case of issue 60: 4 threads on 2 cores, steps 5x slower
and nothing said)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minihf.config import ConfigError, from_dict
from minihf.controller.config import ControllerConfig
from minihf.utils import threads
from minihf.utils.threads import Cores, cgroup_cpu_limit, plan, usable_cores

ROOT = Path(__file__).resolve().parents[1]
TWO = Cores(2, "2 in this process's CPU affinity")


@pytest.mark.parametrize("setting, ranks, inherited, env, want, warn", [
    ("auto", 2, 2, "2", 1, "OMP_NUM_THREADS=2 x 2 ranks on this host would be 4 threads on 2 usable cores"),
    ("auto", 2, 1, None, 1, None),       # torchrun's own default (1 per rank): fits
    ("auto", 1, 2, None, 2, None),       # one process takes the host
    ("auto", 1, 1, "1", 1, None),        # auto never raises what the user exported
    ("auto", 3, 1, None, 1, "start at most 2 ranks on this host (--nproc-per-node 2)"),
    ("inherit", 2, 2, "2", 2, "set controller.threads=auto (each rank gets 1)"),
    ("inherit", 2, 1, "1", 1, None),
    (3, 1, 2, None, 3, "3 per rank x 1 rank on this host = 3 threads on 2 usable cores"),
    (1, 2, 2, "2", 1, None),
])
def test_plan_threads_per_rank(setting, ranks, inherited, env, want, warn):
    p = plan(setting, TWO, ranks, inherited, env)
    assert p.threads == want
    if warn is None:
        assert p.line.startswith(f"[minihf] threads: {want} per rank ("), p.line
        assert f"{ranks} rank{'s' if ranks > 1 else ''} on this host, 2 usable cores" in p.line
    else:
        assert p.line.startswith("[minihf] warning: ") and warn in p.line, p.line
    assert p.oversubscribed == (want * ranks > 2)


def test_plan_names_a_bad_setting():
    for bad in ("many", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"controller.threads=.*use auto .* an integer >= 1, or inherit"):
            plan(bad, TWO, 1, 1, None)
    with pytest.raises(ValueError, match="local_ranks must be >= 1"):
        plan("auto", TWO, 0, 1, None)


def test_config_key_checks_its_value():
    assert from_dict(ControllerConfig, {"threads": 3}).threads == 3
    assert ControllerConfig().threads == "auto"
    for bad in ("many", 0, 2.5):
        with pytest.raises((ConfigError, ValueError), match="threads"):
            from_dict(ControllerConfig, {"threads": bad})


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_lowest_on_the_way_up(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "job" / "cpu.max", "250000 100000\n")  # 2.5 cores for the job
    _write(root / "job" / "step" / "cpu.max", "max 100000\n")
    own = tmp_path / "self_cgroup"
    _write(own, "0::/job/step\n")
    assert cgroup_cpu_limit(root, own) == 2.5
    _write(root / "job" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, own) is None


def test_cgroup_v1_quota_and_none(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    own = tmp_path / "self_cgroup"
    _write(own, "4:memory:/x\n2:cpu,cpuacct:/\n")
    assert cgroup_cpu_limit(root, own) == 1.5
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")  # no quota (this machine's case)
    assert cgroup_cpu_limit(root, own) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None  # no cgroup file: not Linux


def test_usable_cores_takes_the_lower_of_affinity_and_quota():
    assert usable_cores({0, 1, 2, 3}, None) == Cores(4, "4 in this process's CPU affinity")
    cores = usable_cores({0, 1, 2, 3}, 1.5)
    assert cores.usable == 1 and "cgroup CPU quota of 1.5 cores (4 in the affinity)" in cores.why
    assert usable_cores({0, 1}, 8.0).usable == 2
    assert usable_cores({0}, 0.5).usable == 1  # half a core still runs one thread
    assert usable_cores().usable >= 1


def test_with_threads_writes_the_figure_into_the_config(monkeypatch):
    from minihf.trainer.ppo_config import PPOConfig

    cfg = from_dict(PPOConfig, {})
    monkeypatch.setattr(threads, "_applied", None)
    assert threads.with_threads(cfg) is cfg
    monkeypatch.setattr(threads, "_applied", plan("auto", TWO, 2, 2, "2"))
    assert threads.with_threads(cfg).controller.threads == 1
    assert cfg.controller.threads == "auto"  # the caller's config is left as it was


def test_a_sandboxed_tool_runs_one_thread_per_library():
    from minihf.multi_turn.sandbox import run_python

    out = run_python("import os\nprint(sorted((k, v) for k, v in os.environ.items() if k.endswith('_THREADS')))")
    assert out.strip() == str(sorted((k, "1") for k in threads.POOL_VARIABLES)), out


JOB = """
import os, threading, torch
from minihf.controller import Dispatch, Worker, launch, register
from minihf.controller.config import ControllerConfig

class W(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def threads(self):
        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

def driver(groups):
    seen = []  # a thread the driver starts (rule rewards, environments): no second team
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return groups["w"].threads(), seen

setting = os.environ["THREADS"]
cfg = ControllerConfig(threads=int(setting) if setting.isdigit() else setting)
result = launch(driver, {"w": W}, cfg)
if result is not None:  # rank 0
    print("per rank", result[0], "driver's threads", result[1])
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or shutil.which("taskset") is None, reason="needs 2 cores and taskset")
@pytest.mark.parametrize("setting, want, warning", [
    ("auto", 1, "OMP_NUM_THREADS=2 x 2 ranks on this host would be 4 threads on 2 usable cores"),
    ("inherit", 2, "threads oversubscribe this host: 2 per rank x 2 ranks on this host = 4 threads"),
])
def test_two_ranks_on_two_cores_with_two_threads_exported(tmp_path, setting, want, warning):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--local-addr=127.0.0.1", "--nproc_per_node=2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="2", THREADS=setting)
    job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = f"exit {job.returncode}\n--- stdout ---\n{job.stdout}\n--- stderr ---\n{job.stderr}"
    assert job.returncode == 0, log
    assert f"per rank [({want}, '{want}'), ({want}, '{want}')] driver's threads [1]" in job.stdout, log
    lines = [line for line in job.stderr.splitlines() if line.startswith("[minihf] warning: ")]
    assert len(lines) == 1 and warning in lines[0], log  # said once, by the host's local rank 0
