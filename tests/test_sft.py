"""SFT end to end on 2 gloo ranks: loss goes down, validation runs, a resumed run matches
an uninterrupted one, the HF export loads in transformers with the same logits."""

import json
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minihf.config import ConfigError, load_config
from minihf.controller import run
from minihf.workers.optim import OptimConfig
from minihf.trainer.sft import SFTConfig, SFTDataConfig, SFTDriver, SFTTrainerConfig, sft_roles
from minihf.testing import spawn_ranks
from minihf.workers.config import ModelConfig


def config(model, data, out, steps, **trainer):
    return SFTConfig(
        model=ModelConfig(path=model),
        data=SFTDataConfig(train_files=f"{data}/train.parquet", val_files=f"{data}/test.parquet",
                           response_key="extra_info.answer", train_batch_size=8,
                           micro_batch_size_per_gpu=None, max_tokens_per_micro_batch=40,
                           val_batch_size=7),
        optim=OptimConfig(lr=3e-3, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1,
                          weight_decay=0.0),
        trainer=SFTTrainerConfig(total_training_steps=steps, default_local_dir=out, **trainer))


def _fit(cfg, stop_after):
    return lambda groups: SFTDriver(cfg, groups["sft"]).fit(stop_after=stop_after)


def to_legacy(step_dir: Path, step: int) -> None:
    """A checkpoint of this layout rewritten as minihf wrote SFT checkpoints before the common
    loop: the worker's shards at ``global_step_N`` itself, the step and the sampler position
    in each rank's ``extra``, no driver state file."""
    state = json.loads((step_dir / "driver_state.json").read_text())
    for f in (step_dir / "sft" / "extra").glob("rank_*.pt"):
        saved = torch.load(f, weights_only=False)
        saved["extra"] = {"sampler": state["sampler"], "step": step}
        torch.save(saved, f)
    for item in (step_dir / "sft").iterdir():
        item.rename(step_dir / item.name)
    (step_dir / "sft").rmdir()
    (step_dir / "driver_state.json").unlink()


def _job(rank, world, cfgs):
    # jobs in a row in the same processes, as separate launches would be: the full run, the
    # split run stopped after step 3, its resumption from the checkpoint dir; a run stopped
    # after step 2 before its first checkpoint, and its rerun (a fresh start); the split run's
    # step-3 checkpoint in the old layout, resumed
    out = []
    for i, (c, stop) in enumerate(zip(cfgs, [None, 3, None, 2, None, None])):
        out.append(run(_fit(c, stop), sft_roles(c), c.controller))
        if i == 1:  # copy the step-3 checkpoint before the resumption adds to the dir
            legacy = Path(cfgs[5].trainer.default_local_dir)
            if rank == 0:
                shutil.copytree(c.trainer.default_local_dir, legacy.with_suffix(".tmp"))
                to_legacy(legacy.with_suffix(".tmp") / "global_step_3", 3)
                legacy.with_suffix(".tmp").rename(legacy)
            while not legacy.is_dir():
                time.sleep(0.05)
    return out


def test_sft_two_ranks_loss_decreases_resume_matches_export_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.models import load_hf

    model = str(init_model(tmp_path / "model", task="digits"))
    make_task_data("digits", tmp_path / "data", num_train=96, num_test=10)
    data = str(tmp_path / "data")
    full = config(model, data, str(tmp_path / "full"), 8, test_freq=4)
    first = config(model, data, str(tmp_path / "split"), 8, save_freq=3)  # stops after 3
    second = config(model, data, str(tmp_path / "split"), 8, save_freq=3)
    early = [config(model, data, str(tmp_path / "early"), 4, save_freq=3) for _ in range(2)]
    legacy = config(model, data, str(tmp_path / "legacy"), 8, save_freq=3)
    hist_full, hist_a, hist_b, _, _, hist_legacy = spawn_ranks(
        _job, 2, [full, first, second, *early, legacy], timeout_s=240)[0]
    rows = [json.loads(x)["step"] for x in (tmp_path / "early" / "metrics.jsonl").read_text().splitlines()]
    assert rows == sorted(set(rows)) and rows[-1] == 4, rows   # each step once after the rerun
    assert [m["step"] for m in hist_a] == [1, 2, 3]

    losses = [m["train/loss"] for m in hist_full]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.3, losses
    assert "val/loss" in hist_full[3] and "val/loss" in hist_full[-1]
    assert all(m["train/grad_norm"] > 0 for m in hist_full)

    # resumed at step 3: steps 4..8 equal the uninterrupted run's (data order, LR, Adam)
    assert [m["step"] for m in hist_b] == [4, 5, 6, 7, 8]

    # resuming under another learning rate is refused, naming the key; a longer run is fine
    import pytest

    from minihf.config import ConfigError
    from minihf.trainer.common import resume_config_changes

    ckpt = tmp_path / "split" / "global_step_8"
    assert resume_config_changes(ckpt, second) == []
    longer = config(model, data, str(tmp_path / "split"), 10, save_freq=3)
    assert resume_config_changes(ckpt, longer) == ["trainer.total_training_steps"]
    other_lr = config(model, data, str(tmp_path / "split"), 8, save_freq=3)
    other_lr.optim.lr = 1e-3
    with pytest.raises(ConfigError, match=r"optim.lr: 0.003 in the checkpoint, 0.001 now.*"
                                          r"trainer.resume_mode=disable"):
        resume_config_changes(ckpt, other_lr)
    for a, b in zip(hist_full[3:], hist_b):
        assert a["train/loss"] == b["train/loss"] and a["train/lr"] == b["train/lr"]
    # a checkpoint of the old layout resumes to the same steps
    assert [(m["step"], m["train/loss"]) for m in hist_legacy] == [(m["step"], m["train/loss"]) for m in hist_b]
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 8

    ours = load_hf(tmp_path / "full" / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full" / "hf")).eval()
    ids = torch.tensor([[1, 5, 7, 9, 3, 4]])
    with torch.no_grad():
        diff = (ours(ids, torch.arange(6)[None]) - theirs(ids).logits).abs().max().item()
    assert diff < 1e-4  # other kernels: ~50 ulp even at |z| ~ 16
    # the final validation loss against the exported weights, computed here in one
    # process: token-mean NLL over the response tokens of every validation row
    from minihf.data import SFTDataset, load_tokenizer
    from minihf.workers.forward import forward_token_log_probs
    tok = load_tokenizer(model, padding_side="right")
    val = SFTDataset(f"{data}/test.parquet", tok, response_key="extra_info.answer").collate(range(10))
    mask = (val["loss_mask"][:, 1:] * val["attention_mask"][:, 1:]).float()
    with torch.no_grad():
        nll = -forward_token_log_probs(ours, val.tensors, use_remove_padding=False)
    ref_val = ((nll * mask).sum() / mask.sum()).item()
    # one process vs the 2-rank validation: fp32 sums in another order; rel 1e-5 is ~80 ulp
    assert abs(hist_full[-1]["val/loss"] - ref_val) <= 1e-5 * ref_val, (hist_full[-1], ref_val)

    # the resumed run ends with bit-identical weights
    split = load_hf(tmp_path / "split" / "hf").state_dict()
    assert all(torch.equal(v, split[k]) for k, v in ours.state_dict().items())

    moved = max((p - q).abs().max().item() for p, q in
                zip(ours.state_dict().values(), load_hf(model).state_dict().values()))
    assert moved > 1e-3
    assert (tmp_path / "full" / "hf" / "tokenizer.json").exists()


def test_sft_cli_names_missing_model_and_data(tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app
    from minihf.hub import init_model

    def run(*args):
        res = CliRunner().invoke(app, ["sft", *args])
        assert res.exit_code == 2, res.output  # a usage error, not a traceback
        # the error box wraps long paths anywhere: compare without spaces and box drawing
        return "".join(c for c in res.output if not c.isspace() and c not in "│╭╮╰╯─")

    out = run(f"model.path={tmp_path / 'nope'}")
    assert "doesnotexist" in out and "init-model" in out
    (tmp_path / "empty").mkdir()
    assert "hasnoconfig.json" in run(f"model.path={tmp_path / 'empty'}")
    model = str(init_model(tmp_path / "model", task="digits"))
    out = run(f"model.path={model}", f"data.train_files={tmp_path / 'x.parquet'}")
    assert "data.train_files" in out and "x.parquet" in out
    assert "unknownkey'data.trian_files'" in run("data.trian_files=a")


def test_the_schedule_keys_mean_what_rl_and_verl_mean():
    """``test_freq`` / ``save_freq`` of 0 or -1 (verl's SFT default, and the RL recipes'):
    only at the end; N: every N steps and at the end. ``log_freq`` below 1 is refused at load
    (it was accepted and then divided by)."""
    for freq, want in ((-1, [7]), (0, [7]), (3, [3, 6, 7])):
        driver = SimpleNamespace(cfg=SimpleNamespace(trainer=SFTTrainerConfig(test_freq=freq, save_freq=freq)),
                                 total_steps=7)
        assert [s for s in range(1, 8) if SFTDriver.validate_at(driver, s)] == want
        assert [s for s in range(1, 8) if SFTDriver.save_at(driver, s)] == want
    with pytest.raises(ConfigError, match=r"trainer.log_freq=0 must be >= 1"):
        load_config(SFTConfig, None, ["trainer.log_freq=0"])


def test_data_sizes_and_the_context_are_checked_at_load(tmp_path):
    """SFT and RM ``data``: a micro-batch, token budget or length below 1 is refused at load
    (they were accepted and failed inside the first step without the key, or, for
    ``max_length=0`` with left truncation, kept whole sequences); a ``max_length`` past the
    model's context is refused before any process group, naming both."""
    from minihf.hub import init_model
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import check_paths

    for cls in (SFTConfig, RMConfig):
        for override, says in (("data.micro_batch_size_per_gpu=0", "data: micro-batch size 0 must be >= 1"),
                               ("data.max_tokens_per_micro_batch=0", "data: max_tokens_per_micro_batch=0 must be >= 1"),
                               ("data.max_length=0", "data: max_length=0 must be >= 1"),
                               ("data.seed=-1", "data: seed=-1 must be >= 0")):
            with pytest.raises(ConfigError, match=re.escape(says)):
                load_config(cls, None, [override])
    model = init_model(tmp_path / "m", size="tiny", task="digits", max_position_embeddings=64)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1", "response": "2"}\n')
    base = [f"model.path={model}", f"data.train_files={tmp_path}/train.jsonl",
            f"trainer.default_local_dir={tmp_path}/run"]
    check_paths(load_config(SFTConfig, None, base + ["data.max_length=64"]))
    for cls in (SFTConfig, RMConfig):
        with pytest.raises(ConfigError, match=re.escape("data.max_length=65 exceeds the model's context, "
                                                        f"max_position_embeddings=64 (model.path={model}); "
                                                        "set data.max_length to at most 64")):
            check_paths(load_config(cls, None, base + ["data.max_length=65"]))


def test_a_tokenizer_past_the_models_vocabulary_is_refused_before_training(tmp_path):
    """Another model's tokenizer files (more tokens than config.json's ``vocab_size``):
    SFT and RM refuse the data's first id past the embedding, naming both, before any step
    (it was an IndexError inside ``F.embedding``, a device assert on CUDA)."""
    import shutil

    from minihf.hub import init_model
    from minihf.trainer.rm import RMConfig, RMDriver

    model = init_model(tmp_path / "m", size="tiny", task="digits")
    other = init_model(tmp_path / "other", size="tiny", task="chat_arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (other / f).exists():
            shutil.copy(other / f, model / f)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "What is 1+2?", "response": "3"}\n')
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "What is 1+2?", "chosen": "3", "rejected": "4"}\n')
    says = (r"data .*{}: token id \d+ \('.*'\) is past the model's vocabulary of \d+ \(vocab_size in "
            rf"{model}/config.json\); the tokenizer \(\d+ tokens\) is not this model's")
    for cls, driver, data in ((SFTConfig, SFTDriver, "sft.jsonl"), (RMConfig, RMDriver, "pairs.jsonl")):
        cfg = load_config(cls, None, [f"model.path={model}", f"data.train_files={tmp_path / data}",
                                      "data.train_batch_size=1", f"trainer.default_local_dir={tmp_path / 'run'}"])
        with pytest.raises(ValueError, match=says.format(re.escape(data))):
            driver(cfg, SimpleNamespace(dp_size=1))
