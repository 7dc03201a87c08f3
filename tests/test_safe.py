"""Safe-RLHF and learned score models in the RL loop.

* the Lagrange multiplier and the combined advantage against hand-computed values;
* the ``safe_sort`` task: its cost, cost pairs (chosen = costlier, sign labels), the
  ``make-data`` options;
* sign-labeled pairs: ``PairDataset`` columns and errors, the cost-model loss by hand;
* config errors naming the key;
* ``safe_rlhf`` and ``ppo_rm`` run 2 steps on a tiny model: cost metrics, lambda following
  its update rule from the logged costs, the cost critic trained apart from the reward
  critic, validation costs; a run stopped after step 1 and resumed equals the full run
  (lambda and the cost critic come back from the checkpoint).
"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from minihf.config import ConfigError, load_config
from minihf.testing import spawn_ranks


def flat(result) -> str:
    """CLI output with Rich's box drawing and line wraps removed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def test_lagrange_multiplier_and_combined_advantage_by_hand():
    from minihf.algorithms import LagrangeMultiplier, combine_safe_advantages

    lag = LagrangeMultiplier(init=1.0, lr=0.5, limit=0.2)
    # lambda is a Python float: approx's default rel=1e-6 only absorbs decimal rounding
    assert lag.update(1.0) == pytest.approx(1.4)             # 1 + 0.5 * (1.0 - 0.2)
    assert lag.update(-3.0) == 0.0                           # 1.4 + 0.5 * -3.2 < 0: projected to 0
    capped = LagrangeMultiplier(init=1.0, lr=1.0, limit=0.0, max_value=1.5)
    assert capped.update(2.0) == 1.5
    capped.load_state_dict(lag.state_dict())
    assert capped.value == 0.0
    a_r, a_c = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])
    # (A_r - 3 A_c) / 4
    assert combine_safe_advantages(a_r, a_c, 3.0).tolist() == [-0.125, -1.25]
    assert torch.equal(combine_safe_advantages(a_r, a_c, 0.0), a_r)
    with pytest.raises(ValueError, match="lambda_init=-1"):
        LagrangeMultiplier(init=-1, lr=0.1, limit=0)
    with pytest.raises(ValueError, match="lambda_max=0.5 is below lambda_init=1"):
        LagrangeMultiplier(init=1, lr=0.1, limit=0, max_value=0.5)


def test_safe_sort_cost_and_cost_pairs():
    from minihf.data.tasks import get_task
    from minihf.data.tasks.common import generate_rows, pair_rows

    task = get_task("safe_sort")
    assert task.compute_cost("1,2,9", "1,2,9") == 1.0 and task.compute_cost("1,2", "1,2,9") == 0.0
    # a float64 fraction: approx's default rel=1e-6 only absorbs its rounding
    assert task.compute_score("1,2", "1,2,9") == pytest.approx(2 / 3)   # sort's reward
    rows = generate_rows(task, 400, 0, seed=0)["train"]
    share = sum(task.compute_cost(r["extra_info"]["answer"], None) for r in rows) / len(rows)
    assert 0.55 < share < 0.75                                          # ~P_NINE of answers cost
    pairs = pair_rows(task, rows[:50], seed=0, by="cost")
    assert len(pairs) >= 45                       # answers with many 9s may find no cheap edit
    for p in pairs:
        assert task.compute_cost(p["chosen"], None) == 1.0 and task.compute_cost(p["rejected"], None) == 0.0
        assert (p["chosen_sign"], p["rejected_sign"]) == (1, -1)
        assert p["extra_info"]["chosen_cost"] == 1.0
    with pytest.raises(ValueError, match="task 'minihf/sort' has no cost function"):
        pair_rows(get_task("sort"), rows[:2], seed=0, by="cost")
    with pytest.raises(ValueError, match="pairs by 'size'"):
        pair_rows(task, rows[:2], seed=0, by="size")


def test_make_data_pairs_by_and_overwrite(tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app

    runner = CliRunner()
    out = tmp_path / "pairs"
    res = runner.invoke(app, ["make-data", "safe_sort", str(out), "--train", "8", "--test", "2",
                              "--pairs", "--pairs-by", "cost"])
    assert res.exit_code == 0, res.output
    row = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    assert row["chosen_sign"] == 1 and row["rejected_sign"] == -1
    res = runner.invoke(app, ["make-data", "safe_sort", str(out), "--train", "8", "--test", "2"])
    assert res.exit_code != 0 and "is not empty; pass --overwrite" in flat(res)
    res = runner.invoke(app, ["make-data", "safe_sort", str(out), "--train", "8", "--test", "2", "--overwrite"])
    assert res.exit_code == 0 and "chosen" not in (out / "train.jsonl").read_text()
    (tmp_path / "f").write_text("x")
    res = runner.invoke(app, ["make-data", "sort", str(tmp_path / "f")])
    assert res.exit_code != 0 and "is a file" in flat(res)


def test_sign_labeled_pairs_and_cost_model_loss(tmp_path):
    import torch.nn.functional as F

    from minihf.data import PairDataset, load_tokenizer
    from minihf.hub import init_model
    from minihf.data.files import DataFileError, write_rows
    from minihf.workers.rm_worker import pair_loss

    init_model(tmp_path / "m", size="tiny", task="sort")
    tok = load_tokenizer(tmp_path / "m", padding_side="right")
    base = {"prompt": "3,1", "chosen": "1,9", "rejected": "1,3"}
    write_rows([dict(base, chosen_sign=1, rejected_sign=-1), dict(base, chosen_sign=0, rejected_sign=1)],
               tmp_path / "signed.jsonl")
    batch = PairDataset(tmp_path / "signed.jsonl", tok, max_length=16).collate([0, 1])
    assert batch["chosen_sign"].tolist() == [1.0, 0.0] and batch["rejected_sign"].tolist() == [-1.0, 1.0]
    write_rows([base], tmp_path / "plain.jsonl")
    plain = PairDataset(tmp_path / "plain.jsonl", tok, max_length=16)
    assert not plain.has_signs and plain.collate([0])["chosen_sign"].tolist() == [0.0]
    write_rows([dict(base, chosen_sign=1)], tmp_path / "half.jsonl")
    with pytest.raises(DataFileError, match="'chosen_sign' without 'rejected_sign'"):
        PairDataset(tmp_path / "half.jsonl", tok, max_length=16)
    write_rows([dict(base, chosen_sign=2, rejected_sign=-1)], tmp_path / "bad.jsonl")
    with pytest.raises(DataFileError, match="column 'chosen_sign': expected -1, 0 or 1"):
        PairDataset(tmp_path / "bad.jsonl", tok, max_length=16)
    # the loss by hand: pair 0 BT + both sign terms, pair 1 BT + the rejected side's sign term
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([-0.5, 0.5])
    mb = {"weight": torch.ones(2), "chosen_sign": batch["chosen_sign"], "rejected_sign": batch["rejected_sign"]}
    got = pair_loss(chosen, rejected, mb)
    ls = F.logsigmoid
    want = -(ls(torch.tensor(2.5)) + ls(torch.tensor(2.0)) + ls(torch.tensor(0.5))
             + ls(torch.tensor(-1.5)) + ls(torch.tensor(0.5)))
    # 5 fp32 logsigmoids of |x| <= 2.5 summed in another order: ~1-2 ulp of 2.86, rel 1e-6 ~12 ulp
    assert got["loss"].item() == pytest.approx(want.item(), rel=1e-6)
    assert got["signed"].item() == 3 and got["sign_correct"].item() == 3 and got["correct"].item() == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("safe")
    init_model(root / "model", size="tiny", task="sort")
    init_model(root / "other", size="tiny", task="sort", seed=1)  # the cost model: not the reward model's twin
    make_task_data("safe_sort", root / "data", 32, 4, seed=0)
    return str(root / "model"), str(root / "data")


def overrides(model, data, out, **extra):
    base = {"actor_rollout_ref.model.path": model, "reward_model.model.path": model,
            "cost_model.model.path": model.replace("model", "other"), "data.train_files": f"{data}/train.parquet",
            "data.val_files": f"{data}/test.parquet", "data.max_prompt_length": 16,
            "data.max_response_length": 8, "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4,
            "cost_critic.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_epochs": 1,
            "critic.ppo_epochs": 1, "cost_critic.ppo_epochs": 1, "algorithm.safe.lambda_lr": 0.5,
            "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 1,
            "trainer.default_local_dir": out, "prepare.task": "null", "prepare.sft_recipe": "null",
            "prepare.reward_model_recipe": "null", "prepare.cost_model_recipe": "null",
            "controller.timeout_s": 120}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _runs(rank, world, model, data, tmp):
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    cases = [("full", "safe_rlhf", "full", None, {}), ("first", "safe_rlhf", "resumed", 1, {}),
             ("old_format", "safe_rlhf", "old_format", None, {}),
             ("rest", "safe_rlhf", "resumed", None, {}),
             ("rule", "safe_rlhf", "rule", None, {"cost_model.enable": "false"}),
             ("ppo_rm", "ppo_rm", "ppo_rm", None, {})]
    out = {}
    for name, recipe, run_name, stop, extra in cases:
        if name == "old_format":  # the step-1 checkpoint as minihf wrote it before plug-ins
            shutil.copytree(f"{tmp}/resumed", f"{tmp}/old_format")
            state_file = Path(tmp, "old_format", "global_step_1", "driver_state.json")
            state = json.loads(state_file.read_text())
            state.update(state.pop("plugins")["safe_rlhf"])
            state_file.write_text(json.dumps(state))
        cfg = load_config(PPOJobConfig, recipe, overrides(model, data, f"{tmp}/{run_name}", **extra))
        out[name] = run(ppo_driver(cfg, stop), ppo_roles(cfg), cfg.controller)
    return out


def test_safe_rlhf_and_ppo_rm_run_and_resume(tiny, tmp_path):
    model, data = tiny
    res = spawn_ranks(_runs, 1, model, data, str(tmp_path), timeout_s=600)[0]
    full = [h for h in res["full"] if h["step"] > 0]
    lam = 1.0                                                  # the recipe's lambda_init
    for h in full:
        assert all(math.isfinite(v) for v in h.values() if isinstance(v, float)), h
        # lambda is updated in float64 from the logged cost mean, as here: rounding only
        assert h["safe/lambda"] == pytest.approx(lam)
        assert h["safe/cost_violation"] == pytest.approx(h["safe/cost/mean"] - 0.0)
        assert h["cost_critic/vf_loss"] != h["critic/vf_loss"]
        lam = max(0.0, lam + 0.5 * h["safe/cost/mean"])       # the update rule, from the logged cost
    assert "val-core/cost" in full[-1] and "val-core/minihf/safe_sort/cost/mean@1" in full[-1]
    assert 0.0 <= full[-1]["val-core/cost"] <= 1.0            # the rule cost: a share of responses

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    assert [strip(h) for h in res["full"]] == [strip(h) for h in res["first"] + res["rest"]]
    assert [strip(h) for h in res["old_format"]] == [strip(h) for h in res["rest"]]
    state = json.loads((tmp_path / "resumed" / "global_step_1" / "driver_state.json").read_text())
    # the same float64 update as the driver's: rounding only
    assert state["plugins"]["safe_rlhf"]["lagrange"]["value"] == pytest.approx(res["first"][-1]["safe/lambda"]
                                                       + 0.5 * res["first"][-1]["safe/cost/mean"])
    assert (tmp_path / "resumed" / "global_step_2" / "cost_critic").is_dir()
    rule = [h for h in res["rule"] if h["step"] > 0]
    assert all(0.0 <= h["safe/cost/mean"] <= 1.0 for h in rule)  # rule costs are 0 or 1
    ppo_rm = [h for h in res["ppo_rm"] if h["step"] > 0]
    assert [h["step"] for h in ppo_rm] == [1, 2] and "safe/lambda" not in ppo_rm[-1]
    assert all(math.isfinite(h["critic/score/mean"]) for h in ppo_rm)


def test_safe_config_errors(tiny):
    from minihf.trainer.ppo_job import PPOJobConfig

    model, data = tiny
    cases = [({"algorithm.adv_estimator": "grpo"}, "algorithm.safe combines the reward's and the cost's GAE "
                                                   "advantages .* set adv_estimator=gae, not 'grpo'"),
             ({"cost_critic.enable": "false"}, "algorithm.safe needs the cost critic"),
             ({"algorithm.safe.enable": "false"}, "cost_model.enable=true needs algorithm.safe.enable=true"),
             ({"algorithm.safe.lambda_lr": -1}, "lambda_lr=-1.0 must be >= 0"),
             ({"algorithm.safe.lambda_update_delay_steps": -2}, "lambda_update_delay_steps=-2 must be >= 0")]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(PPOJobConfig, "safe_rlhf", overrides(model, data, "x", **extra))


def test_recipes_train_their_score_models_first(tmp_path, monkeypatch):
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths
    from minihf.trainer.prepare import score_model_jobs

    monkeypatch.chdir(tmp_path)                               # no outputs/: every model is due
    jobs = score_model_jobs(load_config(PPOJobConfig, "safe_rlhf"))
    assert [(rm.trainer.default_local_dir, by) for rm, by in jobs] == [
        ("outputs/rm_safe_sort", "reward"), ("outputs/cm_safe_sort", "cost")]
    assert [by for _, by in score_model_jobs(load_config(PPOJobConfig, "ppo_rm"))] == ["reward"]
    cfg = load_config(PPOJobConfig, "ppo_rm", ["reward_model.model.path=elsewhere"])
    with pytest.raises(ConfigError, match=r"prepare.reward_model_recipe='rm_sort' exports to outputs/rm_sort/hf, "
                                          r"but reward_model.model.path='elsewhere'"):
        score_model_jobs(cfg)
    cfg.prepare.reward_model_recipe = None
    cfg.actor_rollout_ref.model.path = str(tmp_path / "m")
    from minihf.hub import init_model
    init_model(tmp_path / "m", size="tiny", task="sort")
    with pytest.raises(ConfigError, match="reward_model.model.path='elsewhere' has no config.json"):
        check_paths(cfg)


def test_sampled_pairs_rank_a_models_own_answers(tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app
    from minihf.hub import init_model
    from minihf.data.tasks import get_task
    from minihf.data.files import read_many

    init_model(tmp_path / "m", size="tiny", task="sort")
    task, runner = get_task("safe_sort"), CliRunner()
    for by, rule in (("reward", task.compute_score), ("cost", task.compute_cost)):
        out = tmp_path / by
        res = runner.invoke(app, ["make-data", "safe_sort", str(out), "--train", "16", "--test", "0", "--pairs",
                                  "--pairs-by", by, "--sample-model", str(tmp_path / "m"), "--samples", "8"])
        assert res.exit_code == 0, res.output
        rows = [row for _, _, row in read_many(out / "train.parquet")]
        sampled = [r for r in rows if (r["extra_info"] or {}).get("sampled")]
        assert 0 < len(sampled) <= 16 and f"{len(sampled)} pairs sampled" in res.output
        assert len(rows) - len(sampled) >= 14                    # the task's own pairs come first
        for r in sampled:
            truth = r["reward_model"]["ground_truth"]
            assert rule(r["chosen"], truth) > rule(r["rejected"], truth)
            if by == "cost":
                assert (r["chosen_sign"], r["rejected_sign"]) == (1, -1)
    res = runner.invoke(app, ["make-data", "sort", str(tmp_path / "x"), "--sample-model", str(tmp_path / "m")])
    assert res.exit_code != 0 and "pass --pairs too" in flat(res)
    res = runner.invoke(app, ["make-data", "sort", str(tmp_path / "y"), "--pairs", "--sample-model", str(tmp_path)])
    assert res.exit_code != 0 and "has no config.json" in flat(res)


def test_sampled_pairs_draw_each_prompt_with_its_own_seed(tmp_path, monkeypatch):
    """One SamplingParams(seed) for every prompt made sample j of each prompt draw with the
    same noise (duplicate prompts got the same samples); each prompt gets its own, as eval's."""
    import minihf.trainer.evaluate as evaluate
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.trainer.pairs import sampled_pairs

    init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 3, 0, seed=0)
    seen = []
    real = evaluate.generate_batch
    monkeypatch.setattr(evaluate, "generate_batch", lambda llm, ds, params, pad: seen.append(params) or
                        real(llm, ds, params, pad))
    sampled_pairs(tmp_path / "m", tmp_path / "d" / "train.parquet", n=2, max_tokens=4, seed=5)
    seeds = [p.seed for p in seen[0]]
    assert len(seeds) == 3 and len(set(seeds)) == 3


def safe_plugin(*overrides):
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.phases import StepContext
    from minihf.trainer.plugins import SafeRLHF

    cfg = load_config(PPOJobConfig, "safe_rlhf", list(overrides))
    return SafeRLHF(StepContext(cfg, {}, None, None, None, print, None, None, None, None))


def test_safe_advantages_by_hand_with_delay_and_cap():
    from minihf.algorithms import compute_gae_advantage_return, masked_whiten
    from minihf.protocol import Batch

    safe = safe_plugin("algorithm.safe.lambda_update_delay_steps=1", "algorithm.safe.lambda_max=1.2",
                       "algorithm.safe.lambda_lr=0.5")
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    costs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])              # both episodes cost 1
    scores = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.2]])
    kl = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.1, 0.1]])
    values = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.2]])
    lams = []
    for step in (1, 2, 3):
        batch = Batch({"token_level_costs": costs, "token_level_scores": scores,
                       "token_level_rewards": scores - 0.2 * kl, "cost_values": torch.zeros(2, 3),
                       "values": values, "response_mask": mask, "advantages": torch.ones(2, 3) * mask})
        m = safe.advantages(batch, step)
        lams.append(m["safe/lambda"])
        a_r, _ = compute_gae_advantage_return(scores - 0.2 * kl, values, mask, 1.0, 0.95, whiten=False)
        a_c, _ = compute_gae_advantage_return(costs + 0.2 * kl, torch.zeros(2, 3), mask, 1.0, 0.95,
                                              whiten=False)  # + beta*kl
        # GAE on inputs equal up to rounding (scores - rewards vs 0.2 kl), then one whitening of
        # values > 0.1 in size: allclose's rtol 1e-5 (~80 ulp) holds them
        assert torch.allclose(batch["cost_advantages"], a_c)
        want = masked_whiten((a_r - lams[-1] * a_c) / (1 + lams[-1]), mask.float()) * mask
        assert torch.allclose(batch["advantages"], want)
        assert m["safe/cost/mean"] == 1.0 and m["safe/cost_violation"] == 1.0
    # step 1 is within the delay; step 2 moves lambda 1.0 -> 1.5, capped at 1.2
    assert lams == [1.0, 1.0, 1.2]


def test_the_kl_weight_does_not_move_with_lambda():
    """What the docs promise: with the in-reward KL alone (no score, no cost, zero values)
    the combined advantage is the KL's, whatever lambda is. Each GAE whitened on its own
    made the KL's share grow with lambda (by 1/std_r + lambda/std_c over 1 + lambda)."""
    from minihf.protocol import Batch

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    kl = torch.tensor([[0.1, 0.4, 0.0, 0.0], [0.3, 0.1, 0.2, 0.5], [0.7, 0.0, 0.0, 0.0]])
    got = []
    for lam in (0.0, 1.0, 10.0):
        safe = safe_plugin(f"algorithm.safe.lambda_init={lam}")
        batch = Batch({"token_level_costs": torch.zeros(3, 4), "token_level_scores": torch.zeros(3, 4),
                       "token_level_rewards": -0.05 * kl, "cost_values": torch.zeros(3, 4),
                       "values": torch.zeros(3, 4), "response_mask": mask, "advantages": torch.zeros(3, 4)})
        safe.advantages(batch, 1)
        got.append(batch["advantages"])
    # (-b k - lam b k) / (1 + lam) = -b k in exact arithmetic; fp32 rounds it a few times (a
    # few ulp, relative, and whitening keeps errors relative): allclose's rtol 1e-5 (~80 ulp)
    assert torch.allclose(got[0], got[1], atol=1e-6) and torch.allclose(got[0], got[2], atol=1e-6)
    assert got[0].abs().max() > 0.5
