"""Balancing the ranks' tokens per mini-batch (``minihf.trainer.balance``): by hand, and
the properties the update relies on (a permutation; every mini-batch keeps its rows;
prompt groups stay whole on one rank; never more imbalance than before)."""

import random

import pytest
import torch

from minihf.protocol import Batch
from minihf.trainer.balance import balance_batch, balanced_order, imbalance, rank_tokens


def test_by_hand():
    # 2 ranks, one mini-batch of 4 rows: rank 0 held 9 + 9, rank 1 held 1 + 1
    assert balanced_order([9, 9, 1, 1], 1, 2, 4) == [0, 2, 1, 3]
    assert rank_tokens([9, 1, 9, 1], 2, 4) == [[10, 10]]
    # groups of 2 rows (a prompt's samples) move whole: [5, 5] [4, 4] | [1, 1] [2, 2]
    assert balanced_order([5, 5, 4, 4, 1, 1, 2, 2], 2, 2, 8) == [0, 1, 4, 5, 2, 3, 6, 7]
    # two mini-batches of 4 rows: rows stay in their mini-batch (0-1 + 4-5, 2-3 + 6-7)
    order = balanced_order([8, 8, 1, 1, 1, 1, 8, 8], 1, 2, 4)
    assert order == [0, 4, 2, 6, 1, 5, 3, 7]
    assert rank_tokens([[8, 8, 1, 1, 1, 1, 8, 8][i] for i in order], 2, 4) == [[9, 9], [9, 9]]
    # float64 ratios of integer token counts: approx's default rel=1e-6 is ~5e9 ulp
    assert imbalance([8, 8, 1, 1, 1, 1, 8, 8], 2, 4) == pytest.approx(7 / 9)
    # nothing to gain, or a batch that does not cut evenly: the order stays
    assert balanced_order([3, 1, 1, 3], 1, 2, 4) == [0, 1, 2, 3]
    assert balanced_order([5, 1, 1], 1, 2, 2) == [0, 1, 2]
    assert balanced_order([5, 1, 1, 1], 1, 1, 4) == [0, 1, 2, 3]
    assert imbalance([5, 1, 1], 2, 2) is None


@pytest.mark.parametrize("seed", range(20))
def test_properties(seed):
    rng = random.Random(seed)
    dp = rng.choice([2, 3, 4])
    group = rng.choice([1, 2, 4])
    local = group * rng.randint(1, 3)
    steps = rng.randint(1, 3)
    n = dp * local * steps
    tokens = [rng.randint(1, 60) for _ in range(n)]
    mini = dp * local
    order = balanced_order(tokens, group, dp, mini)
    assert sorted(order) == list(range(n))
    chunk = n // dp
    for k in range(steps):  # mini-batch k: the same rows, before and after
        slots = [r * chunk + k * local + j for r in range(dp) for j in range(local)]
        assert sorted(order[s] for s in slots) == sorted(slots)
        for r in range(dp):  # a rank's rows are whole groups
            mine = [order[r * chunk + k * local + j] for j in range(local)]
            heads = {i // group for i in mine}
            assert len(heads) * group == local
    after = [tokens[i] for i in order]
    for a, b in zip(rank_tokens(after, dp, mini), rank_tokens(tokens, dp, mini)):
        assert max(a) <= max(b)
    # float64 of integer counts / dp, values < 10: 1e-12 is >= 500 ulp, far below a real change
    assert imbalance(after, dp, mini) <= imbalance(tokens, dp, mini) + 1e-12


def test_balance_batch_weighs_a_shared_prompt_once():
    # 4 rows, groups of 2: prompts of 4 and 0 real tokens, responses 1, 1 | 3, 3
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]])
    batch = Batch({"attention_mask": mask, "prompts": torch.zeros(4, 4, dtype=torch.long),
                   "row": torch.arange(4)})
    m = {}
    out = balance_batch(batch, m, dp=2, group_size=2, mini_batch_size=4, shares_prompt=True)
    # work per group: 4 + 1 + 1 = 6 (the prompt once) vs 3 + 3 = 6: already even
    assert out["row"].tolist() == [0, 1, 2, 3]
    assert m["global_seqlen/imbalance"] == 0.0 == m["global_seqlen/balanced_imbalance"]
    m = {}
    out = balance_batch(batch, m, dp=2, group_size=2, mini_batch_size=4, shares_prompt=False)
    assert out["row"].tolist() == [0, 1, 2, 3]  # 10 vs 6, but the groups cannot split
    assert m["global_seqlen/imbalance"] == pytest.approx(2 / 8)  # float64 of integers


def test_balancing_is_skipped_where_it_would_move_rows_between_mini_batches(tiny_job, tmp_path):
    """Balancing keeps the actor's mini-batches: with a critic that cuts its mini-batches
    otherwise, or sequence parallelism (an SP group pools its ranks' rows first), it moved
    rows between that role's mini-batches (the docs said never). It is skipped there, said
    once."""
    from minihf.trainer.ppo import PPOTrainer
    from test_ppo import ScriptedActor, job_config

    class TwoRanks(ScriptedActor):
        dp_size, ranks = 2, (0, 1)

    class Critic:
        dp_size, ranks = 2, (0, 1)

    model, data = tiny_job
    cases = [("grpo", {}, None),
             ("grpo", {"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2}, "actor runs sequence parallel"),
             ("ppo", {"critic.ppo_mini_batch_size": 2}, "critic cuts its mini-batches otherwise than the actor"),
             ("ppo", {}, None)]
    for recipe, extra, why in cases:
        said = []
        cfg = job_config(model, data, tmp_path / "run", recipe, **extra)
        groups = {"actor": TwoRanks()} | ({"critic": Critic()} if recipe == "ppo" else {})
        trainer = PPOTrainer(cfg, groups, log=said.append)
        assert trainer.balance_keeps_mini_batches() == (why is None) and trainer.balance_keeps_mini_batches() == (why is None)
        assert [s for s in said if "balance_batch" in s] == ([] if why is None else [
            f"trainer.balance_batch: skipped ({why}: balancing would move rows between its mini-batches)"])
