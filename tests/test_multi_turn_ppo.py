"""Multi-turn RL end to end on a tiny model (CPU, gloo): GRPO and PPO (GAE over the
observation gaps) with an environment, on 1 and 2 processes; the trajectories' masks,
rewards and metrics, samples.jsonl's conversations."""

import json
from pathlib import Path

import pytest
import torch

from minihf.testing import spawn_ranks
from test_ppo import job_config


class EchoDigits:
    """Answers each turn with the digits of its turn number and rewards a turn that holds
    the prompt's first digit; done after 3 turns."""

    def __init__(self, row):
        self.want = row["prompt"][-1]["content"][0]
        self.n = 0

    def reset(self):
        return None

    def step(self, action):
        self.n += 1
        return str(self.n) * 2, float(self.want in action), self.n >= 3


def _run(rank, world, model, data, tmp, recipe, tp=1, name=None, extra=None):
    from minihf.controller import run
    from minihf.trainer.ppo_job import ppo_driver, ppo_roles

    cfg = job_config(model, data, f"{tmp}/{name or recipe}", recipe, **(extra or {}), **{
        "actor_rollout_ref.rollout.tensor_model_parallel_size": tp,
        "actor_rollout_ref.rollout.multi_turn.enable": "true",
        "actor_rollout_ref.rollout.multi_turn.environment": f"{__file__}:EchoDigits",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        "data.max_response_length": 32, "trainer.log_samples_freq": 1,
        "actor_rollout_ref.rollout.check_log_probs": "error",  # engine == trainer on assistant tokens
        "algorithm.use_kl_in_reward": "false"})
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


@pytest.mark.parametrize("recipe,world", [("grpo", 1), ("ppo", 2)])
def test_multi_turn_job(tiny_job, tmp_path, recipe, world):
    model, data = tiny_job
    hist = spawn_ranks(_run, world, model, data, str(tmp_path), recipe, timeout_s=400)[0]
    last = hist[-1]
    for k in ("multi_turn/num_turns/mean", "multi_turn/num_turns/max", "multi_turn/tool_calls/mean",
              "multi_turn/tool_errors/mean", "response_length/assistant/mean",
              "response_length/observation/mean", "timing_s/env", "timing_s/gen_extend"):
        assert k in last, k
    assert max(h.get("multi_turn/num_turns/max", 0) for h in hist) >= 2
    assert any(k.startswith("multi_turn/finish_reason/") for k in last)
    rows = [json.loads(x) for x in (tmp_path / recipe / "samples.jsonl").read_text().splitlines()]
    multi = [r for r in rows if len(r["spans"]) > 1]
    assert multi, "some trajectory should have an observation"
    for r in multi:
        observed = [s["text"] for s in r["spans"] if not s["trained"]]
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        assert len(observed) == len(users)
        for text, user in zip(observed, users):
            assert f"<|user|>{user}<eos><|assistant|>" in text


def test_multi_turn_on_a_standalone_rollout(tiny_job, tmp_path):
    """The environments run on a standalone rollout's rank (controller.placement.rollout),
    and its engine's log-probs of the assistant tokens equal the trainer's within rounding
    (check_log_probs=error, every step: the weights it received are the actor's)."""
    model, data = tiny_job
    placement = {"controller.placement": "{actor: {ranks: [0, 1]}, rollout: {ranks: [2]}}",
                 "trainer.total_training_steps": 2}
    hist = spawn_ranks(_run, 3, model, data, str(tmp_path), "grpo", 1, "standalone", placement,
                       timeout_s=400)[0]
    steps = [h for h in hist if h["step"] > 0]
    assert all(h["training/rollout_log_prob_bound_ratio"] <= 1 for h in steps)
    assert max(h.get("multi_turn/num_turns/max", 0) for h in hist) >= 2
    assert all(h["perf/weight_sync_bytes"] > 0 for h in steps[1:])


def test_gae_across_observation_gaps_equals_assistant_only_gae():
    """GAE over a trajectory with observation gaps (response_mask 0) equals GAE over the
    sequence of its assistant tokens alone, and the returns match there too."""
    from minihf.algorithms import compute_gae_advantage_return
    from minihf.algorithms.loss_agg import last_index

    g = torch.Generator().manual_seed(0)
    B, R = 4, 20
    mask = torch.ones(B, R)
    mask[0, 5:9] = 0
    mask[1, 2:3] = 0
    mask[1, 10:15] = 0
    mask[2, 15:] = 0           # padding only
    mask[3, 0:4] = 0           # (not produced by the engine; GAE must still skip it)
    values = torch.randn(B, R, generator=g)
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), last_index(mask)] = torch.randn(B, generator=g)
    rewards[0, 4] = 0.5        # a turn reward at a turn's last assistant token
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # the same, compacted: assistant tokens only, left-aligned, padded with mask 0
    dense = torch.zeros(B, R)
    dv, dr = torch.zeros(B, R), torch.zeros(B, R)
    for b in range(B):
        idx = mask[b].nonzero().squeeze(1)
        dense[b, :len(idx)], dv[b, :len(idx)], dr[b, :len(idx)] = 1, values[b, idx], rewards[b, idx]
    adv2, ret2 = compute_gae_advantage_return(dr, dv, dense, gamma=0.9, lam=0.8)
    # before whitening the two recursions do the same float operations at assistant tokens
    # (a gap passes its carry through as 1 * x + 0 * y, exact); whitening sums the same
    # <= 20 values of magnitude ~1 in another order: each sum within n u sum|x| (Higham),
    # ~20 * 6e-8 * 20 = 2.4e-5 in the worst case, ~1e-6 typically; hence 1e-4 on any host
    for b in range(B):
        idx = mask[b].nonzero().squeeze(1)
        torch.testing.assert_close(adv[b, idx], adv2[b, :len(idx)], rtol=0, atol=1e-4)
        torch.testing.assert_close(ret[b, idx], ret2[b, :len(idx)], rtol=0, atol=0)  # before whitening: exact


def test_tp2_gives_tp1_trajectories(tiny_job, tmp_path):
    """Before the first update (the same weights: greedy validation at step 0 and step 1's
    seeded samples), rollout TP=2, where one rank of the replica runs the environments and
    broadcasts the observations, gives the TP=1 trajectories. TP changes the logits'
    rounding only; a flip would need a near-tie (greedy) or a uniform draw within rounding
    of a CDF boundary (sampled), which these few hundred tokens do not meet."""
    model, data = tiny_job
    runs = {}
    for tp in (1, 2):
        spawn_ranks(_run, 2, model, data, str(tmp_path), "grpo", tp, f"tp{tp}", timeout_s=400)
        rows = [json.loads(x) for x in (tmp_path / f"tp{tp}" / "samples.jsonl").read_text().splitlines()]
        runs[tp] = [(r["prompt"], r["spans"], r["messages"]) for r in rows
                    if r["step"] == 0 or (r["step"] == 1 and r["kind"] == "train")]
    assert runs[1] and runs[1] == runs[2]
    assert any(len(spans) > 1 for _, spans, _ in runs[1])


def _recipe(rank, world, tmp, recipe, overrides):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    cfg = load_config(PPOJobConfig, recipe, overrides)
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def short_recipe(tmp_path, recipe, task):
    """``recipe`` as configured on a random tiny model of ``task``, 2 steps; its metrics."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    init_model(tmp_path / "model", size="tiny", task=task)
    make_task_data(task, tmp_path / "data", 32, 8, seed=0)
    overrides = [f"actor_rollout_ref.model.path={tmp_path}/model",
                 f"data.train_files={tmp_path}/data/train.parquet", f"data.val_files={tmp_path}/data/test.parquet",
                 "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.total_training_steps=2",
                 "trainer.test_freq=2", f"trainer.default_local_dir={tmp_path}/out", "prepare.task=null",
                 "prepare.sft_recipe=null", "controller.timeout_s=120"]
    hist = spawn_ranks(_recipe, 1, str(tmp_path), recipe, overrides, timeout_s=300)[0]
    assert [h["step"] for h in hist if h["step"] > 0] == [1, 2]
    return hist


def test_guess_number_recipe_runs_two_steps(tmp_path):
    """recipes/grpo_guess_number as configured (its environment, turn limits, env rewards as
    the score) on a random tiny model, 2 steps."""
    hist = short_recipe(tmp_path, "grpo_guess_number", "guess")
    steps = [h for h in hist if h["step"] > 0]
    assert "val/multi_turn/num_turns/mean" in hist[0] and "val-core/minihf/guess/reward/mean@1" in hist[0]
    for h in steps:
        assert 1 <= h["multi_turn/num_turns/mean"] <= 6 and h["multi_turn/num_turns/max"] <= 6
        assert 0 <= h["critic/score/mean"] <= 1  # env rewards: 1 - 0.1 (turns - 1) when found


def test_tool_arith_recipe_runs_two_steps(tmp_path):
    """recipes/grpo_tool_arith as configured (the calculator, the task's reward on the
    assistant turns) on a random tiny model, 2 steps."""
    hist = short_recipe(tmp_path, "grpo_tool_arith", "tool_arith")
    for h in (h for h in hist if h["step"] > 0):
        assert "multi_turn/tool_calls/mean" in h and 0 <= h["critic/score/mean"] <= 1
    assert "val/multi_turn/tool_calls/mean" in hist[0]


def run_recipe(tmp_path, recipe):
    """``recipe`` from scratch in ``tmp_path`` on 2 processes (data, SFT warm start, RL);
    its metrics rows."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    out = tmp_path / "run"
    data = [f"data.train_files={tmp_path}/data/train.parquet", f"data.val_files={tmp_path}/data/test.parquet"]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    str(root / "scripts" / "train_ppo.py"), f"recipe={recipe}",
                    f"prepare.base_model={tmp_path}/base", *data, f"actor_rollout_ref.model.path={tmp_path}/sft/hf",
                    f"prepare.sft_overrides=[trainer.default_local_dir={tmp_path}/sft,{','.join(data)}]",
                    f"trainer.default_local_dir={out}"], check=True, cwd=tmp_path, timeout=1200)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.slow
def test_tool_arith_recipe_learns(tmp_path):
    """From scratch (task data, 800 SFT steps, 40 GRPO steps, 2 processes): validation
    accuracy rises by >= 0.3 and the tool-call rate rises (measured: val 0.025 -> 0.815,
    sampled calls per sample 0.25 -> 0.93, about 4 minutes)."""
    rows = run_recipe(tmp_path, "grpo_tool_arith")
    val = [r["val-core/mean"] for r in rows if "val-core/mean" in r]
    train = [r for r in rows if r["step"] > 0]
    assert max(val[1:]) >= val[0] + 0.3, val
    assert mean(train[-10:], "multi_turn/tool_calls/mean") > mean(train[:5], "multi_turn/tool_calls/mean") + 0.2


@pytest.mark.slow
def test_guess_number_recipe_learns(tmp_path):
    """The recipe from scratch (task data, SFT warm start, 60 RL steps, 2 processes):
    validation reward and training success rise, turns fall (measured: val 0.60 -> 0.79,
    success 0.72 -> 0.86, turns 3.8 -> 3.2 in 2.5 minutes)."""
    rows = run_recipe(tmp_path, "grpo_guess_number")
    val = [r["val-core/mean"] for r in rows if "val-core/mean" in r]
    train = [r for r in rows if r["step"] > 0]
    first, last = train[:10], train[-10:]
    assert val[-1] >= val[0] + 0.1, val
    assert mean(last, "multi_turn/finish_reason/done") > mean(first, "multi_turn/finish_reason/done") + 0.05
    assert mean(last, "multi_turn/num_turns/mean") < mean(first, "multi_turn/num_turns/mean") - 0.2


def test_stopped_and_resumed_multi_turn_run_equals_the_uninterrupted_one(tiny_job, tmp_path):
    """A multi-turn GRPO run stopped after step 2 of 4 and resumed ends with the parameters
    of the uninterrupted run, bitwise, and its metrics: samples draw from (seed, step, uid,
    sample) streams and environments are rebuilt from the rows, so the trajectories repeat.
    When an environment's answer reaches the engine (one decode step or the next) changes
    the decode batch, which may change the engine's log-probs by rounding only: metrics of
    those (``rollout/``, ``training/rollout_``) are compared within twice
    ``logprob_rounding_bound`` at logit scale 2 (the tiny model's ``logit_abs_scale`` is
    at most 1.39, measured over random 40-token rows): two engine runs, each within the
    bound of exact."""
    from test_ppo import _runs, final_params

    model, data = tiny_job
    extra = {"trainer.total_training_steps": 4, "trainer.save_freq": 2,
             "actor_rollout_ref.rollout.multi_turn.enable": "true",
             "actor_rollout_ref.rollout.multi_turn.environment": f"{__file__}:EchoDigits",
             "data.max_response_length": 32}
    cases = [("full", "grpo", None, "full", extra), ("first", "grpo", 2, "resumed", extra),
             ("rest", "grpo", None, "resumed", extra)]
    res = spawn_ranks(_runs, 1, model, data, str(tmp_path), cases, timeout_s=400)[0]

    def split(h):
        h = {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
        rollout = {k: h.pop(k) for k in list(h) if "rollout" in k}
        return h, rollout
    full = [split(h) for h in res["full"]]
    resumed = [split(h) for h in res["first"] + res["rest"]]
    assert [h["step"] for h, _ in resumed] == [0, 1, 2, 3, 4]
    assert [h for h, _ in full] == [h for h, _ in resumed]
    from minihf.algorithms import logprob_rounding_bound
    tol = 2 * logprob_rounding_bound(torch.tensor(2.0)).item()
    for (_, a), (_, b) in zip(full, resumed):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=tol) for k in a)
    assert max(h.get("multi_turn/num_turns/max", 0) for h, _ in full) >= 2
    a, b = final_params(tmp_path / "full", 4), final_params(tmp_path / "resumed", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
