"""The config reference: every field has help, docs/config.md is current, and
`minihf config show` prints resolved values with defaults."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from minihf.cli import app
from minihf.config_help import doc_roots, field_help, markdown, reference

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_has_help():
    for title, cls in doc_roots().items():
        missing = [e.key for e in reference(cls) if not e.help]
        assert missing == [], f"{title}: add a `# help` comment to {missing}"


def test_field_help_reads_trailing_and_preceding_comments():
    from dataclasses import dataclass

    @dataclass
    class Demo:
        a: int = 1            # trailing
        # above
        b: str = "x"
        c: float = 0.5

    assert field_help(Demo) == {"a": "trailing", "b": "above"}


def test_docs_config_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(doc_roots()), \
        "docs/config.md is stale: run `minihf config doc`"


def test_config_show():
    runner = CliRunner()
    res = runner.invoke(app, ["config", "show", "grpo", "actor_rollout_ref.rollout.n=4"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("n: 4"))
    assert "default 1 (changed); samples per prompt" in line
    assert "ppo_epochs: 4" in res.output and "lr: 0.0003" in res.output
    sft = runner.invoke(app, ["config", "show", "sft_sort"])
    assert sft.exit_code == 0 and "max_length:" in sft.output
    bad = runner.invoke(app, ["config", "show", "grpo", "actor_rollout_ref.rollout.nn=4"])
    assert bad.exit_code != 0 and "did you mean 'n'" in bad.output.replace("\n", " ").replace("│", "")
    assert runner.invoke(app, ["config", "doc", "--check"]).exit_code == 0
