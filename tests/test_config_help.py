"""The config reference: every field has help, docs/config.md is current, and
`minihf config show` prints resolved values with defaults."""

import functools
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minihf.cli import app
from minihf.config import to_dict
from minihf.cli.config_help import doc_roots, field_help, markdown, reference
from minihf.trainer.rm import RMConfig
from minihf.trainer.sft import SFTConfig

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


def test_reference_defaults_are_the_built_ones():
    """Each documented default is the value a default-built config holds (a nested config's
    defaults come from its parent's factory: the SFT optimizer's lr is not OptimConfig's).
    Fields documented as null may be filled by the root's __post_init__ and are skipped."""
    from minihf.workers.optim import OptimConfig

    for title, cls in doc_roots().items():
        built, checked = cls(), 0
        for e in reference(cls):
            if e.default is None or ".<name>." in e.key:  # one entry of a mapping: below
                continue
            assert to_dict(functools.reduce(getattr, e.key.split("."), built)) == e.default, (title, e.key)
            checked += 1
        assert checked > 20, title
    # a mapping of sections lists one entry's keys, with the entry class's defaults
    from minihf.trainer.role_section import RoleSection
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.workers.aux_loss import AuxLossConfig

    entries = {e.key: e.default for e in reference(PPOJobConfig) if ".<name>." in e.key}
    assert entries["roles.<name>.worker"] == RoleSection.worker == "LogProbWorker"
    assert entries["roles.<name>.fsdp.wrap_blocks"] is True
    assert entries["actor_rollout_ref.actor.aux_losses.<name>.coef"] == AuxLossConfig.coef
    assert entries["controller.placement.<name>.tp_size"] == 1
    lrs = {e.key: e.default for e in reference(SFTConfig) if e.key == "optim.lr"}
    assert lrs == {"optim.lr": SFTConfig().optim.lr} and SFTConfig().optim.lr != OptimConfig().lr


def test_config_show():
    runner = CliRunner()
    res = runner.invoke(app, ["config", "show", "grpo", "actor_rollout_ref.rollout.n=4"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("n: 4"))
    assert "default 1 (changed on the command line); samples per prompt" in line
    assert "ppo_epochs: 4" in res.output and "lr: 0.0003" in res.output
    sft = runner.invoke(app, ["config", "show", "sft_sort"])
    assert sft.exit_code == 0 and "max_length:" in sft.output
    bad = runner.invoke(app, ["config", "show", "grpo", "actor_rollout_ref.rollout.nn=4"])
    assert bad.exit_code != 0 and "did you mean 'n'" in bad.output.replace("\n", " ").replace("│", "")
    # a typo in an SFT recipe's override names the typo (it was the RL loader's complaint
    # about the recipe: unknown key 'model')
    bad = runner.invoke(app, ["config", "show", "sft_sort", "optim.lrr=1"])
    assert bad.exit_code != 0 and "unknown key 'optim.lrr'; did you mean 'lr'" in " ".join(
        bad.output.replace("│", " ").split()), bad.output
    assert runner.invoke(app, ["config", "doc", "--check"]).exit_code == 0
    assert res.output.startswith("# the RL config of `minihf train`")
    assert sft.output.startswith("# the SFT config of `minihf sft`")
    # an RM recipe loads as SFT too (the same keys, other defaults): --kind rm shows RM's
    rm = runner.invoke(app, ["config", "show", "rm_sort", "--kind", "rm"])
    assert rm.exit_code == 0 and rm.output.startswith("# the RM config of `minihf rm`"), rm.output
    line = next(x for x in rm.output.splitlines() if x.strip().startswith("experiment_name:"))
    assert line.split("#")[1].strip().startswith(f"default {RMConfig().trainer.experiment_name};")
    wrong = runner.invoke(app, ["config", "show", "grpo", "--kind", "sft"])
    assert wrong.exit_code != 0 and "unknown key" in wrong.output
    odd = runner.invoke(app, ["config", "show", "grpo", "--kind", "dpo"])
    assert odd.exit_code != 0 and "--kind 'dpo': use auto, rl, sft or rm" in odd.output
