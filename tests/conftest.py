"""Shared fixtures (the real SmolLM2 BPE tokenizer, a tiny RL job) and the suite's settings:
a wide terminal for rich's error boxes, and how many pytest-xdist workers ``-n auto`` starts."""

import gzip
import os
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MAX_WORKERS = 4  # see pytest_xdist_auto_num_workers


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """rich wraps a CLI error box at the terminal's width, splitting a long temp path (xdist's
    ``popen-gwN/`` makes them longer) inside the very words a test looks for."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, at most MAX_WORKERS. A multi-process test
    mostly waits on its processes starting (importing torch, the rendezvous): on 2 cores one
    worker kept them 61% busy, two 94% (15.3 -> 9.9 minutes on an Intel Xeon, before
    spawn_ranks forked its ranks from a server; 13.8 -> 7.4 after). Many tests start 2-4 ranks
    of their own, so more workers would oversubscribe a large host. ``-n N`` or
    PYTEST_XDIST_AUTO_NUM_WORKERS chooses another count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    from minihf.utils.threads import usable_cores

    return max(1, min(usable_cores().usable, MAX_WORKERS))  # the affinity, under a cgroup CPU quota


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer dir holding SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML)."""
    src = FIXTURES / "smollm2_tokenizer"
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    for f in src.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as fin, open(out / f.name[:-3], "wb") as fout:
                shutil.copyfileobj(fin, fout)
        elif f.suffix != ".md":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """A tiny random model and the ``digits`` task's data (32 train, 8 test rows), built once per
    module: the RL job tests' ``(model dir, data dir)``."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("job")
    init_model(root / "model", size="tiny", task="digits")
    make_task_data("digits", root / "data", 32, 8, seed=0)  # the recipes' task is sort: any works
    return str(root / "model"), str(root / "data")
