"""Micro-batch planning (pure Python) and packed vs padded forwards."""

import pytest
import torch

from minihf.models import ModelArgs, build_model, init_weights
from minihf.workers.forward import forward_log_probs, forward_scores, forward_values
from minihf.workers.micro_batch import balanced_partition, plan_fixed, plan_token_budget
from minihf.workers.packing import pack, unpack

from test_fsdp import ARGS, make_batch


def test_plan_fixed():
    assert plan_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        plan_fixed(5, 0)


def test_token_budget_respects_budget_covers_rows_and_balances():
    lens = [7, 3, 9, 1, 4, 4, 8, 2]
    plan = plan_token_budget(lens, 12)
    assert sorted(i for b in plan for i in b) == list(range(len(lens)))
    loads = [sum(lens[i] for i in b) for b in plan]
    assert max(loads) <= 12
    assert len(plan) == 4  # ceil(38 / 12) = 4 bins suffice here
    assert max(loads) - min(loads) <= 2
    assert plan == plan_token_budget(lens, 12)  # deterministic
    assert all(b == sorted(b) for b in plan)


def test_token_budget_forced_count_and_errors():
    lens = [5, 5, 5, 5]
    assert len(plan_token_budget(lens, 100)) == 1
    assert len(plan_token_budget(lens, 100, num_micro_batches=3)) == 3
    assert len(plan_token_budget(lens, 100, num_micro_batches=9)) == 4  # capped at rows
    assert plan_token_budget([], 10) == []
    with pytest.raises(ValueError, match="row 1 has 11 tokens.*at least the longest"):
        plan_token_budget([3, 11], 10)
    # LPT can need more bins than the lower bound: 3 items of 6 into budget 10 -> 3 bins
    assert len(plan_token_budget([6, 6, 6], 10)) == 3
    assert balanced_partition([1, 2, 3], 2) == [[0, 1], [2]]


def tiny(head):
    return init_weights(build_model(ModelArgs(**ARGS), head), seed=1)


def test_pack_unpack_round_trip_and_cu_seqlens():
    b = make_batch(3, 4, 3, seed=2)
    p = pack(b["input_ids"], b["attention_mask"], b["position_ids"])
    lens = b["attention_mask"].sum(-1)
    assert p.cu_seqlens.tolist() == [0] + torch.cumsum(lens, 0).tolist()
    assert p.positions[0, : lens[0]].tolist() == list(range(int(lens[0])))
    assert torch.equal(unpack(p.tokens[0], p), b["input_ids"] * b["attention_mask"])
    bad = b["attention_mask"].clone()
    bad[0, -4] = 0
    bad[0, -5:] = torch.tensor([1, 0, 1, 1, 0])
    with pytest.raises(ValueError, match="row 0 .* gap"):
        pack(b["input_ids"], bad, b["position_ids"])


def test_packed_equals_padded_gradients_over_many_buckets():
    """Lengths from 7 to 107 tokens (three attention buckets): the packed forward's
    log-probs and parameter gradients equal the padded forward's."""
    from minihf.models.masks import plan_buckets

    b = make_batch(12, 8, 100, seed=7)
    assert len(plan_buckets(b["attention_mask"].sum(-1).tolist())) == 3
    grads = []
    for packed in (True, False):
        lm = tiny("lm")
        lp = forward_log_probs(lm, b, use_remove_padding=packed)["log_probs"]
        (lp * b["advantages"]).sum().backward()
        grads.append((lp.detach(), {n: p.grad for n, p in lm.named_parameters()}))
    (lp1, g1), (lp2, g2) = grads
    m = b["response_mask"].bool()
    # packed vs padded, sums in another order: |lp| < 5 (ulp 4.8e-7), so 1e-5 is 20+ ulp;
    # gradients sum many per-token terms that cancel: rtol 1e-4 (~800 ulp), atol 1e-5 near 0
    assert torch.allclose(lp1[m], lp2[m], atol=1e-5)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5, rtol=1e-4), n


def test_packed_equals_padded_log_probs_entropy_values_scores():
    b = make_batch(5, 6, 4, seed=3)
    lm = tiny("lm")
    with torch.no_grad():
        packed = forward_log_probs(lm, b, use_remove_padding=True, calc_entropy=True, temperature=0.7)
        padded = forward_log_probs(lm, b, use_remove_padding=False, calc_entropy=True, temperature=0.7)
        m = b["response_mask"].bool()
        # here and below: |lp|, entropy < 5 (ulp 4.8e-7), 1e-5 is 20+ ulp; |values|, |scores| < 0.2
        assert torch.allclose(packed["log_probs"][m], padded["log_probs"][m], atol=1e-5)
        assert torch.allclose(packed["entropy"][m], padded["entropy"][m], atol=1e-5)
        # reference: each sequence alone, unpadded, through the plain model
        for i in range(len(b["input_ids"])):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()][None]
            logits = lm(ids, torch.arange(ids.shape[1])[None]).float() / 0.7
            r = int(b["response_mask"][i].sum())
            ref = torch.log_softmax(logits[0, -r - 1:-1], -1).gather(1, ids[0, -r:, None])[:, 0]
            assert torch.allclose(packed["log_probs"][i, :r], ref, atol=1e-5)
        critic = tiny("value")
        v1 = forward_values(critic, b, use_remove_padding=True)
        v2 = forward_values(critic, b, use_remove_padding=False)
        assert torch.allclose(v1[m], v2[m], atol=1e-5)
        rm = tiny("score")
        s1 = forward_scores(rm, b, use_remove_padding=True)
        s2 = forward_scores(rm, b, use_remove_padding=False)
        assert torch.allclose(s1, s2, atol=1e-5)
        last = b["response_mask"].sum(-1) - 1
        assert (s1 != 0).sum() == len(b["input_ids"])
        assert torch.equal((s1 != 0).float().argmax(-1), last)
        # reference: the score head at the last token of each sequence run alone, unpadded
        for i in range(len(b["input_ids"])):
            ids = b["input_ids"][i][b["attention_mask"][i].bool()][None]
            alone = rm(ids, torch.arange(ids.shape[1])[None])[0, -1]
            assert abs(s1[i, last[i]].item() - alone.item()) < 1e-5, i


def test_mini_batch_rows_epochs_shuffle_and_divisibility():
    from minihf.workers.train_state import mini_batch_rows

    # group=None: one rank holds the whole global mini-batch
    assert mini_batch_rows(5, 2, 1, epochs=2, shuffle=False, seed=0) == [[0, 1], [2, 3], [4]] * 2
    steps = mini_batch_rows(8, 4, 1, epochs=3, shuffle=True, seed=7)
    epochs = [sum(steps[i:i + 2], []) for i in range(0, 6, 2)]
    assert all(sorted(e) == list(range(8)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled each epoch
    assert steps == mini_batch_rows(8, 4, 1, epochs=3, shuffle=True, seed=7)  # same seed, same order
    assert steps != mini_batch_rows(8, 4, 1, epochs=3, shuffle=True, seed=8)


def test_rollout_logprobs_equal_compute_log_prob_path():
    """Issue 5: the engine's sampled-token log-probs vs the trainer's own path
    (``forward_log_probs``, packed with and without shared prompts and padded, verl batch
    layout), batch > 1."""
    from minihf.rollout import LLM, SamplingParams

    trainer = tiny("lm")
    engine_model = tiny("lm")  # same seed: same weights, its own copy (the engine may re-lay it out)
    llm = LLM(engine_model, max_num_seqs=3, cpu_column_major=True, eos_token_ids=())
    prompts = [[5, 9, 11, 3, 7], [20, 21], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]]
    temperature = 0.7
    outs = llm.generate(prompts, [SamplingParams(n=2, temperature=temperature, top_k=20, max_tokens=m,
                                                 seed=s) for s, m in enumerate([7, 3, 5, 1])])
    pairs = [(p, c) for p, o in zip(prompts, outs) for c in o.outputs]
    p_len, r_len = max(len(p) for p, _ in pairs), max(len(c.token_ids) for _, c in pairs)
    ids = torch.zeros(len(pairs), p_len + r_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(pairs):
        ids[i, p_len - len(p):p_len] = torch.tensor(p)
        ids[i, p_len:p_len + len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, p_len - len(p):p_len + len(c.token_ids)] = 1
    mb = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
          "responses": ids[:, p_len:]}
    assert len({len(c.token_ids) for _, c in pairs}) > 1  # right padding is exercised
    worst = 0.0
    with torch.no_grad():
        for packed, share in ((True, True), (True, False), (False, False)):
            lp = forward_log_probs(trainer, mb, use_remove_padding=packed, share_prompt=share,
                                   temperature=temperature)
            for i, (_, c) in enumerate(pairs):
                got = lp["log_probs"][i, :len(c.token_ids)]
                worst = max(worst, (got - torch.tensor(c.logprobs)).abs().max().item())
    print(f"max |engine logprob - compute_log_prob| = {worst:.2e}")
    # engine vs trainer kernels; |lp| < 5 (ulp 4.8e-7) with |z/T| < 1 here: 1e-5 is 20+ ulp
    assert worst < 1e-5


def _ranks_plan_alike(rank, world):
    """Each rank one group of 8 rows sharing a 50-token prompt; responses of 10 tokens on
    rank 0, 30 on rank 1, a budget of 200: rank 1 needs 2 micro-batches, so rank 0 is forced
    to 2, more than its one shared unit, and planned its rows alone at their unshared cost
    (60 each: 3 micro-batches). It then ran 3 forwards to rank 1's 2 and the job hung."""
    import torch.distributed as dist

    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh
    from minihf.workers.engine import run_micro_batches

    model = init_weights(build_model(ModelArgs(**ARGS), "lm"), seed=0)
    apply_fsdp(model, fsdp_mesh(dist.group.WORLD, "cpu"), mixed_precision="none")
    P, R, B = 50, 30, 8
    ids = torch.full((B, P + R), 7, dtype=torch.long)
    ids[:, P:] = (torch.arange(B)[:, None] + torch.arange(R)) % 40 + 1
    mask = torch.zeros(B, P + R, dtype=torch.long)
    mask[:, :P + (10 if rank == 0 else 30)] = 1
    data = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, P:]}
    sizes = []

    def forward(mb):
        sizes.append(len(mb["input_ids"]))
        return forward_log_probs(model, mb, share_prompt=True)
    run_micro_batches(data, forward, micro_batch_size=None, max_tokens=200, group=dist.group.WORLD,
                      model=model, share_prompt=True)
    return sizes


def test_ranks_run_as_many_micro_batches_with_shared_prompts():
    from minihf.testing import spawn_ranks

    first, second = spawn_ranks(_ranks_plan_alike, 2, timeout_s=120, pg_timeout_s=20)
    assert len(first) == len(second) and sum(first) == sum(second) == 8
