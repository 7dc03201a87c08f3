"""Broken files get one line naming the path, what is wrong and the way out
(docs/reliability.md): model dirs (config.json, safetensors), checkpoints (shards, their
metadata, the latest-step pointer, the driver state), and the RL driver's resume."""

import json
import math
import shutil
import warnings

import pytest

from minihf.models import ModelArgs, build_model, init_weights
from minihf.utils.checkpoint import load_checkpoint, save_checkpoint
from minihf.utils.files import CorruptFileError

from test_fsdp import ARGS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("rel")
    init_model(root / "m", size="tiny", task="sort")
    return root / "m"


def broken_copy(model_dir, tmp_path, name, mutate):
    out = tmp_path / name.replace("/", "_")
    shutil.copytree(model_dir, out)
    target = out / name
    target.write_bytes(mutate(target.read_bytes()))
    return out


@pytest.mark.parametrize("name, mutate, message", [
    ("config.json", lambda b: b[:-20], r"config.json is not valid JSON \(.* at line \d+, column \d+\); re-export"),
    ("config.json", lambda b: b"", r"config.json is empty \(written only in part\?\)"),
    ("config.json", lambda b: b"\xff\xfe\x00bin", r"config.json is not UTF-8 text"),
    ("model.safetensors", lambda b: b"", r"model.safetensors is not a readable safetensors file \(.*0 bytes\)"),
    ("model.safetensors", lambda b: b[:len(b) // 2], r"model.safetensors is not a readable safetensors file"),
    ("generation_config.json", lambda b: b"{", r"generation_config.json is not valid JSON.*delete generation_config"),
])
def test_broken_model_dirs_name_the_file(model_dir, tmp_path, name, mutate, message):
    from minihf.models import load_hf
    from minihf.cli.generate import generate_text
    from minihf.rollout import SamplingParams

    bad = broken_copy(model_dir, tmp_path, name, mutate)
    with pytest.raises(CorruptFileError, match=message):
        if name == "generation_config.json":
            generate_text(bad, ["1,2"], SamplingParams(max_tokens=2))
        else:
            load_hf(bad)


def test_broken_model_dir_through_the_cli_is_one_line(model_dir, tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app

    bad = broken_copy(model_dir, tmp_path, "config.json", lambda b: b[:-20])
    res = CliRunner().invoke(app, ["generate", str(bad), "-p", "1,2"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "config.jsonisnotvalidJSON" in "".join(res.output.replace("│", " ").split())  # Rich wraps paths


def small(**overrides):
    return init_weights(build_model(ModelArgs(**{**ARGS, **overrides}), "lm"), seed=0)


def test_broken_checkpoints_name_the_shard_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, small(), extra={"step": 1})
    load_checkpoint(ckpt, small())                                   # the intact one loads
    with pytest.raises(CorruptFileError, match=r"model: it was written for a model of a different shape \(.*Size mismatch.*"
                                               r"trainer.resume_mode=disable"):
        load_checkpoint(ckpt, small(intermediate_size=96))
    shard = next((ckpt / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match=r"cannot load the checkpoint shards in .*model: .*damaged shard"):
        load_checkpoint(ckpt, small())
    (ckpt / "model" / ".metadata").unlink()
    with pytest.raises(CorruptFileError, match=r"model has no .metadata file \(the checkpoint was not written "
                                               r"completely\); resume from an earlier global_step_N"):
        load_checkpoint(ckpt, small())


@pytest.mark.parametrize("content, message", [
    ("", r"holds nothing, not a step number"),
    ("12abc\n", r"holds '12abc', not a step number"),
    ("7\n", r"points at global_step_7, which does not exist"),
])
def test_latest_checkpoint_pointer(tmp_path, content, message):
    from minihf.trainer.common import LATEST, find_resume_path

    (tmp_path / LATEST).write_text(content)
    with pytest.raises(CorruptFileError, match=message + r".*trainer.resume_mode=disable"):
        find_resume_path(str(tmp_path), "auto", None)
    (tmp_path / "global_step_7").mkdir()
    if content == "7\n":
        assert find_resume_path(str(tmp_path), "auto", None) == tmp_path / "global_step_7"


def test_saved_run_config_that_is_broken(tmp_path):
    from minihf.trainer.common import CONFIG_FILE, resume_config_changes

    (tmp_path / CONFIG_FILE).write_text('{"data": ')
    with pytest.raises(CorruptFileError, match=rf"{CONFIG_FILE} is not valid JSON"):
        resume_config_changes(tmp_path, None)


def test_run_dir_that_is_a_file_fails_at_start_up(model_dir, tmp_path):
    from minihf.config import ConfigError, load_config
    from minihf.data import make_task_data
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths
    from minihf.trainer.sft import SFTConfig, check_paths as check_sft_paths

    make_task_data("sort", tmp_path / "d", 4, 2)
    (tmp_path / "taken").write_text("x")
    common = [f"data.train_files={tmp_path}/d/train.parquet", f"trainer.default_local_dir={tmp_path}/taken/run"]
    cfg = load_config(PPOJobConfig, "grpo", common + [f"actor_rollout_ref.model.path={model_dir}"])
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir=.*taken/run.*taken is a file, not a directory"):
        check_paths(cfg)
    sft = load_config(SFTConfig, "sft_sort", common + [f"model.path={model_dir}", "data.val_files=null"])
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir=.*is a file"):
        check_sft_paths(sft)


def test_reward_that_returns_nan_names_the_sample():
    from minihf.data import RewardError, compute_score

    def fn(source, text, truth, info):
        return float("nan") if text == "b" else 1.0
    with pytest.raises(RewardError, match=r"returned score=nan for sample 1 \(data_source='s'\); it must be a "
                                          r"finite number"):
        compute_score(fn, ["s", "s"], ["a", "b"], [None, None])


def test_export_refuses_a_non_empty_target(tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app

    save_checkpoint(tmp_path / "ckpt", small())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert res.exit_code != 0 and "isnotempty;pass--overwrite" in "".join(res.output.replace("│", " ").split())
    assert (tmp_path / "out" / "keep.txt").exists()


def test_non_finite_gradient_skips_the_update():
    import torch

    from minihf.workers.optim import OptimConfig, build_lr_scheduler, build_optimizer
    from minihf.workers.train_step import train_minibatch

    model = small()
    cfg = OptimConfig(lr=1e-2, warmup_steps=2)
    opt = build_optimizer(model.parameters(), cfg)
    schedule = build_lr_scheduler(opt, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(0))

    def nan_loss(mb):
        return model(mb["ids"]).float().mean() * float("nan"), {}
    with warnings.catch_warnings():  # a skipped first update: torch's schedule warning leaked
        warnings.simplefilter("error")
        out = train_minibatch(model, opt, schedule, [{"ids": ids}], nan_loss, clip_grad=1.0)
    assert out["skipped"] == 1.0 and not math.isfinite(out["grad_norm"])
    assert schedule.last_epoch == 1  # the schedule still moved on
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def loss(mb):
        return model(mb["ids"]).float().logsumexp(-1).mean(), {}
    assert "skipped" not in train_minibatch(model, opt, None, [{"ids": ids}], loss, clip_grad=1.0)


def test_skip_counter_counts_and_stops_after_the_limit():
    from minihf.trainer.watch import SkipCounter

    skips = SkipCounter(limit=2)
    good = {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": 0.1}
    skips.check(good)
    assert good["training/skipped_steps"] == 0
    bad = {"step": 2, "actor/skipped_updates": 3.0}
    skips.check(bad)
    assert bad["training/skipped_steps"] == 1
    skips.check({"step": 3})                                          # a finite step resets the run
    skips.check({"step": 4, "critic/skipped_updates": 1.0})
    with pytest.raises(RuntimeError, match=r"2 steps in a row had a NaN/Inf loss or gradient in update_actor, "
                                           r"update_critic .*last finite step: step=3.*trainer.max_skipped_steps"):
        skips.check({"step": 5, "actor/skipped_updates": 1.0, "critic/skipped_updates": 2.0})
    assert skips.total == 3
    SkipCounter(limit=0).check({"step": 1, "actor/skipped_updates": 1.0})  # 0: never stops


def _blow_up(rank, world, model, data, out):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    cfg = load_config(PPOJobConfig, "grpo", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet", "data.val_files=null",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e30", "actor_rollout_ref.actor.optim.clip_grad=1e30",
        "trainer.total_training_steps=8", "trainer.max_skipped_steps=2", f"trainer.default_local_dir={out}",
        "prepare.task=null", "prepare.sft_recipe=null", "controller.timeout_s=120"])
    run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def test_rl_run_with_exploding_weights_stops_naming_the_phase(model_dir, tmp_path):
    from minihf.data import make_task_data
    from minihf.testing import spawn_ranks

    make_task_data("sort", tmp_path / "d", 16, 2)
    with pytest.raises(Exception, match=r"steps in a row had a NaN/Inf loss or gradient in update_actor"):
        spawn_ranks(_blow_up, 1, str(model_dir), str(tmp_path / "d"), str(tmp_path / "run"), timeout_s=300)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["training/skipped_steps"] >= 1


def test_every_entry_point_takes_the_same_keys_and_hints_the_dotted_path():
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import SFTConfig

    for cls, recipe in ((PPOJobConfig, "grpo"), (SFTConfig, "sft_sort"), (RMConfig, "rm_sort")):
        assert load_config(cls, recipe, ["controller.timeout_s=5"]).controller.timeout_s == 5.0
        # (RL configs also have custom_reward/cost_function.timeout_s: listed after it)
        with pytest.raises(ConfigError, match=r"unknown key 'timeout_s'; did you mean 'controller.timeout_s'"
                                              r"( or '[\w.]+')*\?"):
            load_config(cls, recipe, ["timeout_s=5"])
    with pytest.raises(ConfigError, match=r"did you mean 'actor_rollout_ref.actor.optim.lr' or 'cost_critic.optim.lr' "
                                          r"or 'critic.optim.lr'\?"):
        load_config(PPOJobConfig, "grpo", ["lr=1e-3"])


def test_make_data_with_nothing_to_write(tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app

    res = CliRunner().invoke(app, ["make-data", "sort", str(tmp_path / "d"), "--train", "0", "--test", "0"])
    assert res.exit_code != 0 and "train and test sizes are both 0: nothing to write" in " ".join(
        res.output.replace("│", " ").split())


def test_resume_with_a_longer_schedule_is_on_the_new_curve_at_once(tmp_path):
    import torch

    from minihf.workers.optim import OptimConfig, lr_factor
    from minihf.workers.train_state import TrainState

    cfg = OptimConfig(lr=1e-2, lr_scheduler="cosine", warmup_steps=0)
    state = TrainState(small(), cfg, total_steps=10)
    ids = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        state.step([{"ids": ids}], lambda mb: (state.model(mb["ids"]).float().logsumexp(-1).mean(), {}))
    state.save(str(tmp_path / "ckpt"))
    same = TrainState(small(), cfg, total_steps=10)
    same.load(str(tmp_path / "ckpt"))
    assert same.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]  # unchanged: bitwise
    longer = TrainState(small(), cfg, total_steps=20)
    longer.load(str(tmp_path / "ckpt"))
    want = 1e-2 * lr_factor(3, OptimConfig(lr=1e-2, lr_scheduler="cosine", warmup_steps=0, total_training_steps=20))
    # float64 lr from the same formula: approx's default rel=1e-6 only absorbs rounding
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(want)
    assert longer.optimizer.param_groups[0]["lr"] > state.optimizer.param_groups[0]["lr"]


def test_lengths_past_the_models_context_fail_at_start_up(model_dir, tmp_path):
    """data.max_response_length=100000 with a 2048-token model failed at the first
    validation, allocating its KV cache; now at start-up, naming both numbers."""
    import json

    from minihf.config import ConfigError, load_config
    from minihf.data import make_task_data
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths

    make_task_data("sort", tmp_path / "d", 4, 2)
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    common = [f"data.train_files={tmp_path}/d/train.parquet", f"data.val_files={tmp_path}/d/test.parquet",
              f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={tmp_path}/run"]
    cfg = load_config(PPOJobConfig, "grpo", common + ["data.max_response_length=100000"])
    with pytest.raises(ConfigError, match=rf"max_prompt_length \+ data.max_response_length = \d+ \+ 100000 "
                                          rf"exceeds the model's context, max_position_embeddings={context}"):
        check_paths(cfg)
    cfg = load_config(PPOJobConfig, "grpo", common + ["actor_rollout_ref.rollout.response_length=100000"])
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \+ actor_rollout_ref.rollout.response_length "
                                          r"= \d+ \+ 100000 exceeds"):  # the key that set it, not the data's
        check_paths(cfg)
    cfg = load_config(PPOJobConfig, "grpo", common + ["actor_rollout_ref.actor.max_tokens_per_micro_batch=3"])
    with pytest.warns(UserWarning, match=r"actor.max_tokens_per_micro_batch=3 is below the longest sequence"):
        check_paths(cfg)  # after the context: a length past it is named first (above), not the budget
    check_paths(load_config(PPOJobConfig, "grpo", common))   # the recipe's own lengths fit


def test_a_reward_that_never_returns_stops_the_run_or_scores_zero():
    """custom_reward_function.timeout_s: a call past it stops the run naming the sample and
    the function within about that long (the job hung before), or, with on_timeout=zero,
    scores 0 and counts it; the hung call is abandoned, the other samples are scored."""
    import threading
    import time

    from minihf.data import RewardError, compute_score

    release = threading.Event()

    def fn(source, text, truth, info):
        if text == "hang":
            release.wait(60)                                   # "never" returns
        return 1.0

    try:
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"reward function 'fn' did not return within timeout_s=0.2 on "
                                              r"sample 1 \(data_source='s'\)"):
            compute_score(fn, ["s"] * 3, ["a", "hang", "b"], ["x"] * 3, timeout_s=0.2)
        assert time.monotonic() - t0 < 5
        scores, extras = compute_score(fn, ["s"] * 4, ["a", "hang", "b", "hang"], ["x"] * 4,
                                       timeout_s=0.2, on_timeout="zero")
        assert scores == [1.0, 0.0, 1.0, 0.0] and extras["timed_out"] == [0.0, 1.0, 0.0, 1.0]
        assert compute_score(fn, ["s"], ["a"], ["x"]) == ([1.0], {})   # no limit: called directly
    finally:
        release.set()


def test_reward_timeout_config_errors():
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    cfg = load_config(PPOJobConfig, "grpo", ["custom_reward_function.timeout_s=5",
                                             "custom_reward_function.on_timeout=zero"])
    assert cfg.custom_reward_function.timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"timeout_s=0.0 must be > 0"):
        load_config(PPOJobConfig, "grpo", ["custom_reward_function.timeout_s=0"])
    with pytest.raises(ConfigError, match=r"on_timeout"):
        load_config(PPOJobConfig, "grpo", ["custom_reward_function.on_timeout=skip"])


@pytest.mark.parametrize("target", ["model/__0_0.distcp", "model/.metadata.tmp"])
def test_a_full_disk_while_saving_is_one_line(tmp_path, target):
    """Writes into /dev/full fail as on a full disk: torch's writer (a shard) reports only
    "unexpected pos 704 vs 598", Python's (DCP's metadata) ENOSPC; both become one line
    naming the checkpoint and what was kept."""
    from minihf.utils.files import WriteFailedError, short_write

    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    (tmp_path / "ckpt" / target).symlink_to("/dev/full")
    with pytest.raises(WriteFailedError, match=rf"could not write the checkpoint {tmp_path}/ckpt: no space left on device, "
                                               r"\d+ MiB free there now; it is incomplete and never used: "
                                               r"latest_checkpointed_iteration.txt still names the previous"):
        save_checkpoint(tmp_path / "ckpt", small(), extra={"step": 1})
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # e.g. a quota
    assert "a write stopped short (disk full or over quota?)" in str(short_write(torn, tmp_path, "x", "kept"))
    assert short_write(RuntimeError("shape mismatch"), tmp_path, "x", "kept") is None


def test_a_full_disk_during_an_rl_run_keeps_the_last_checkpoint(tmp_path):
    """The save of step 2 fails as on a full disk: the job ends with one line from the rank
    that wrote, the pointer still names step 1, and the same command, once there is space,
    resumes from step 1 and finishes."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    from test_controller_launch import _run
    from test_locks import _args

    init_model(tmp_path / "model", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "data", 16, 4, seed=0)
    run_dir = tmp_path / "run"
    shard = run_dir / "global_step_2" / "actor" / "model" / "__0_0.distcp"
    cmd = _args(tmp_path, run_dir, 3) + ["trainer.save_freq=1"]
    # the disk is full when step 2's shard is written: the shard's path leads to /dev/full,
    # laid once the driver has made way for the step dir (a stale one is cleared first)
    full_disk = ("import runpy, sys\nfrom pathlib import Path\nfrom minihf.trainer.loop import RunLoop\n"
                 "clear = RunLoop.own_history\n"
                 "def full_at_step_2(self, path):\n    clear(self, path)\n"
                 "    if path.name == 'global_step_2':\n"
                 f"        shard = Path({str(shard)!r})\n"
                 "        shard.parent.mkdir(parents=True)\n        shard.symlink_to('/dev/full')\n"
                 "RunLoop.own_history = full_at_step_2\n"
                 "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    full = _run([cmd[0], "-c", full_disk] + cmd[1:], timeout=180)
    assert full.returncode == 1, full.log
    assert (f"job failed: actor.save_checkpoint failed on rank 0: WriteFailedError: could not write the checkpoint "
            f"{run_dir}/global_step_2/actor: no space left on device") in full.stderr, full.log
    assert "Traceback" not in full.stderr, full.log
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    shard.unlink()
    rerun = _run(cmd, timeout=180)
    assert rerun.returncode == 0, rerun.log
    assert f"resumed from {run_dir}/global_step_1" in rerun.stdout, rerun.log
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
