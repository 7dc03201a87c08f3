"""``trainer.profile_steps``: the option's checks, and the per-process profile (one per
process however many roles share it). The 2-rank run that profiles a step, per-rank files
and unchanged results: ``test_ppo.py::test_two_processes_and_resume_equals_uninterrupted``."""

import json

import pytest
import torch

from minihf.config import ConfigError, load_config
from minihf.utils import profiling


def test_profile_steps_are_checked_naming_the_value():
    from minihf.trainer.ppo_job import PPOJobConfig

    assert load_config(PPOJobConfig, "grpo", []).trainer.profile_steps == []
    cfg = load_config(PPOJobConfig, "grpo", ["trainer.profile_steps=[50,2,2]"])
    assert cfg.trainer.profile_steps == [2, 50]
    with pytest.raises(ConfigError, match=r"profile_steps holds \[0\]: steps are integers from 1"):
        load_config(PPOJobConfig, "grpo", ["trainer.profile_steps=[0]"])
    with pytest.raises(ConfigError, match=r"profile_steps.*expected int, got 'two'"):
        load_config(PPOJobConfig, "grpo", ["trainer.profile_steps=[two]"])
    with pytest.raises(ValueError, match=r"profile_steps \[200\] lie past this run's last step \(150\)"):
        profiling.check_steps([2, 200], total_steps=150)       # what the loop checks at its start
    with pytest.raises(ValueError, match="must be a list of step numbers"):
        profiling.check_steps(3)


def test_one_profile_per_process_written_once(tmp_path):
    assert profiling.start(tmp_path / "p", "rank0", cuda=False)
    assert not profiling.start(tmp_path / "q", "rank0", cuda=False)   # a colocated role's: no-op
    torch.randn(64, 64) @ torch.randn(64, 64)
    table = profiling.stop()
    assert table == str(tmp_path / "p" / "rank0.txt") and profiling.stop() is None
    assert "aten::mm" in (tmp_path / "p" / "rank0.txt").read_text()
    trace = json.loads((tmp_path / "p" / "rank0.json").read_text())
    assert "aten::mm" in {e.get("name") for e in trace["traceEvents"]}
    assert not (tmp_path / "q").exists()
