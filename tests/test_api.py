"""The Python entry points (``minihf.train``, ``train_sft``, ``train_rm``): a job in the
calling process that returns its result, raises its errors (the process lives on, and runs
the next job), and installs nothing process-wide."""

import pytest

import minihf
from minihf.config import ConfigError

from test_install import TINY

BOOM = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("a broken reward")
'''


@pytest.fixture
def no_process_wide_effects(monkeypatch):
    """What only the scripts and the CLI may install: fails the test if called."""
    import importlib
    import signal

    launch = importlib.import_module("minihf.controller.launch")

    def forbidden(*args):
        raise AssertionError("a process-wide side effect in an in-process job")
    monkeypatch.setattr(launch, "skip_final_gc", forbidden)
    monkeypatch.setattr(launch, "die_with_launcher", forbidden)
    monkeypatch.setattr(launch.os, "_exit", forbidden)
    handler = signal.getsignal(signal.SIGINT)
    yield
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C stays the caller's


def test_train_in_process_returns_raises_and_runs_again(tmp_path, monkeypatch, no_process_wide_effects):
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.total_trainig_steps'.*did you mean"):
        minihf.train("grpo", ["trainer.total_trainig_steps=2"])
    with pytest.raises(ConfigError, match=r"controller.placement.actor.ranks: \[1\] out of range for world size 1"):
        minihf.train("grpo", TINY + ["controller.placement.actor.ranks=[1]"])
    assert not (tmp_path / "outputs" / "data").exists()  # (it failed after the preparation: data, model, SFT)
    result = minihf.train("grpo", TINY)
    assert [row["step"] for row in result.history] == [0, 1, 2]
    assert "val-core/mean" in result.metrics and "actor/pg_loss" in result.metrics
    assert result.run_dir == (tmp_path / "outputs" / "grpo_sort").resolve()
    assert (result.run_dir / "global_step_2").is_dir() and not dist.is_initialized()

    (tmp_path / "boom.py").write_text(BOOM)
    with pytest.raises(Exception, match="a broken reward"):   # raised here; the process lives on
        minihf.train("grpo", TINY + ["trainer.default_local_dir=outputs/boom",
                                     f"custom_reward_function.path={tmp_path}/boom.py"])
    assert not dist.is_initialized()
    again = minihf.train("grpo", TINY + ["trainer.default_local_dir=outputs/again"])  # the next job runs
    assert again.metrics["step"] == 2


def test_train_sft_and_rm_in_process(tmp_path, monkeypatch, no_process_wide_effects):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    monkeypatch.chdir(tmp_path)
    init_model("model", size="tiny", task="sort")
    make_task_data("sort", "data", 32, 8)
    make_task_data("sort", "pairs", 32, 8, pairs=True)
    sft = minihf.train_sft("sft_sort", ["model.path=model", "data.train_files=data/train.parquet",
                                        "data.val_files=data/test.parquet", "data.train_batch_size=8",
                                        "trainer.total_training_steps=2", "trainer.default_local_dir=sft"])
    assert sft.metrics["step"] == 2 and "val/loss" in sft.metrics and (sft.run_dir / "hf" / "config.json").is_file()
    rm = minihf.train_rm("rm_sort", ["model.path=sft/hf", "data.train_files=pairs/train.parquet",
                                     "data.val_files=pairs/test.parquet", "data.train_batch_size=8",
                                     "trainer.total_training_steps=2", "trainer.default_local_dir=rm"])
    assert rm.metrics["step"] == 2 and (rm.run_dir / "hf" / "config.json").is_file()
    with pytest.raises(Exception, match=r"data.train_batch_size=64 exceeds the 32 training rows in "
                                        r"data/train.parquet"):  # was the sampler's own words
        minihf.train_sft("sft_sort", ["model.path=model", "data.train_files=data/train.parquet",
                                      "data.val_files=null", "data.train_batch_size=64",
                                      "trainer.total_training_steps=1", "trainer.default_local_dir=sft_big"])
    with pytest.raises(ValueError, match="not with a config object"):
        from minihf.trainer.sft import SFTConfig
        minihf.train_sft(SFTConfig(), ["trainer.total_training_steps=2"])


def test_arguments_of_the_wrong_kind_are_refused_before_anything_runs():
    """A string of overrides was iterated by character ("override 't' must look like
    key.sub=value"), a dict kept only its keys, a list of tuples failed on ``startswith``, and
    overrides passed as the recipe failed inside pathlib."""
    for call, says in ((lambda: minihf.train("grpo", "trainer.total_training_steps=1"), "overrides must be a list of"),
                       (lambda: minihf.train("grpo", {"trainer.total_training_steps": 1}), "overrides must be a list"),
                       (lambda: minihf.train("grpo", [("trainer.total_training_steps", 1)]), "overrides must be a"),
                       (lambda: minihf.train(["trainer.total_training_steps=1"]), "recipe must be a name, a folder or "
                                                                                   "a YAML path"),
                       (lambda: minihf.train_sft(5), "recipe must be a name"),
                       (lambda: minihf.train_rm(None, "x=1"), "overrides must be a list")):
        with pytest.raises(TypeError, match=says):
            call()
    from minihf.api import _config
    from minihf.trainer.ppo_job import PPOJobConfig

    steps = (o for o in ["trainer.total_training_steps=7"])  # a generator: read once, all of it
    assert _config(PPOJobConfig, "grpo", steps).trainer.total_training_steps == 7
    assert _config(PPOJobConfig, "grpo", None).trainer.total_training_steps == \
        _config(PPOJobConfig, "grpo", ()).trainer.total_training_steps


def test_a_reward_past_floats_range_is_named():
    from minihf.data.rewards import RewardError, _as_float

    with pytest.raises(RewardError, match="for sample 3 .*it must be a number"):
        _as_float(10 ** 400, 3, "sort", "score")
