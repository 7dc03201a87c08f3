"""The algorithm zoo's recipes and DAPO's two mechanisms.

* every recipe under ``recipes/`` (RL ones) runs 2 steps on a tiny model (one process) with
  its estimator, loss and settings, finite metrics, and the metrics its algorithm adds
  (``timing_s/gen_max`` for ReMax, ``train/num_gen_batches`` and the overlong penalty for
  DAPO);
* overlong shaping against hand-computed values;
* dynamic sampling through the driver with a scripted actor: only groups whose samples
  score differently are kept, exactly ``train_batch_size`` of them, over several rounds;
  the round limit is an error naming the key.
"""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minihf.trainer.plugins.dapo import dynamic_rollout
from minihf.testing import spawn_ranks

RECIPES = Path(__file__).parent.parent / "src" / "minihf" / "recipes"
ZOO = ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gspo", "dapo", "distill", "gkd"]


def overrides(model, data, out, **extra):
    base = {"actor_rollout_ref.model.path": model, "data.train_files": f"{data}/train.parquet",
            "data.val_files": f"{data}/test.parquet", "data.max_prompt_length": 16,
            "data.max_response_length": 8, "data.train_batch_size": 4,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.ppo_epochs": 2,
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.optim.lr": 1e-3,
            "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.default_local_dir": out,
            "prepare.task": "null", "prepare.sft_recipe": "null", "controller.timeout_s": 120}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _run_recipes(rank, world, model, data, tmp, names):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    out = {}
    teacher = {"prepare.role_recipes": "{}", "roles.teacher.model.path": f"{model}-teacher"}
    for name in names:
        extra = {"dapo": {"reward_model.overlong_buffer.len": 3}, "distill": teacher, "gkd": teacher,
                 # the teacher is the student's own start model: the reverse KL starts at 0
                 "distill@same": {**teacher, "roles.teacher.model.path": model},
                 # the same, one optimizer step a step: the KL is measured before any update
                 "gkd@same": {**teacher, "roles.teacher.model.path": model,
                              "actor_rollout_ref.actor.ppo_epochs": 1}}.get(name, {})
        cfg = load_config(PPOJobConfig, name.split("@")[0], overrides(model, data, f"{tmp}/{name}", **extra))
        out[name] = run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("zoo")
    init_model(root / "model", size="tiny", task="sort")
    init_model(root / "model-teacher", size="tiny", task="sort", seed=1)  # recipes/distill's teacher
    make_task_data("sort", root / "data", 32, 4, seed=0)
    return str(root / "model"), str(root / "data")


def test_every_rl_recipe_is_tested():
    rl = sorted(p.parent.name for p in RECIPES.glob("*/config.yaml")
                if not p.parent.name.startswith(("sft", "rm_", "cm_")) and "smollm2" not in p.parent.name)
    # grpo, ppo: test_ppo.py; safe_rlhf, ppo_rm: test_safe.py; grpo_lora: test_lora_ppo.py;
    # grpo_guess_number, grpo_tool_arith: test_multi_turn_ppo.py; grpo_moe: test_moe_parallel.py;
    # prime: test_trained_role.py
    assert rl == sorted(ZOO + ["grpo", "ppo", "safe_rlhf", "ppo_rm", "grpo_lora", "grpo_guess_number",
                               "grpo_tool_arith", "grpo_moe", "prime"])


def test_zoo_recipes_run_two_steps(tiny, tmp_path):
    model, data = tiny
    res = spawn_ranks(_run_recipes, 1, model, data, str(tmp_path), ZOO + ["distill@same", "gkd@same"],
                      timeout_s=600)[0]
    same, gkd_same = res.pop("distill@same"), res.pop("gkd@same")
    for name, hist in res.items():
        steps = [h for h in hist if h["step"] > 0]
        assert [h["step"] for h in steps] == [1, 2], name
        assert "val-core/mean" in hist[0] and "val-core/mean" in steps[-1], name
        for h in steps:
            assert all(math.isfinite(v) for v in h.values() if isinstance(v, float)), (name, h)
            assert "actor/pg_loss" in h and "critic/advantages/mean" in h, name
        assert ("timing_s/gen_max" in steps[-1]) == (name == "remax"), name
        assert ("train/num_gen_batches" in steps[-1]) == (name == "dapo"), name
    dapo = [h for h in res["dapo"] if h["step"] > 0]
    assert all(h["train/num_gen_batches"] >= 1 and "reward/overlong_penalty/mean" in h for h in dapo)
    assert all(h["reward/overlong_penalty/mean"] <= 0 for h in dapo)
    assert "actor/kl_loss" not in dapo[-1] and "actor/kl_loss" in res["rloo"][-1]
    distill = [h for h in res["distill"] if h["step"] > 0]
    assert all("timing_s/teacher" in h and h["distill/reverse_kl"] != 0.0 for h in distill)
    assert distill[0]["actor/pg_loss"] != 0.0                    # the teacher's signal reaches the update
    # a teacher on the student's own start weights: the LogProbWorker and the actor's old
    # log-probs run the same forward on the same micro-batches, so the same floats: exactly 0
    assert [h["distill/reverse_kl"] for h in same if h["step"] > 0][0] == 0.0
    # gkd: the teacher's top k reach the actor's aux loss, which alone moves the student (the
    # advantages are zero, so the policy-gradient loss is exactly 0)
    gkd = [h for h in res["gkd"] if h["step"] > 0]
    assert all("timing_s/teacher" in h and h["actor/gkd/kl"] > 0 and h["actor/pg_loss"] == 0.0 for h in gkd)
    assert all(0 < h["actor/gkd/teacher_mass"] <= 1 + 1e-6 and h["actor/grad_norm"] > 0 for h in gkd)
    # on the student's own weights the KL is second order in the two forwards' rounding
    # difference (log-probs within ~1e-6 of each other here: KL <~ 1e-12); 1e-8 leaves room
    assert 0 <= [h["actor/gkd/kl"] for h in gkd_same if h["step"] > 0][0] < 1e-8


def test_overlong_penalty_by_hand():
    from minihf.trainer.reward import overlong_penalty

    # max 20, buffer 4: no penalty up to 16 tokens, then -0.25 per token down to -1 at 20
    got = overlong_penalty(torch.tensor([0, 10, 16, 17, 18, 20]), 20, 4, 1.0)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([19]), 20, 4, 2.0).tolist() == [-1.5]


def test_overlong_penalty_counts_a_multi_turn_responses_observation_tokens():
    """The cap (max_response_length) counts every response token, a multi-turn one's
    observations too (verl's length, from the attention mask); response_mask counts the
    model's tokens only, and gave no penalty to a response the cap had cut."""
    from minihf.protocol import Batch
    from minihf.trainer.plugins.dapo import OverlongPenalty

    R = 8
    attention = torch.cat([torch.ones(2, 3), torch.tensor([[1.0] * 8, [1.0] * 5 + [0.0] * 3])], 1)
    response_mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])  # 3..5: an observation
    batch = Batch({"responses": torch.zeros(2, R, dtype=torch.long), "attention_mask": attention.long(),
                   "response_mask": response_mask, "token_level_scores": torch.zeros(2, R)})
    cfg = SimpleNamespace(reward_model=SimpleNamespace(overlong_buffer=SimpleNamespace(len=4, penalty_factor=1.0)),
                          data=SimpleNamespace(max_response_length=R))
    m = {}
    OverlongPenalty.penalise(SimpleNamespace(cfg=cfg), batch, m, lambda *a: None)
    # lengths 8 (5 of them the model's) and 5: -1.0 and -0.25, each on its last model token
    assert batch["token_level_scores"][0].tolist() == [0.0] * 7 + [-1.0]
    assert batch["token_level_scores"][1].tolist() == [0.0] * 4 + [-0.25] + [0.0] * 3
    assert m["reward/overlong_penalty/mean"] == -0.625 and m["reward/overlong_frac"] == 1.0


class ScriptedActor:
    """generate_sequences without a model: response i of a prompt has i + 1 tokens."""
    dp_size, ranks = 1, [0]

    def generate_sequences(self, batch):
        from minihf.hybrid.rollout_output import build_output
        from minihf.protocol import Batch

        seqs = [SimpleNamespace(tokens=[7] * (int(i) + 1), logprobs=[-1.0] * (int(i) + 1))  # 7: a character
                for i in batch["sample_index"]]
        return Batch(build_output(batch, seqs, 8, 0).tensors)


REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info):
    # prompts with an even row index: every sample scores 0 (an equal group, no signal);
    # odd: the response length (4 samples of lengths 1..4 differ)
    return 0.0 if extra_info["index"] % 2 == 0 else float(len(solution_str))
'''


def trainer_for(tiny, tmp_path, **extra):
    from minihf.config import load_config
    from minihf.trainer.ppo import PPOTrainer
    from minihf.trainer.ppo_job import PPOJobConfig

    model, data = tiny
    (tmp_path / "r.py").write_text(REWARD)
    cfg = load_config(PPOJobConfig, "dapo", overrides(
        model, data, str(tmp_path / "run"), **{"actor_rollout_ref.rollout.n": 4,
                                               "custom_reward_function.path": f"{tmp_path}/r.py",
                                               "custom_reward_function.name": "score",
                                               "reward_model.overlong_buffer.enable": "false",
                                               "data.shuffle": "false", **extra}))
    return PPOTrainer(cfg, {"actor": ScriptedActor()}, log=lambda *_: None)


def at_step(trainer, step):
    """The trainer's step context, as ``train_step`` sets it for ``step``."""
    trainer.ctx.step, trainer.ctx.metrics = step, {}
    return trainer.ctx


def test_dynamic_sampling_keeps_groups_that_differ(tiny, tmp_path):
    trainer = trainer_for(tiny, tmp_path)
    m = {}
    batch, _ = dynamic_rollout(at_step(trainer, 1), m)
    index = np.asarray(batch.non_tensors["index"])
    assert len(batch) == 4 * 4 and (index % 2 == 1).all()          # 4 prompts x n=4, only odd rows
    scores = batch["token_level_scores"].sum(-1).view(4, 4)
    assert (scores == torch.tensor([1.0, 2.0, 3.0, 4.0])).all()      # whole groups, in order
    assert m["train/num_gen_batches"] == 2                           # 2 of 4 prompts kept per round
    assert m["critic/score/frac_equal_groups"] == 0.5
    assert len(set(batch.non_tensors["uid"])) == 4
    # rounds with different prompt widths are left-padded to one: each row is still its
    # prompt's ids followed by its response
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert ids == trainer.loader.dataset[int(index[i])]["input_ids"] + [7] * (i % 4 + 1)
    # gen_batch_size 8: one round finds the 4 odd prompts
    m = {}
    dynamic_rollout(at_step(trainer_for(tiny, tmp_path, **{"data.gen_batch_size": 8}), 1), m)
    assert m["train/num_gen_batches"] == 1


def test_dynamic_sampling_round_limit_is_an_error(tiny, tmp_path):
    trainer = trainer_for(tiny, tmp_path, **{"algorithm.filter_groups.max_num_gen_batches": 1})
    with pytest.raises(RuntimeError, match=r"after 1 generation rounds only 2 of data.train_batch_size=4 "
                                           r"prompts.*max_num_gen_batches"):
        dynamic_rollout(at_step(trainer, 1), {})


def test_dapo_config_errors(tiny):
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    model, data = tiny
    with pytest.raises(ConfigError, match="overlong_buffer.len=30 exceeds data.max_response_length=8"):
        load_config(PPOJobConfig, "dapo", overrides(model, data, "x", **{"reward_model.overlong_buffer.len": 30}))
    with pytest.raises(ConfigError, match="filter_groups needs groups"):
        load_config(PPOJobConfig, "dapo", overrides(model, data, "x", **{"actor_rollout_ref.rollout.n": 1,
                                                                          "actor_rollout_ref.actor.ppo_mini_batch_size": 4}))
    with pytest.raises(ConfigError, match="max_num_gen_batches=-1 must be >= 0"):
        load_config(PPOJobConfig, "dapo", overrides(model, data, "x", **{"algorithm.filter_groups.max_num_gen_batches": -1}))
