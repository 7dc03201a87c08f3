"""Shared fixtures: the real SmolLM2 BPE tokenizer (``tests/fixtures/smollm2_tokenizer``)."""

import gzip
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


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
