"""Driver scaffolding: metrics.jsonl cut back on resume, the resume config check, the
verl schedule, the atomic HF export."""

import json

import pytest
import torch

from minihf.config import ConfigError
from minihf.trainer.common import (MetricsLog, check_resume_config, check_run_length, every,
                                   nothing_to_train)


def test_metrics_log_cut_back_to_the_resumed_step(tmp_path):
    log = MetricsLog(tmp_path)
    for step in (0, 1, 2, 3, 4, 5):  # a run that died after step 5, checkpointed at 3
        log.append({"step": step, "x": step * 1.5})
    log.resume_at(3)
    log.append({"step": 4, "x": -1.0})
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["x"] == -1.0
    MetricsLog(tmp_path / "fresh").resume_at(3)  # nothing written yet: nothing to cut


def test_resume_config_check():
    saved = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "trainer": {"total_training_steps": 4},
             "controller": {"timeout_s": 60}}
    now = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "trainer": {"total_training_steps": 8},
           "controller": {"timeout_s": 90}}
    assert check_resume_config(saved, now, "ck") == ["controller.timeout_s",
                                                      "trainer.total_training_steps"]
    now["optim"]["lr"] = 0.2
    now["data"] = {"train_batch_size": 8}
    with pytest.raises(ConfigError, match=r"data.train_batch_size: None in the checkpoint, 8 "
                                          r"now; optim.lr: 0.1 in the checkpoint, 0.2 now"):
        check_resume_config(saved, now, "ck")


def test_verl_schedule():
    assert [s for s in range(1, 11) if every(4, s, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if every(-1, s, 10)] == []


def test_interrupted_export_is_redone(tmp_path, monkeypatch):
    """An export killed half way leaves no model at the target; the next one writes it."""
    import minihf.hub as ckpt
    from minihf.hub import init_model
    from minihf.models import load_hf, save_hf
    from minihf.testing import spawn_ranks

    model_dir = init_model(tmp_path / "m", task="digits")
    spawn_ranks(_save, 1, str(model_dir), str(tmp_path / "ck"), timeout_s=120)

    def dies(model, out):
        raise KeyboardInterrupt  # as if killed while writing

    monkeypatch.setattr("minihf.hub.export.save_hf", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.export_hf(tmp_path / "ck", tmp_path / "hf")
    assert not (tmp_path / "hf" / "config.json").exists()
    monkeypatch.setattr("minihf.hub.export.save_hf", save_hf)
    ckpt.export_hf(tmp_path / "ck", tmp_path / "hf")
    assert load_hf(tmp_path / "hf") is not None


def _save(rank, world, model_dir, out):
    import torch.distributed as dist

    from minihf.models import load_hf
    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh
    from minihf.workers.optim import OptimConfig, build_optimizer
    from minihf.utils.checkpoint import save_checkpoint

    model = apply_fsdp(load_hf(model_dir), fsdp_mesh(dist.group.WORLD, "cpu"))
    opt = build_optimizer(model.parameters(), OptimConfig())
    save_checkpoint(out, model, opt, None, group=dist.group.WORLD, hf_source=model_dir)


def test_a_finished_run_says_there_is_nothing_to_train(tmp_path):
    assert nothing_to_train(tmp_path, 149, 150) is None
    for step, total in ((150, 150), (150, 100)):  # done, or a config that now trains fewer
        msg = nothing_to_train(tmp_path, step, total)
        assert msg.startswith(f"the run in {tmp_path} has done {step} steps and this config "
                              f"trains {total}: nothing to train"), msg
        assert "trainer.total_training_steps" in msg and "trainer.default_local_dir" in msg


@pytest.mark.parametrize("kind", ["rl", "sft", "rm"])
def test_run_length_is_checked_when_the_config_loads(kind):
    """total_epochs / total_training_steps below 1 fail at load, naming the key (a zero step
    count used to pass and fail later inside the actor's optimizer set-up)."""
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import SFTConfig

    cls = {"rl": PPOJobConfig, "sft": SFTConfig, "rm": RMConfig}[kind]
    for override, text in (("trainer.total_training_steps=0", "trainer.total_training_steps=0 must"),
                           ("trainer.total_epochs=0", "trainer.total_epochs=0 must"),
                           ("trainer.total_training_steps=-3", "trainer.total_training_steps=-3 must")):
        with pytest.raises(ConfigError, match=text):
            load_config(cls, None, [override])
    check_run_length(1, None)
    check_run_length(2, 1)


def test_check_rollout_log_probs_names_the_worst_token():
    import numpy as np

    from minihf.trainer.metrics import check_rollout_log_probs

    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    bound = torch.full((2, 3), 1e-4)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    uids = np.array(["a", "b"], dtype=object)
    engine = trainer + torch.tensor([[5e-5, -2e-5, 0.0], [0.0, 1e-5, 9.0]])   # the 9 is padding
    m, message = check_rollout_log_probs(engine, trainer, bound, mask, 3, "error", uids)
    # the gaps are fp32 sums near 1 (ulp 1.2e-7): their ratios to 1e-4 carry ~1e-3 of it
    assert message is None and m["training/rollout_log_prob_bound_ratio"] == pytest.approx(0.5, rel=2e-3)
    engine[1, 1] += 3e-4                                                      # 3.1x the bound
    m, message = check_rollout_log_probs(engine, trainer, bound, mask, 3, "warn", uids)
    assert m["training/rollout_log_prob_bound_ratio"] == pytest.approx(3.1, rel=2e-3)
    assert "step 3" in message and "row 1 (uid b), response token 1" in message
    assert "1 of 5 tokens" in message
    with pytest.raises(RuntimeError, match=r"step 3: .* row 1 \(uid b\), response token 1 .* 3\.1x"):
        check_rollout_log_probs(engine, trainer, bound, mask, 3, "error", uids)
    assert check_rollout_log_probs(engine, trainer, bound, torch.zeros(2, 3), 3, "error") == ({}, None)


def test_metrics_log_cuts_a_torn_last_line_and_names_a_broken_one(tmp_path):
    from minihf.utils.files import CorruptFileError

    log = MetricsLog(tmp_path)
    log.append({"step": 0, "v": 1}, {"step": 1, "v": 2}, {"step": 2, "v": 3})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "v"')                         # killed mid-write
    with pytest.warns(UserWarning, match=r"cut a torn last line 4"):
        log.resume_at(2)
    assert [json.loads(x)["step"] for x in log.path.read_text().splitlines()] == [0, 1, 2]
    log.path.write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n')
    with pytest.raises(CorruptFileError, match=r"metrics.jsonl line 2 is not JSON"):
        log.resume_at(2)
    log.path.write_text('{"step": 0}\n{"step": 1}\n')     # an attempt stopped before any checkpoint
    log.start_fresh()
    assert log.path.read_text() == ""


def test_summary_says_when_only_one_validation_ran():
    from types import SimpleNamespace

    from minihf.trainer.record import RunRecord

    for vals, want in (([0.35], "validation score: 0.3500 (the only validation this run;"),
                       ([0.35, 0.5, 0.9], "validation score: 0.3500 (first) -> 0.9000 (last)")):
        lines = []
        RunRecord.close(SimpleNamespace(history=[{"val-core/mean": v} for v in vals], trackers=None,
                                        console=SimpleNamespace(close=lambda: None),
                                        phase_totals={"gen": 1.0}, log=lines.append), 2.0, {})
        assert lines[0].startswith(want) and lines[1] == "wall time 2.0s; by phase: gen 1.0s"


def test_a_steps_metrics_are_numbers():
    """A plug-in's metric given as a tensor or numpy value is read out; a string or a vector
    was written to metrics.jsonl as its repr (and dropped by the trackers): now refused."""
    import numpy as np

    from minihf.trainer.record import numbers_only

    got = numbers_only({"step": 3, "a": torch.tensor(2.5), "b": np.float32(1.5), "c": torch.ones(1, 1), "d": 0.1})
    assert got == {"step": 3, "a": 2.5, "b": 1.5, "c": 1.0, "d": 0.1}
    assert all(type(v) in (int, float) for v in got.values())
    for bad in ("high", torch.ones(3), np.zeros(2), None, [1.0]):
        with pytest.raises(ValueError, match="metric 'm' = .* is not a number; a step's metrics are numbers"):
            numbers_only({"step": 1, "m": bad})


def test_a_run_records_its_metrics_as_numbers(tmp_path):
    """``RunRecord.record`` (every RL row's way to metrics.jsonl and the history) reads a
    plug-in's tensor out and refuses a string before anything is written."""
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.record import RunRecord

    cfg = load_config(PPOJobConfig, "grpo", ["trainer.logger=[jsonl]"])
    record = RunRecord(cfg, tmp_path, 2, log=lambda line: None)
    record.record({"step": 1, "recipe/loss": torch.tensor(0.25)})
    assert record.history == [{"step": 1, "recipe/loss": 0.25}]
    with pytest.raises(ValueError, match="metric 'recipe/note' = 'hi' is not a number"):
        record.record({"step": 2, "recipe/note": "hi"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "recipe/loss": 0.25}] and len(record.history) == 1
