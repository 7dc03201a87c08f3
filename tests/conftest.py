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
