"""Shared prompts: a prompt sampled n times is packed once and its responses continue it.

Checked against references: by hand (the packing and the attention buckets), against the
same batch packed without sharing and padded (log-probs, entropy, values, scores and
parameter gradients, batch > 1, several groups, an empty response, a lone prompt), and the
flash-attn path (emulated on CPU with bottom-right causal alignment) against the SDPA path.
"""

import pytest
import torch
import torch.nn.functional as F

from minihf.models import ModelArgs, build_model, init_weights, layers, masks
from minihf.models.masks import segments
from minihf.workers.forward import forward_log_probs, forward_scores, forward_values
from minihf.workers.micro_batch import plan_token_budget
from minihf.workers.packing import next_token_labels, pack, prompt_groups, unpack

from test_fsdp import ARGS


def tiny(head):
    return init_weights(build_model(ModelArgs(**ARGS), head), seed=1)


def grouped_batch(prompts, n, r, seed=0, vocab=48):
    """Each prompt (a token list) ``n`` times (or ``n[i]`` times), left-padded, with
    right-padded random responses of 1..r tokens, but row 1's is empty; rows ordered
    prompt by prompt."""
    g = torch.Generator().manual_seed(seed)
    p = max(len(x) for x in prompts)
    counts = n if isinstance(n, list) else [n] * len(prompts)
    rows = [(x, int(torch.randint(1, r + 1, (), generator=g)))
            for x, c in zip(prompts, counts) for _ in range(c)]
    rows[1] = (rows[1][0], 0)
    ids = torch.zeros(len(rows), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (x, rl) in enumerate(rows):
        ids[i, p - len(x):p] = torch.tensor(x)
        ids[i, p:p + rl] = torch.randint(1, vocab, (rl,), generator=g)
        mask[i, p - len(x):p + rl] = 1
    resp_mask = mask[:, p:]
    return {"input_ids": ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": ids[:, p:],
            "response_mask": resp_mask, "advantages": torch.randn(len(rows), r, generator=g) * resp_mask}


def test_pack_shares_prompts_by_hand():
    # rows: [A A | x], [A A | y z], [B | w]  (prompt columns 0-1, response columns 2-3)
    ids = torch.tensor([[1, 2, 7, 0], [1, 2, 8, 9], [0, 3, 6, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert prompt_groups(ids, mask, pos, 2) == ([[0, 1], [2]], [2, 1])
    p = pack(ids, mask, pos, prompt_length=2)
    assert p.tokens.tolist() == [[1, 2, 7, 8, 9, 3, 6]]
    assert p.positions.tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 2, 3, 5, 7]      # [A A] [x] [y z] [B w]
    assert p.shared_prefix.tolist() == [-1, 0, 0, -1]     # x and y z continue A A
    assert p.slot.view(3, 4).tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [-1, 5, 6, -1]]
    assert torch.equal(unpack(p.tokens[0], p), ids * mask)
    with pytest.raises(ValueError, match="without shared prompts"):
        next_token_labels(p)
    # two rows share a prompt but neither has a response: one sequence, read by both rows
    e = pack(ids[:2], torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]]), pos[:2], prompt_length=2)
    assert e.tokens.tolist() == [[1, 2]] and e.shared_prefix is None
    assert unpack(e.tokens[0], e).tolist() == [[1, 2, 0, 0], [1, 2, 0, 0]]
    # no repeated prompt: the same packing as without prompt_length
    q = pack(ids[1:], mask[1:], pos[1:], prompt_length=2)
    r = pack(ids[1:], mask[1:], pos[1:])
    assert q.shared_prefix is None and torch.equal(q.tokens, r.tokens)
    assert torch.equal(q.cu_seqlens, r.cu_seqlens) and torch.equal(q.indices, r.indices)


def test_segments_with_a_shared_prefix_by_hand():
    # packed [P0 P1 | a0 | b0 b1 | c0]: a and b continue P; c stands alone
    seg = segments(torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32), 6,
                   torch.tensor([-1, 0, 0, -1]))
    # one bucket of length 4, rows sorted by length: c as [c0], a as [P0 P1 a0], b as
    # [P0 P1 b0 b1] (right-padded by repeating the last token); P gets no row of its own
    # and reads back from a's row, its first continuation
    assert seg.shapes == [(3, 4)]
    assert seg.gather[0].view(3, 4).tolist() == [[5, 5, 5, 5], [0, 1, 2, 2], [0, 1, 3, 4]]
    assert seg.back.tolist() == [4, 5, 6, 10, 11, 0]
    with pytest.raises(ValueError, match=r"shared_prefix\[2\]=1"):
        segments(torch.tensor([0, 2, 3, 5], dtype=torch.int32), 5, torch.tensor([-1, 0, 1]))


@pytest.mark.parametrize("padded_reference", [False, True])
def test_shared_equals_unshared_outputs_and_gradients(padded_reference):
    """3 prompts x 4 responses + 1 lone prompt, one empty response: log-probs, entropy and
    every parameter gradient with sharing equal those without (packed or padded)."""
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
    b = grouped_batch(prompts, [4, 4, 4, 1], 9, seed=4)
    p = b["input_ids"].shape[1] - 9
    groups, _ = prompt_groups(b["input_ids"], b["attention_mask"], b["position_ids"], p)
    assert [len(g) for g in groups] == [4, 4, 4, 1]
    out = []
    for share in (True, False):
        lm = tiny("lm")
        res = forward_log_probs(lm, b, use_remove_padding=share or not padded_reference,
                                share_prompt=share, calc_entropy=True, temperature=0.8)
        ((res["log_probs"] * b["advantages"]).sum() + res["entropy"].sum()).backward()
        out.append((res, {n: q.grad for n, q in lm.named_parameters()}))
    (r1, g1), (r2, g2) = out
    m = b["response_mask"].bool()
    assert (r1["log_probs"][~m] == 0).all() and (r1["entropy"][~m] == 0).all()
    # other attention buckets, fp32 sums in another order; |x| < 5 (ulp 4.8e-7): 1e-5 is 20+ ulp
    for k in ("log_probs", "entropy"):
        assert torch.allclose(r1[k][m], r2[k][m], atol=1e-5), k
    # gradients sum many per-token terms that cancel, so errors track the terms, not |g|:
    # rtol 1e-4 (~800 ulp) for large entries, atol 1e-5 for those near 0
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5, rtol=1e-4), n
    with torch.no_grad():
        critic, rm = tiny("value"), tiny("score")
        v1 = forward_values(critic, b, share_prompt=True)
        v2 = forward_values(critic, b, use_remove_padding=not padded_reference)
        # values and scores |x| < 0.2 (ulp 1.5e-8): 1e-5 is 600+ ulp
        assert torch.allclose(v1[m], v2[m], atol=1e-5)
        s1 = forward_scores(rm, b, share_prompt=True)
        s2 = forward_scores(rm, b, use_remove_padding=not padded_reference)
        assert torch.allclose(s1, s2, atol=1e-5)


def fake_flash_varlen(calls):
    """flash-attn's varlen call on CPU: per sequence, causal aligned bottom-right."""
    def fn(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        assert causal and cu_q.dtype == cu_k.dtype == torch.int32
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for (a, b), (c, d) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                  zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
            qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            allowed = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed).transpose(0, 1)
        return out
    return fn


def test_flash_path_with_shared_prefix_matches_sdpa_path(monkeypatch):
    b = grouped_batch([[5, 6, 7, 8], [9, 10, 11]], 3, 6, seed=2)
    p = b["input_ids"].shape[1] - 6
    lm = tiny("lm")
    with torch.no_grad():
        ref = forward_log_probs(lm, b, share_prompt=True)["log_probs"]
        calls = []
        monkeypatch.setattr(masks, "flash_varlen_usable", lambda device, dtype: True)
        monkeypatch.setattr(layers, "flash_attn_varlen_func", fake_flash_varlen(calls))
        got = forward_log_probs(lm, b, share_prompt=True)["log_probs"]
    packed = pack(b["input_ids"], b["attention_mask"], b["position_ids"], p)
    cu_q, cu_k, _, max_k = calls[0]
    assert cu_q == packed.cu_seqlens.tolist()
    lens_q = [y - x for x, y in zip(cu_q, cu_q[1:])]
    lens_k = [y - x for x, y in zip(cu_k, cu_k[1:])]
    prefix = packed.shared_prefix.tolist()
    assert lens_k == [q + (lens_q[pr] if pr != -1 else 0) for q, pr in zip(lens_q, prefix)]
    assert max_k == max(lens_k) and len(calls) == ARGS["num_hidden_layers"]
    assert (got - ref).abs().max() < 1e-5  # emulated flash vs SDPA, |lp| < 5: 20+ ulp


def test_token_budget_keeps_groups_together():
    # rows 0-3 share a 10-token prompt (rows 12, 13, 14, 15 tokens), rows 4-5 another
    lens = [12, 13, 14, 15, 20, 21]
    groups, shared = [[0, 1, 2, 3], [4, 5]], [10, 18]
    plan = plan_token_budget(lens, 40, groups=(groups, shared))
    assert plan == [[0, 1, 2, 3], [4, 5]]  # 10 + 2+3+4+5 = 24 and 18 + 2 + 3 = 23 tokens
    # a group over the budget is cut into consecutive chunks that fit

    def cost(mb):  # packed tokens: each group's prompt once
        return sum(lens[i] for i in mb) - sum(
            (len(set(mb) & set(g)) - 1) * n for g, n in zip(groups, shared) if set(mb) & set(g))
    plan = plan_token_budget(lens, 21, groups=(groups, shared))
    assert plan == [[0, 1, 2], [3], [4], [5]]  # 10 + 2 + 3 + 4 = 19, 15, 20, 21 tokens
    assert max(cost(mb) for mb in plan) <= 21
    # ranks agree on a count: more micro-batches than units cuts the groups into rows
    plan = plan_token_budget(lens, 100, num_micro_batches=3, groups=(groups, shared))
    assert len(plan) == 3 and sorted(i for mb in plan for i in mb) == list(range(6))
    with pytest.raises(ValueError, match="row 4 has 20 tokens"):
        plan_token_budget(lens, 19, groups=(groups, shared))


def test_actor_critic_and_reward_model_workers_with_and_without_sharing(tmp_path):
    """The RL workers on one process with ``share_prompt`` on and off under a token budget
    that cuts the batch into several micro-batches: the same log-probs, values, scores,
    update metrics and parameters."""
    from minihf.models import save_hf
    from minihf.protocol import Batch
    from minihf.workers.actor import ActorRolloutRefWorker
    from minihf.workers.critic import CriticWorker
    from minihf.workers.reward_model import RewardModelWorker
    from minihf.workers.config import RewardModelConfig, RLModelConfig

    from test_workers import actor_cfg, critic_cfg, local_worker, max_diff

    path = str(save_hf(tiny("lm"), tmp_path / "model"))
    raw = grouped_batch([[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]], 4, 7, seed=3)
    raw["returns"] = torch.randn(12, 7, generator=torch.Generator().manual_seed(3)) * raw["response_mask"]
    batch = Batch(raw, meta={"temperature": 0.8})
    out = {}
    for share in (True, False):
        a_cfg, c_cfg = actor_cfg(path, None, max_tokens=30), critic_cfg(path, None, max_tokens=30)
        a_cfg.actor.log_prob_micro_batch_size_per_gpu = None
        a_cfg.actor.max_tokens_per_micro_batch = 30
        a_cfg.ref.log_prob_micro_batch_size_per_gpu, a_cfg.ref.max_tokens_per_micro_batch = None, 30
        a_cfg.model.share_prompt = c_cfg.model.share_prompt = share
        c_cfg.cliprange_value = 1e3  # a clipped value loss switches branch on rounding: off
        actor, critic = local_worker(ActorRolloutRefWorker, a_cfg), local_worker(CriticWorker, c_cfg)
        rm = local_worker(RewardModelWorker, RewardModelConfig(model=RLModelConfig(path=path, share_prompt=share)))
        full = batch | actor.compute_log_prob(batch, calc_entropy=True) | actor.compute_ref_log_prob(batch)
        full = full | critic.compute_values(batch)
        out[share] = dict(batch=full, scores=rm.compute_rm_score(batch), a=actor.update_actor(full),
                          c=critic.update_critic(full), params=actor.actor.state_dict(),
                          critic=critic.critic.state_dict())
    on, off = out[True], out[False]
    # sums in another order, |x| < 5 (ulp 4.8e-7): 1e-5 is 20+ ulp; metrics 1e-5 relative ~80 ulp
    for k in ("old_log_probs", "entropys", "ref_log_prob", "values"):
        assert torch.allclose(on["batch"][k], off["batch"][k], atol=1e-5), k
    assert torch.allclose(on["scores"]["rm_scores"], off["scores"]["rm_scores"], atol=1e-5)
    for k, v in off["a"].items():
        assert abs(on["a"][k] - v) <= 1e-5 * max(1.0, abs(v)), (k, on["a"][k], v)
    for k, v in off["c"].items():
        assert abs(on["c"][k] - v) <= 1e-5 * max(1.0, abs(v)), (k, on["c"][k], v)
    # Adam moves a weight by up to lr whatever its gradient's size, so rounding differences
    # in small gradients grow: measured up to 1.2e-7 on the actor (lr 1e-3, 4 steps) and
    # 4e-5 on the critic (lr 1e-2, 6 steps, a new random head). k_proj.bias has zero gradient
    # in exact arithmetic (it adds the same q.b to every score of a query, which softmax
    # ignores), so Adam turns its rounding noise into +-lr steps: it is left out
    for name, lr, tol in (("params", 1e-3, 1e-3), ("critic", 1e-2, 1e-2)):
        a, b = ({k: v for k, v in out[s][name].items() if not k.endswith("k_proj.bias")}
                for s in (True, False))
        assert max_diff(a, b) < tol * lr, name


@pytest.mark.parametrize("packed, share", [(True, True), (True, False), (False, False)])
def test_a_row_without_a_prompt_token_is_refused(packed, share):
    """A response's first token is scored from the prompt's last: a row with none was an
    index error deep in torch (packed) or silently scored after a pad (padded)."""
    mb = grouped_batch([[1, 2, 3], [4, 5]], 2, 3)
    mb["attention_mask"][2, :3] = 0
    mb["input_ids"][2, :3] = 0
    kw = {"use_remove_padding": packed, "share_prompt": share}
    with pytest.raises(ValueError, match=r"row\(s\) \[2\] of the micro-batch have no prompt token"):
        forward_log_probs(tiny("lm"), mb, **kw)
    with pytest.raises(ValueError, match="no prompt token"):
        forward_values(tiny("value"), mb, **kw)
