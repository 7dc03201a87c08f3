"""minihf installed as a user installs it: a wheel (not editable) in a fresh virtualenv, run
from a directory outside the checkout. The recipes ship in the package: ``minihf config
show`` finds them, with where each value came from through ``base:``, and ``minihf train``
runs the default recipe from an empty directory (its data, model and warm start built)."""

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["prepare.num_train=64", "prepare.num_test=8", "prepare.size=tiny",
        "prepare.sft_overrides=[trainer.total_training_steps=2,data.train_batch_size=8,data.val_batch_size=8]",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.total_training_steps=2", "trainer.test_freq=-1"]


def test_a_wheel_in_a_fresh_virtualenv_runs_the_packaged_recipes(tmp_path):
    source = tmp_path / "source"  # what the wheel is built from: the project files, no build leftovers
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # torch and the other dependencies, pip and setuptools (no network) come from the
    # site-packages of the interpreter that runs this suite, which a newcomer's is a
    # virtualenv: `venv --system-site-packages` would give the *base* interpreter's instead
    # (no torch there, and maybe an old setuptools). A path line in a .pth file adds them
    # without processing their own .pth files, so the checkout's editable install stays out.
    setuptools = pytest.importorskip("setuptools")
    needed = int(re.search(r'"setuptools>=(\d+)', (ROOT / "pyproject.toml").read_text()).group(1))
    if int(setuptools.__version__.split(".")[0]) < needed:   # the dev extra installs it
        pytest.skip(f"setuptools {setuptools.__version__} here; the build needs >= {needed} "
                    '(pip install -e ".[dev]" installs it)')
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python, minihf = venv / "bin" / "python", venv / "bin" / "minihf"
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    ours = [p for p in ours if Path(p).is_dir()]
    (Path(venv_site) / "suite_site_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(source)], check=True, capture_output=True)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}

    def run(*args, timeout=300):
        res = subprocess.run([*map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    where = run(python, "-c", "import minihf.config as c; print(c.__file__); print(c.DEFAULT_RECIPES_DIR)").split()
    assert all(str(venv) in w for w in where), where                 # the installed copy, not the checkout
    assert (Path(where[1]) / "grpo" / "config.yaml").is_file()
    shown = run(minihf, "config", "show", "rloo")
    assert "adv_estimator: rloo" in shown and "(changed in rloo)" in shown and "(changed in grpo)" in shown
    run(minihf, "train", "grpo", *TINY)
    assert (work / "outputs" / "grpo_sort" / "global_step_2" / "actor" / "meta.json").is_file()
    assert (work / "outputs" / "sft_sort" / "hf" / "config.json").is_file()
