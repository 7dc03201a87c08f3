"""The RL driver end to end on a tiny model (CPU, gloo): 3-step ``grpo`` and ``ppo`` runs on
1 and 2 processes with verl's metric names; a run stopped after step 2 of 4 and resumed
equals the uninterrupted run (parameters bitwise, metrics exactly, metrics.jsonl cut back
to the resumed step, each checkpoint written after its step's row); batch sizes that do
not fit the ranks fail at start-up."""

import json
import math
from pathlib import Path

import pytest
import torch

from minihf.config import ConfigError, load_config
from minihf.testing import spawn_ranks

STEPS = 3


def job_config(model, data, out, recipe, **extra):
    from minihf.trainer.ppo_job import PPOJobConfig

    overrides = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", "data.max_prompt_length=16",
        "data.max_response_length=8", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_epochs=2", "critic.ppo_epochs=2",
        f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2",
        f"trainer.default_local_dir={out}", "prepare.task=null", "prepare.sft_recipe=null",
        "controller.timeout_s=120",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(PPOJobConfig, recipe, overrides)


def final_params(out, step):
    from minihf.hub import export_hf
    from minihf.models import load_hf

    export_hf(f"{out}/global_step_{step}/actor", f"{out}/export")
    return load_hf(f"{out}/export").state_dict()


def _runs(rank, world, model, data, tmp, cases):
    import minihf.trainer.loop as loop
    from minihf.controller import run
    from minihf.trainer.ppo_job import ppo_driver, ppo_roles

    mark_latest = loop.mark_latest

    def mark_after_the_row(out_dir, step):  # a job killed once the pointer moves keeps the row
        rows = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
        assert json.loads(rows[-1])["step"] == step, f"checkpoint {step} before its metrics row"
        mark_latest(out_dir, step)

    loop.mark_latest = mark_after_the_row
    out = {}
    for name, recipe, stop, subdir, extra in cases:
        cfg = job_config(model, data, f"{tmp}/{subdir}", recipe, **extra)
        hist = run(ppo_driver(cfg, stop_after=stop), ppo_roles(cfg), cfg.controller)
        out[name] = hist
    return out


def check_metrics(hist, with_critic):
    steps = [h for h in hist if h["step"] > 0]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    assert "val-core/minihf/digits/reward/mean@1" in hist[0]  # val_before_train
    keys = set(steps[-1])
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/grad_norm", "actor/lr", "critic/score/mean", "critic/rewards/mean",
              "critic/advantages/mean", "critic/returns/mean", "response_length/mean",
              "response_length/clip_ratio", "prompt_length/mean", "timing_s/gen",
              "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor",
              "timing_s/reshard", "timing_s/step", "perf/throughput", "val-core/mean"):
        assert k in keys, k
    for k in ("critic/vf_loss", "critic/values/mean", "timing_s/values", "timing_s/update_critic"):
        assert (k in keys) == with_critic, k
    assert not any(k.endswith(("/trained_rows", "/schedule_skipped_steps")) for k in keys)  # rows as planned
    assert all(math.isfinite(v) for h in steps for v in h.values() if isinstance(v, float))


def test_grpo_and_ppo_one_process(tiny_job, tmp_path):
    model, data = tiny_job
    cosine = {"actor_rollout_ref.actor.optim.lr_scheduler": "cosine",
              "actor_rollout_ref.actor.optim.min_lr_ratio": 0.1}
    cases = [("grpo", "grpo", None, "grpo", cosine), ("ppo", "ppo", None, "ppo", {}),
             ("again", "grpo", None, "grpo", cosine)]  # the finished grpo run, rerun
    res = spawn_ranks(_runs, 1, model, data, str(tmp_path), cases, timeout_s=300)[0]
    assert res["again"] == []  # nothing left to train: no step, no validation
    check_metrics(res["grpo"], with_critic=False)
    # cosine over the run's 3 steps x 2 mini-batches x 2 epochs = 12 optimizer steps:
    # actor/lr is the mean over a step's 4 optimizer steps, decreasing
    lrs = [h["actor/lr"] for h in res["grpo"] if "actor/lr" in h]
    # not tolerances: the bounds are the peak lr (1e-3) and the floor 0.1 x 1e-3 of the schedule
    assert lrs[0] < 1e-3 and lrs[0] > lrs[1] > lrs[2] > 1e-4, lrs
    check_metrics(res["ppo"], with_critic=True)
    assert "actor/kl_loss" in res["grpo"][-1] and "actor/reward_kl_penalty" in res["ppo"][-1]
    # samples.jsonl: validations (steps 0, 2, 3) and the last step (log_samples_freq=10)
    logged = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [h["step"] for h in res["grpo"]]  # the rerun added none
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["step"], r["kind"]) for r in rows}) == [(0, "val"), (2, "val"), (3, "train"),
                                                             (3, "val")]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(r["prompt"] and isinstance(r["score"], float) for r in train)
    assert 0 <= res["grpo"][-1]["critic/score/frac_equal_groups"] <= 1
    # the run dir holds the resolved config, which loads back as the same config
    from minihf.trainer.ppo_job import PPOJobConfig
    saved = load_config(PPOJobConfig, str(tmp_path / "grpo" / "config.yaml"))
    assert saved.actor_rollout_ref.actor.optim.lr_scheduler == "cosine"
    assert saved.trainer.default_local_dir == str(tmp_path / "grpo")


def test_two_processes_and_resume_equals_uninterrupted(tiny_job, tmp_path):
    model, data = tiny_job
    extra = {"trainer.total_training_steps": 4, "trainer.save_freq": 2}
    one_mini = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8,  # 2 prompt groups a rank
                "data.max_response_length": 16}  # lengths that differ
    cases = [("grpo", "grpo", None, "grpo", one_mini), ("ppo", "ppo", None, "ppo", {}),
             ("unbalanced", "grpo", None, "unbalanced", {**one_mini, "trainer.balance_batch": False}),
             ("full", "ppo", None, "full", extra), ("first", "ppo", 2, "resumed", extra),
             # profiled (actor and critic share each process: one profile per rank)
             ("rest", "ppo", None, "resumed", {**extra, "trainer.profile_steps": "[3]"}),
             # stopped after step 1, before its first checkpoint (save_freq 3), then rerun
             ("early", "grpo", 1, "early", {**extra, "trainer.save_freq": 3}),
             ("again", "grpo", None, "early", {**extra, "trainer.save_freq": 3})]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=600)[0]
    check_metrics(res["grpo"], with_critic=False)
    check_metrics(res["ppo"], with_critic=True)
    # balancing moves rows between ranks, which changes the update by rounding only
    steps = [h for h in res["grpo"] if h["step"] > 0]
    assert all(h["global_seqlen/balanced_imbalance"] <= h["global_seqlen/imbalance"] for h in steps)
    assert any(h["global_seqlen/balanced_imbalance"] < h["global_seqlen/imbalance"] for h in steps)
    assert all("global_seqlen/imbalance" not in h for h in res["unbalanced"])
    for h, u in zip(steps, [h for h in res["unbalanced"] if h["step"] > 0]):
        for k in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert h[k] == pytest.approx(u[k], rel=1e-4, abs=1e-6), (h["step"], k)

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    full = [strip(h) for h in res["full"]]
    resumed = [strip(h) for h in res["first"] + res["rest"]]
    assert [h["step"] for h in resumed] == [0, 1, 2, 3, 4]
    assert full == resumed                                   # the profiled step 3 too
    profile = tmp_path / "resumed" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["step_3"]
    assert sorted(p.name for p in (profile / "step_3").iterdir()) == [
        "rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]
    for rank in (0, 1):
        trace = json.loads((profile / "step_3" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, rank   # the update ran in it
        table = (profile / "step_3" / f"rank{rank}.txt").read_text()
        assert "Self CPU" in table and "aten::mm" in table, table
    a, b = final_params(tmp_path / "full", 4), final_params(tmp_path / "resumed", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # a rerun after an attempt that saved nothing starts fresh: each step's rows once
    rows = [json.loads(x) for x in (tmp_path / "early" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    samples = [json.loads(x) for x in (tmp_path / "early" / "samples.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["kind"], r["prompt"], r["response"]) for r in samples]
    assert any(k[0] == 0 for k in keys) and len(keys) == len(set(keys))   # no sample row twice


def check_on(cfg, ranks: int) -> None:
    """``check_sizes`` as the trainer calls it: every trained role of the role table on
    ``ranks`` ranks."""
    from minihf.trainer.plugins import plugin_classes
    from minihf.roles import role_table

    cfg.check_sizes({r.trains: ranks for r in role_table(cfg, plugin_classes(cfg)) if r.trains})


def test_batch_sizes_that_do_not_fit_fail_early(tiny_job, tmp_path):
    model, data = tiny_job
    cfg = job_config(model, data, tmp_path, "grpo",
                     **{"actor_rollout_ref.actor.ppo_mini_batch_size": 3})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.ppo_mini_batch_size=3 must "
                                          r"divide the 8 sequences of a step .* values that work: "
                                          r"\[2, 4, 8\]"):
        check_on(cfg, 2)
    # 8 sequences over 3 ranks: no mini-batch size works, so say what to change instead
    cfg = job_config(model, data, tmp_path, "grpo", **{"actor_rollout_ref.actor.ppo_mini_batch_size": 8})
    with pytest.raises(ConfigError, match=r"no value works, as 8 sequences do not split evenly over 3 "
                                          r"ranks: run on a process count that divides 8 \(1, 2, 4, 8\), or "
                                          r"make data.train_batch_size x rollout.n a multiple of 3 "
                                          r"\(e.g. data.train_batch_size=6\)"):
        check_on(cfg, 3)
    # every trained role of the table is checked, a plug-in's too (the cost critic's was not)
    for key in ("critic.ppo_mini_batch_size", "cost_critic.ppo_mini_batch_size"):
        sizes = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8, "critic.ppo_mini_batch_size": 8,
                 "cost_critic.ppo_mini_batch_size": 8, key: 3}
        cfg = job_config(model, data, tmp_path, "ppo", **{"algorithm.safe.enable": "true", **sizes})
        with pytest.raises(ConfigError, match=rf"{key}=3 must divide the 8 sequences"):
            check_on(cfg, 2)


FORKED = {
    "config.yaml": """\
algorithm:
  adv_estimator: algo.py:scaled_grpo
actor_rollout_ref:
  actor:
    policy_loss:
      loss_mode: algo.py:marked_vanilla
custom_reward_function:
  path: reward.py
  name: long_answer
""",
    "algo.py": """\
import os
from pathlib import Path

from minihf.algorithms import compute_grpo_outcome_advantage, compute_policy_loss

def _mark(kind):
    Path(__file__).with_name(f"{kind}.{os.getpid()}").touch()

def scaled_grpo(token_level_rewards, response_mask, index):
    _mark("adv")
    adv, ret = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)
    return 0.5 * adv, 0.5 * ret

def marked_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, normalizer, config):
    _mark("loss")
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                               config.clip_ratio, loss_agg_mode=loss_agg_mode, normalizer=normalizer)
""",
    "reward.py": """\
def long_answer(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(len(solution_str) >= 3), "chars": len(solution_str)}
""",
}


def test_forked_recipe_code_runs_on_every_rank(tiny_job, tmp_path):
    """A recipe folder names its estimator, loss and reward as files next to its config:
    paths resolve from the folder, the loss file is imported by every actor rank (the
    driver never pickles functions), the estimator and reward on the driver only."""
    model, data = tiny_job
    recipe = tmp_path / "my_recipe"
    recipe.mkdir()
    for name, text in FORKED.items():
        (recipe / name).write_text(text)
    cases = [("forked", str(recipe), None, "out", {"trainer.total_training_steps": 1,
                                                   "trainer.test_freq": -1})]
    hist = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=300)[0]["forked"]
    marks = sorted(p.name.split(".")[0] for p in recipe.iterdir() if p.name[:3] in ("adv", "los"))
    assert marks == ["adv", "loss", "loss"], marks  # one driver; two actor ranks
    assert "reward_extra/chars/mean" in hist[-1] and math.isfinite(hist[-1]["actor/pg_loss"])
    cfg = job_config(model, data, tmp_path, str(recipe))
    assert cfg.custom_reward_function.path == str(recipe / "reward.py")
    assert cfg.algorithm.adv_estimator == f"{recipe}/algo.py:scaled_grpo"
    with pytest.raises(ValueError, match=r"algo.py has no advantage estimator 'nope'.*scaled_grpo"):
        job_config(model, data, tmp_path, str(recipe), **{"algorithm.adv_estimator":
                                                          f"{recipe}/algo.py:nope"})


def test_old_log_prob_source(tiny_job, tmp_path):
    model, data = tiny_job
    rows = {"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2}  # 8 rows a step
    one = {**rows, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
           "actor_rollout_ref.actor.ppo_epochs": 1}

    def source(recipe="grpo", **kw):
        return job_config(model, data, tmp_path, recipe, **kw).old_log_prob_source
    assert source(**one) == "update"                                   # auto, on-policy
    assert source() == "recompute"                                     # auto, 2 epochs x 2
    assert source(**one, **{"actor_rollout_ref.actor.recompute_log_prob": True}) == "recompute"
    assert source(**{"actor_rollout_ref.actor.recompute_log_prob": False}) == "rollout"
    assert source(**{**one, "actor_rollout_ref.actor.recompute_log_prob": False}) == "update"
    assert source("ppo", **one) == "recompute"                         # in-reward KL needs them


def test_on_policy_step_skips_the_old_log_prob_pass(tiny_job, tmp_path):
    model, data = tiny_job
    one = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_epochs": 1,
           "trainer.total_training_steps": 2, "trainer.test_freq": -1}
    cases = [("auto", "grpo", None, "auto", one),
             ("rollout", "grpo", None, "rollout",
              {"trainer.total_training_steps": 2, "trainer.test_freq": -1,
               "actor_rollout_ref.actor.recompute_log_prob": False})]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=300)[0]
    for name in ("auto", "rollout"):
        steps = [h for h in res[name] if h["step"] > 0]
        assert len(steps) == 2 and all("timing_s/old_log_prob" not in h for h in steps), name
        assert all(math.isfinite(h["actor/pg_loss"]) and h["actor/entropy"] > 0 for h in steps)
    assert all(h["actor/ppo_kl"] == 0.0 for h in res["auto"] if h["step"] > 0)


def _fp32_then_cuda_precision(rank, world, model, data, tmp, steps):
    """A run in fp32, then one with FSDP's CUDA default (bf16 parameters, fp32 reduction)
    and a bf16 engine, on CPU."""
    import minihf.parallel.fsdp as fsdp

    fp32 = _runs(rank, world, model, data, tmp, [("fp32", "grpo", None, "fp32", steps)])
    fsdp.default_mixed_precision = lambda device_type: (torch.bfloat16, torch.float32)
    bf16 = {**steps, "actor_rollout_ref.rollout.dtype": "bfloat16"}
    return fp32 | _runs(rank, world, model, data, tmp, [("bf16", "grpo", None, "bf16", bf16)])


def test_rollout_probs_diff_fp32_and_the_cuda_precision_path(tiny_job, tmp_path):
    """fp32: the engine's token probabilities equal the trainer's (~1e-8); the GPU precision
    settings (bf16 FSDP compute with fp32 reduction, a bf16 engine fed by the resharder), run
    here on CPU: a step that trains, probabilities within bf16 rounding of each other."""
    model, data = tiny_job
    steps = {"trainer.total_training_steps": 2, "trainer.test_freq": -1}  # 2 epochs: recomputed
    res = spawn_ranks(_fp32_then_cuda_precision, 2, model, data, str(tmp_path), steps, timeout_s=300)[0]
    fp32, bf16 = res["fp32"], res["bf16"]
    for name, hist, lo, hi in (("fp32", fp32, 0.0, 1e-6), ("bf16", bf16, 1e-6, 0.05)):
        steps_ = [h for h in hist if h["step"] > 0]
        assert len(steps_) == 2, name
        for h in steps_:
            assert lo < h["training/rollout_probs_diff_max"] < hi, (name, h)
            assert h["training/rollout_probs_diff_mean"] <= h["training/rollout_probs_diff_max"]
            assert all(math.isfinite(v) for v in h.values() if isinstance(v, float)), (name, h)
            assert h["actor/grad_norm"] > 0, (name, h)
    # the same data and weights: bf16 compute moves the gradient (measured 5e-4), not its size
    g32, g16 = fp32[1]["actor/grad_norm"], bf16[1]["actor/grad_norm"]
    assert g16 != g32 and g16 == pytest.approx(g32, rel=0.1)


def test_run_dir_defaults_to_project_and_experiment():
    from minihf.trainer.ppo_config import PPOConfig
    from minihf.trainer.sft import SFTConfig

    from minihf.trainer.common import run_dir

    cfg = load_config(PPOConfig, None, ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert run_dir(cfg.trainer) == Path("outputs/p/e")
    assert run_dir(load_config(SFTConfig).trainer) == Path("outputs/minihf/sft")
    assert run_dir(load_config(PPOConfig, None, ["trainer.default_local_dir=x"]).trainer) == Path("x")


class ScriptedActor:
    """A stand-in actor group for the driver alone: fixed responses, old log-probs -1.0 and
    reference log-probs -1.5 on every token; it keeps the batch the update receives."""
    dp_size, ranks, R = 1, (0,), 4

    def generate_sequences(self, batch):
        from minihf.protocol import Batch

        ids, mask = batch["input_ids"], batch["attention_mask"]
        b = len(ids)
        responses = torch.arange(3, 3 + self.R).repeat(b, 1)                 # [B, R]
        full_mask = torch.cat([mask, torch.ones(b, self.R, dtype=mask.dtype)], 1)
        return Batch({"prompts": ids, "responses": responses,
                      "input_ids": torch.cat([ids, responses], 1), "attention_mask": full_mask,
                      "position_ids": (full_mask.cumsum(-1) - 1).clamp(min=0),
                      "response_mask": torch.ones(b, self.R, dtype=torch.long),
                      "rollout_log_probs": torch.full((b, self.R), -1.0)},
                     {"uid": batch.non_tensors["uid"]}, {"temperature": 1.0})

    def compute_log_prob(self, batch, calc_entropy=False, calc_bound=False):
        from minihf.protocol import Batch

        shape = batch["responses"].shape
        return Batch({"old_log_probs": torch.full(shape, -1.0), "entropys": torch.zeros(shape)})

    def compute_ref_log_prob(self, batch):
        from minihf.protocol import Batch

        return Batch({"ref_log_prob": torch.full(batch["responses"].shape, -1.5)})

    def update_actor(self, batch):
        self.updated = batch
        return {}


@pytest.mark.parametrize("estimator", ["kl", "low_var_kl"])
def test_in_reward_kl_by_hand(tiny_job, tmp_path, estimator):
    """The driver's in-reward KL takes the policy's (old) log-probs first: with old = -1.0
    and ref = -1.5 on every token, d = 0.5, so rewards = scores - beta * k(d) and
    ``actor/reward_kl_penalty`` = k(d) (k1: 0.5, k3: e^-0.5 - 1 + 0.5); swapped, k1 gives
    -0.5 and k3 e^0.5 - 1 - 0.5."""
    from minihf.trainer.ppo import PPOTrainer

    model, data = tiny_job
    cfg = job_config(model, data, tmp_path / "run", "grpo", **{
        "algorithm.use_kl_in_reward": "true", "algorithm.kl_penalty": estimator,
        "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": "0.2",
        "actor_rollout_ref.actor.use_kl_loss": "false"})
    actor = ScriptedActor()
    m = PPOTrainer(cfg, {"actor": actor}, log=lambda *a: None).train_step(1)
    kl = 0.5 if estimator == "kl" else math.exp(-0.5) - 1 + 0.5
    # k1's 0.5 is exact; k3 as in test_algorithms: worst case rel 5.6e-7 from fp32 e^-0.5, plus
    # ~2 ulp from the means of equal values: rel 2e-6 holds it; a swap moves it by 40%
    assert m["actor/reward_kl_penalty"] == pytest.approx(kl, rel=2e-6)
    assert m["actor/reward_kl_penalty_coeff"] == 0.2
    b = actor.updated
    want = b["token_level_scores"] - 0.2 * kl * b["response_mask"]
    assert torch.allclose(b["token_level_rewards"], want, atol=1e-7)  # fp32 of values ~1
