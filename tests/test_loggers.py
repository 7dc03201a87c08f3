"""``trainer.logger``: wandb (offline) and tensorboard receive every step's metrics, equal to
metrics.jsonl, and the samples as a wandb Table; a tracker whose package is missing is a
config error naming the install command."""

import json
import math

import pytest

from minihf.config import ConfigError, load_config
from minihf.testing import spawn_ranks


def _run(rank, world, model, data, out, loggers):
    import os

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    import wandb

    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    sent, real_init = [], wandb.init

    def init(*args, **kwargs):  # record what minihf hands the real (offline) run
        wandb_run = real_init(*args, **kwargs)
        real_log = wandb_run.log

        def log(data, step=None, **kw):
            sent.append({"step": step, "keys": sorted(data),
                         "scalars": {k: v for k, v in data.items() if isinstance(v, float)}})
            return real_log(data, step=step, **kw)
        wandb_run.log = log
        sent.append({"config": sorted(kwargs["config"]), "project": kwargs["project"], "name": kwargs["name"]})
        return wandb_run
    wandb.init = init

    cfg = load_config(PPOJobConfig, "grpo", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", "data.max_prompt_length=16", "data.max_response_length=8",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.log_samples_freq=1",
        f"trainer.logger={loggers}", f"trainer.default_local_dir={out}", "trainer.experiment_name=logged",
        "prepare.task=null", "prepare.sft_recipe=null", "controller.timeout_s=120"])
    history = run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)
    return history, sent


def test_wandb_offline_and_tensorboard_get_every_metric(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 16, 4)
    out = tmp_path / "run"
    _, sent = spawn_ranks(_run, 1, str(tmp_path / "m"), str(tmp_path / "d"), str(out),
                          "[console,jsonl,wandb,tensorboard]", timeout_s=300)[0]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("critic/score/mean", "actor/pg_loss", "val-core/mean", "timing_s/step"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        want = {r["step"]: r[key] for r in rows if key in r and math.isfinite(r[key])}
        assert logged.keys() == want.keys(), key
        # TensorBoard stores float32: one rounding of the float64 figure, rel <= 6e-8 < 1e-6
        assert all(logged[s] == pytest.approx(want[s], rel=1e-6) for s in want), key

    assert sent[0]["project"] == "minihf" and sent[0]["name"] == "logged" and "actor_rollout_ref" in sent[0]["config"]
    metrics = [c for c in sent[1:] if not any(k.startswith("samples/") for k in c["keys"])]
    assert [c["step"] for c in metrics] == [0, 1, 2]
    for c, r in zip(metrics, rows):                          # every numeric metric, as in metrics.jsonl
        assert c["scalars"] == {k: float(v) for k, v in r.items()
                                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    tables = {k: c["step"] for c in sent[1:] for k in c["keys"] if k.startswith("samples/")}
    assert set(tables) == {"samples/train", "samples/val"}
    runs = list((out / "wandb").glob("offline-run-*"))      # the offline run wandb wrote
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert list((runs[0] / "files" / "media" / "table" / "samples").glob("train_*.table.json"))


def test_missing_tracker_package_is_a_config_error(monkeypatch):
    import importlib.util

    from minihf.trainer.ppo_job import PPOJobConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trainer.logger includes 'wandb' but the wandb package is not installed: "
                                          r"pip install -e '.\[wandb\]'"):
        load_config(PPOJobConfig, "grpo", ["trainer.logger=[console,wandb]"])
    with pytest.raises(ConfigError, match=r"trainer.logger: unknown \['mlflow'\]; choose from \['console', 'jsonl', "
                                          r"'wandb', 'tensorboard'\]"):
        load_config(PPOJobConfig, "grpo", ["trainer.logger=[mlflow]"])


class Terminal:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_console_draws_a_progress_bar_on_a_terminal_and_lines_elsewhere():
    from minihf.trainer.loggers import Console

    logged = []
    term = Terminal()
    console = Console(total=10, log=logged.append, labels={}, stream=term)
    console.step({"step": 1, "critic/score/mean": 0.25, "actor/kl_loss": 0.001, "response_length/mean": 7.5,
                  "timing_s/step": 2.0}, "step=1 score=0.25")
    assert term.text.startswith("\r[##..................] 1/10  10% ETA 0m18s score=0.25 len=7.5 kl=0.001 2.00 s/step")
    assert logged == []                                     # a step redraws the bar, it does not print a line
    console.message("warning: entropy collapsed")           # messages go above the bar
    assert term.text.endswith("\n") and logged == ["warning: entropy collapsed"]
    console.step({"step": 2, "val-core/mean": 0.5}, "step=2 val=0.5")
    assert logged[-1] == "step=2 val=0.5" and term.text.count("\r[") == 2  # validations stay on screen
    console.close()
    assert term.text.endswith("\n")

    plain = []
    Console(total=10, log=plain.append, labels={}, stream=None).step({"step": 1}, "step=1 score=0.25")
    assert plain == ["step=1 score=0.25"]                  # pytest's stdout is not a terminal


def test_wandb_that_cannot_start_is_one_clear_error(tmp_path, monkeypatch):
    """wandb.init raising (no API key on a machine that never logged in) becomes an error
    naming trainer.logger and the ways out, not a traceback from inside wandb."""
    wandb = pytest.importorskip("wandb")
    from minihf.trainer.loggers import Trackers

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")
    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(ValueError) as err:
        Trackers(["console", "wandb"], tmp_path, "p", "e", {})
    msg = str(err.value)
    assert msg.startswith("trainer.logger includes 'wandb' but wandb.init failed: No API key"), msg
    assert "WANDB_MODE=offline" in msg and "WANDB_API_KEY" in msg
