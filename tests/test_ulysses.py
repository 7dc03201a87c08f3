"""Ulysses sequence parallelism (``minihf.parallel.ulysses``) against one process.

Two gloo ranks form one SP group. Each holds half the rows of a batch (as the controller
deals them); the pair unites them and runs every micro-batch with half its tokens each. The
log-probs, entropy and values must be one process's on the whole batch to rounding, the
gradients (summed over the pair, as FSDP's reduce-scatter sums them) the whole batch's, and
an FSDP update with SP=2 the update without it.

Bounds: log-probs against a float64 forward of the same weights within
``logprob_rounding_bound`` (tests/logprob_reference.py), for SP and for one process alike;
SP changes only how many rows each projection's matmul has and which heads a rank attends
over, so every figure is fp32 rounding of the same sums.
"""

import pytest
import torch
import torch.distributed as dist

from minihf.algorithms import agg_loss
from minihf.models import ModelArgs, build_model, init_weights
from minihf.models.lora import apply_lora, is_lora_param, module_names
from minihf.parallel.fsdp import apply_fsdp, enable_activation_checkpointing, fsdp_mesh
from minihf.parallel.ulysses import SeqParallel, attention_groups, head_ranges, head_split, seq_parallel
from minihf.testing import spawn_ranks
from minihf.workers.forward import forward_log_probs, forward_values
from minihf.workers.optim import OptimConfig
from minihf.workers.train_state import TrainState
from minihf.workers.train_step import take_rows
from logprob_reference import float64_log_probs, rounding_ratio

ARGS = dict(arch="qwen2", vocab_size=48, hidden_size=32, num_hidden_layers=2, head_dim=8,
            intermediate_size=64, attention_bias=True, max_position_embeddings=64)
# (query heads, KV heads) over 2 ranks: 2+2 / 1+1; 2+1 / the one KV head to both; 3+3 / KV heads
# 0,1 and 1,2 (the middle one to both), each rank's query heads 2+1 and 1+2 over its two: two
# attention calls a rank (SmolLM2's 9/3 splits so)
HEADS = {"even": (4, 2), "uneven": (3, 1), "grouped": (6, 3)}


def tiny(head="lm", heads=(4, 2), seed=0, lora=False):
    """A tiny model; ``lora``: rank-2 adapters on every linear layer, trained alone (B drawn
    at random instead of peft's zeros, so both A and B get gradients)."""
    args = ModelArgs(**ARGS, num_attention_heads=heads[0], num_key_value_heads=heads[1])
    model = init_weights(build_model(args, head), seed=seed)
    if lora:
        apply_lora(model, 2, 4.0, module_names(model, "all-linear"))
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            p.requires_grad_(is_lora_param(name))
            if is_lora_param(name):
                p.data = torch.randn(p.shape, generator=g) * 0.1
    return model


def rl_batch(prompts, n, p, r, seed=0, vocab=48):
    """``prompts`` x ``n`` rows: each prompt (left-padded, random length) repeated ``n``
    times with its own right-padded response, as a GRPO batch is."""
    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    ids = torch.randint(1, vocab, (b, p + r), generator=g)
    plen = torch.randint(1, p + 1, (prompts,), generator=g).repeat_interleave(n)
    ids[:, :p] = ids[::n, :p].repeat_interleave(n, 0)
    rlen = torch.randint(1, r + 1, (b,), generator=g)
    col = torch.arange(p + r)
    mask = ((col >= p - plen[:, None]) & (col < p + rlen[:, None])).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, p:], "response_mask": mask[:, p:],
            "advantages": torch.randn(b, r, generator=g) * mask[:, p:]}


def test_head_split():
    assert head_split(9, 2) == [5, 4] and head_split(8, 4) == [2, 2, 2, 2] and head_split(3, 3) == [1, 1, 1]
    # SmolLM2: query heads 0-4 read KV heads 0 (0-2) and 1 (3-4); 5-8 read 1 (5) and 2 (6-8)
    assert head_ranges(9, 3, 2) == ((0, 5, 0, 2), (5, 9, 1, 3))
    assert attention_groups(0, 5, 3, 0) == ((0, 3, 0, 1), (3, 5, 1, 2))
    assert attention_groups(5, 9, 3, 1) == ((0, 1, 0, 1), (1, 4, 1, 2))
    # runs of equal length merge into one grouped call: 16/4 over 3 ranks, rank 0 heads 0-5
    assert attention_groups(0, 6, 4, 0) == ((0, 4, 0, 1), (4, 6, 1, 2))
    assert attention_groups(0, 4, 2, 0) == ((0, 4, 0, 2),) and head_ranges(3, 1, 2) == ((0, 2, 0, 1), (2, 3, 0, 1))
    with pytest.raises(ValueError, match="at most 9"):
        head_split(9, 16)


def _forward(rank, world):
    sp = SeqParallel(dist.group.WORLD)
    out = {}
    for name, heads in HEADS.items():
        for share, chunk, lora in ((False, None, False), (False, 3, False), (True, None, False),
                                   (True, 3, False), (True, None, True)):
            batch = rl_batch(3, 2, 6, 7, seed=len(out))
            mine = take_rows(batch, range(rank * 3, rank * 3 + 3))
            model = tiny(heads=heads, lora=lora)
            united, own = sp.gather_rows(mine)
            assert torch.equal(united["input_ids"], batch["input_ids"]) and own == slice(rank * 3, rank * 3 + 3)
            ids = torch.stack([batch["responses"], (batch["responses"] + 1) % model.args.vocab_size], -1)
            kw = dict(share_prompt=share, logits_chunk=chunk, calc_entropy=True, ids=ids)  # an aux loss's ids too

            def loss(o):
                return (o["log_probs"] * batch["advantages"]).sum() + 0.1 * o["log_probs_at"].sum()
            got = forward_log_probs(model, batch, sp=sp, **kw)
            loss(got).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            for g in grads.values():
                dist.all_reduce(g)  # what FSDP's reduce-scatter sums
            ref_model = tiny(heads=heads, lora=lora)
            ref = forward_log_probs(ref_model, batch, **kw)
            loss(ref).backward()
            lp64, scale = float64_log_probs(ref_model, batch, 1.0)
            mask = batch["response_mask"]
            out[(name, share, chunk, lora)] = {
                "tokens": int(batch["attention_mask"].sum()),
                "sp": rounding_ratio(got["log_probs"], lp64, scale, mask),
                "one": rounding_ratio(ref["log_probs"], lp64, scale, mask),
                "entropy": (got["entropy"] - ref["entropy"]).abs().max().item(),
                "at": (got["log_probs_at"] - ref["log_probs_at"]).abs().max().item(),
                "grad": max((grads[n] - p.grad).abs().max().item() for n, p in ref_model.named_parameters()
                            if p.grad is not None),
                "grad_scale": max(p.grad.abs().max().item() for p in ref_model.parameters() if p.grad is not None),
                "trained": sorted(grads),
            }
        critic = tiny("value", heads=heads, seed=1)
        batch = rl_batch(2, 2, 5, 6, seed=9)
        got = forward_values(critic, batch, share_prompt=True, sp=sp)
        ref = forward_values(tiny("value", heads=heads, seed=1), batch, share_prompt=True)
        out[(name, "values")] = (got - ref).abs().max().item()
    return out


def test_sp_forward_and_gradients_match_one_process():
    res = spawn_ranks(_forward, 2)
    for r in res:
        for key, v in r.items():
            if key[1] == "values":
                # derived, not read off a run: SP changes only matmul row counts and head subsets, so
                # the two differ by fp32 rounding of the same dot products; one product of K <= 64
                # terms rounds by at most K u = 64 x 6e-8 = 3.8e-6 of sum|a b| (<~ 1 here), and a
                # value passes through ~2 such products per block that can shift it: 1e-5 covers it
                assert v < 1e-5, (key, v)
                continue
            assert v["sp"] <= 1 and v["one"] <= 1, (key, v)  # both within fp32's rounding of float64
            assert v["entropy"] < 1e-5 and v["at"] < 1e-5, (key, v)  # the same rounding argument on logits ~1: 1e-5
            # one backward: the same dot-product rounding (K u <= 3.8e-6 relative), plus the two
            # ranks' partial sums added in another order (u each): 1e-5 of the largest gradient
            assert v["grad"] <= 1e-5 * v["grad_scale"], (key, v)
            lora = [n for n in v["trained"] if is_lora_param(n)]
            assert lora == (v["trained"] if key[3] else []) and v["trained"], key  # LoRA: adapters alone
    assert any(v["tokens"] % 2 for k, v in res[0].items() if k[1] != "values")  # an odd row was padded


def _update(rank, world, seed):
    """Two update calls of two mini-batches each: SP=2 on 2 ranks (one DP group, FSDP over
    both) == one process, with and without activation checkpointing (the all-to-alls run
    again in the recomputation), and with Dr.GRPO's loss (seq-mean-token-sum-norm counts
    rows, empty or not: the SP group's other rank, holding the same rows, counted them
    again and the loss was halved)."""
    batch = rl_batch(4, 2, 6, 7, seed=seed)
    mine = take_rows(batch, range(rank * 4, rank * 4 + 4))
    group = dist.group.WORLD

    def loss_for(model, sp, mode):
        def make(norm, tokens):
            def fn(mb):
                lp = forward_log_probs(model, mb, share_prompt=True, sp=sp)["log_probs"]
                loss = agg_loss(-lp * mb["advantages"], mb["response_mask"], mode, norm)
                return loss, {"loss": loss, "tokens": mb["response_mask"].sum() / tokens}
            return fn
        return make

    def run(group, data, sp, checkpointed=False, mode="token-mean"):
        model = tiny(heads=(3, 1), seed=2)
        if checkpointed:
            enable_activation_checkpointing(model)
        if group is not None:
            apply_fsdp(model, fsdp_mesh(group, "cpu"))
        state = TrainState(model, OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0), group=group)
        stats = [state.update(data, mini_batch_size=4, micro_batch_size=None, max_tokens=40, epochs=1,
                              shuffle=False, seed=0, loss_agg_mode=mode,
                              make_loss_fn=loss_for(model, sp, mode), share_prompt=True, sp=sp)
                 for _ in range(2)]
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}
        return params, stats

    sp = seq_parallel(group)
    out = {}
    for name, ckpt, mode in (("sp", False, "token-mean"), ("sp_ckpt", True, "token-mean"),
                             ("sp_drgrpo", False, "seq-mean-token-sum-norm")):
        one, one_stats = run(None, batch, None, mode=mode)
        params, stats = run(group, mine, sp, ckpt, mode)
        out[name] = {"param": max((params[n] - one[n]).abs().max().item() for n in one),
                     "stats": [(x["loss"], y["loss"], x["tokens"], y["tokens"], x["grad_norm"], y["grad_norm"])
                               for x, y in zip(stats, one_stats)]}
    init = tiny(heads=(3, 1), seed=2)
    out["moved"] = max((one[n] - p).abs().max().item() for n, p in init.named_parameters())
    return out


def test_sp_update_matches_one_process_and_dp():
    for r in spawn_ranks(_update, 2, 4):
        assert r["moved"] > 1e-3
        for name in ("sp", "sp_ckpt", "sp_drgrpo"):
            # test_fsdp's bound for the same kind of comparison (sharded vs one process): Adam's
            # step m/sqrt(v) ignores a gradient's scale, so a relative gradient error d moves a
            # weight by ~lr d per step (4 steps x 1e-3 x 1e-5: 4e-8), more where a gradient is
            # small against its rounding (Adam would step one that is rounding noise alone by up
            # to lr; none is in this model): 1e-5 is ~80 ulp of |w| <= 1 (measured 2.5e-6 on one
            # AMD EPYC, not the source of the bound)
            assert r[name]["param"] < 1e-5, (name, r[name])
            for loss, loss1, tok, tok1, gn, gn1 in r[name]["stats"]:
                # the statistics count each row once (the SP group's leader), fp32 sums: rel 1e-5
                assert loss == pytest.approx(loss1, rel=1e-5) and gn == pytest.approx(gn1, rel=1e-5)
                assert tok == pytest.approx(1.0, rel=1e-6) and tok1 == pytest.approx(1.0, rel=1e-6)


SP_KEYS = {"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2, "critic.ulysses_sequence_parallel_size": 2}
ONE_MINI = {"actor_rollout_ref.actor.ppo_mini_batch_size": 8, "critic.ppo_mini_batch_size": 8,
            "data.max_response_length": 16, "trainer.total_training_steps": 2, "trainer.test_freq": 1,
            "actor_rollout_ref.actor.max_tokens_per_micro_batch": 48,
            "actor_rollout_ref.rollout.check_log_probs": "error"}


def _counted_runs(rank, world, *args):
    """``tests.test_ppo._runs``, counting the attention layers' all-to-alls per case."""
    from test_ppo import _runs

    counts, to_heads = {}, SeqParallel.to_heads

    def counting(self, *a):
        counts[case] = counts.get(case, 0) + 1
        return to_heads(self, *a)
    SeqParallel.to_heads = counting
    out = {}
    for c in args[-1]:
        case = c[0]
        out.update(_runs(rank, world, *args[:-1], [c]))
    return out, counts


def test_ppo_job_with_sp_equals_dp(tiny_job, tmp_path):
    """PPO (actor, reference and critic) on 2 ranks: SP=2 (one DP group) against DP=2. One
    mini-batch a step, so both take the same gradient; step 1's rollout is the same (the same
    weights), so its figures agree to rounding; the old log-probs pass the engine check."""
    model, data = tiny_job
    cases = [("dp", "ppo", None, "dp", ONE_MINI), ("sp", "ppo", None, "sp", {**ONE_MINI, **SP_KEYS})]
    res, counts = spawn_ranks(_counted_runs, 2, model, data, str(tmp_path), cases, timeout_s=600)[0]
    assert "dp" not in counts and counts["sp"] > 0, counts  # SP ran in the one and only there
    dp, sp = ([h for h in res[k] if h["step"] == 1][0] for k in ("dp", "sp"))
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/vf_loss",
              "critic/grad_norm", "critic/values/mean", "critic/score/mean", "response_length/mean"):
        if k in dp:
            # the same sums in another order over 2 epochs of AdamW: rel 1e-4 as test_ppo's
            # balanced-vs-unbalanced comparison
            assert sp[k] == pytest.approx(dp[k], rel=1e-4, abs=1e-6), k
    assert "critic/vf_loss" in sp and [h["step"] for h in res["sp"]] == [0, 1, 2]


@pytest.mark.slow
def test_sp_resume_equals_uninterrupted(tiny_job, tmp_path):
    """SP=2 runs stopped after step 2 and resumed end where the uninterrupted run ends, bitwise."""
    from test_ppo import _runs, final_params

    model, data = tiny_job
    extra = {**ONE_MINI, **SP_KEYS, "trainer.total_training_steps": 4, "trainer.save_freq": 2}
    cases = [("full", "ppo", None, "full", extra), ("first", "ppo", 2, "resumed", extra),
             ("rest", "ppo", None, "resumed", extra)]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=900)[0]

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    assert [strip(h) for h in res["full"]] == [strip(h) for h in res["first"] + res["rest"]]
    a, b = final_params(tmp_path / "full", 4), final_params(tmp_path / "resumed", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_sp_settings_fail_in_one_line(tiny_job, tmp_path):
    from minihf.config import ConfigError
    from minihf.trainer.ppo_job import check_sequence_parallel
    from test_ppo import job_config

    model, data = tiny_job
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=0 must be an int >= 1"):
        job_config(model, data, str(tmp_path), "grpo", **{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 0})
    cfg = job_config(model, data, str(tmp_path), "ppo", **SP_KEYS)
    check_sequence_parallel(cfg, 2)  # fits
    with pytest.raises(ConfigError, match=r"actor\.ulysses_sequence_parallel_size=2 does not divide the "
                                          r"actor's 3 ranks; use one of \[1, 3\]"):
        check_sequence_parallel(cfg, 3)
    cfg = job_config(model, data, str(tmp_path), "ppo", **{"critic.ulysses_sequence_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"critic\.ulysses_sequence_parallel_size=3 does not divide"):
        check_sequence_parallel(cfg, 2)
    from minihf.models import load_args
    heads = load_args(model).num_attention_heads
    big = heads * 2
    cfg = job_config(model, data, str(tmp_path), "grpo",
                     **{"actor_rollout_ref.ref.ulysses_sequence_parallel_size": big})
    with pytest.raises(ConfigError, match=rf"ref\.ulysses_sequence_parallel_size={big} exceeds the model's "
                                          rf"{heads} attention heads.*use at most {heads}"):
        check_sequence_parallel(cfg, big)
    cfg = job_config(model, data, str(tmp_path), "grpo", **{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
                                                          "actor_rollout_ref.model.use_remove_padding": False})
    with pytest.raises(ConfigError, match="use_remove_padding=true"):
        check_sequence_parallel(cfg, 2)
