"""FSDP2 on 2 gloo ranks vs a single-process reference on the same global batch, and the
micro-batch / rank invariance of a mini-batch update (exact loss normalisation)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from minihf.algorithms import agg_loss
from minihf.models import ModelArgs, build_model, init_weights
from minihf.parallel.fsdp import apply_fsdp, default_mixed_precision, fsdp_mesh
from minihf.parallel.placement import fsdp_dim as shard_dim
from minihf.workers.optim import OptimConfig, build_lr_scheduler, build_optimizer
from minihf.testing import spawn_ranks
from minihf.workers.forward import forward_log_probs
from minihf.workers.train_step import global_normalizer, take_rows, train_minibatch

ARGS = dict(arch="qwen2", vocab_size=48, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            attention_bias=True, max_position_embeddings=64)


def tiny_model(seed=0, tie=False, **overrides):
    args = ModelArgs(**{**ARGS, **overrides}, tie_word_embeddings=tie)
    return init_weights(build_model(args, "lm"), seed=seed)


def make_batch(b, p, r, vocab=48, seed=0):
    """Left-padded prompts of random length + right-padded responses of random length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, p + r), generator=g)
    plen = torch.randint(1, p + 1, (b,), generator=g)
    rlen = torch.randint(1, r + 1, (b,), generator=g)
    col = torch.arange(p + r)
    mask = ((col >= p - plen[:, None]) & (col < p + rlen[:, None])).long()
    ids = ids * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp_mask = mask[:, p:]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
            "responses": ids[:, p:], "response_mask": resp_mask,
            "advantages": torch.randn(b, r, generator=g) * resp_mask}


def nll_loss_fn(model, mode, norm, chunk=None):
    """A loss of the actor's shape: aggregated -log p over response tokens (the LM head in
    chunks of ``chunk`` tokens when set)."""
    def fn(mb):
        lp = forward_log_probs(model, mb, use_remove_padding=True, logits_chunk=chunk)["log_probs"]
        loss = agg_loss(-lp * mb["advantages"].abs(), mb["response_mask"], mode, norm)
        return loss, {"loss": loss}
    return fn


def run_update(model, batch, plans, mode, group, steps=2, lr=1e-3, naive=False, chunk=None):
    """``steps`` optimizer steps on ``batch`` cut into micro-batches by ``plans``.

    ``naive``: the common mistake (mean per micro-batch, divided by the micro-batch count)
    that the exact normalisation replaces; the tests check it does differ."""
    opt = build_optimizer(model.parameters(), OptimConfig(lr=lr, weight_decay=0.1, clip_grad=1.0))
    sched = build_lr_scheduler(opt, OptimConfig(lr=lr, warmup_steps=1))
    out = []
    for _ in range(steps):
        norm = global_normalizer(batch["response_mask"], mode, group)
        mbs = [take_rows(batch, rows) for rows in plans]
        fn = nll_loss_fn(model, mode, norm, chunk)
        if naive:
            def fn(mb, inner=nll_loss_fn(model, mode, None)):
                loss, stats = inner(mb)
                return loss / len(plans), stats
        out.append(train_minibatch(model, opt, sched, mbs, fn, clip_grad=1.0, group=group))
    return out


def full_params(model):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _fsdp_vs_reference(rank, world):
    torch.manual_seed(0)
    ref = tiny_model()
    model = copy.deepcopy(ref)
    group = dist.group.WORLD
    apply_fsdp(model, fsdp_mesh(group, "cpu"))
    placements = {n: p.placements[0] for n, p in model.named_parameters()}
    batch = make_batch(4, 6, 5)
    local = take_rows(batch, range(rank * 2, rank * 2 + 2))
    mode = "token-mean"

    # gradients of one backward, sharded vs full
    norm = global_normalizer(local["response_mask"], mode, group)
    loss, _ = nll_loss_fn(model, mode, norm)(local)
    (loss * world).backward()
    ref_loss, _ = nll_loss_fn(ref, mode, None)(batch)
    ref_loss.backward()
    grad_err = max((p.grad.full_tensor() - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), ref.parameters()))
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    # several optimizer steps (AdamW, warmup, clipping), params compared after each
    # lr 1e-3: Adam divides by sqrt(v), so parameters with tiny gradients amplify fp32
    # rounding differences in proportion to lr
    stats = run_update(model, local, [[0, 1]], mode, group, steps=3, lr=1e-3)
    ref_stats = run_update(ref, batch, [[0, 1, 2, 3]], mode, None, steps=3, lr=1e-3)
    p_full, p_ref = full_params(model), full_params(ref)
    param_err = max((p_full[n] - p_ref[n]).abs().max().item() for n in p_ref)
    moved = max((p_ref[n] - q).abs().max().item() for n, q in full_params(tiny_model()).items())

    # activation checkpointing, CPU offload and one FSDP unit for the whole model change
    # memory and collectives, not results (tied embeddings)
    variants, units = {}, {}
    for name, kw in (("plain", {}), ("ckpt", dict(activation_checkpointing=True)),
                     ("offload", dict(cpu_offload=True)), ("root", dict(wrap_blocks=False))):
        m = apply_fsdp(tiny_model(tie=True), fsdp_mesh(group, "cpu"), **kw)
        run_update(m, local, [[0], [1]], mode, group, steps=2)
        variants[name] = full_params(m)
        units[name] = sum(isinstance(x, FSDPModule) for x in m.modules())
    ckpt_err, offload_err, root_err = (
        max((variants["plain"][n] - variants[v][n]).abs().max().item() for n in variants["plain"])
        for v in ("ckpt", "offload", "root"))
    # the LM head in chunks of 2 tokens, inside the sharded model's forward (its weight
    # gathered there, its gradient reduce-scattered after): the same update to rounding
    m = apply_fsdp(tiny_model(tie=True), fsdp_mesh(group, "cpu"))
    run_update(m, local, [[0], [1]], mode, group, steps=2, chunk=2)
    chunked = full_params(m)
    chunk_err = max((variants["plain"][n] - chunked[n]).abs().max().item() for n in chunked)

    # sizes that do not divide by 2: uneven dim-0 shards; down_proj falls back to dim 0
    odd_ref = tiny_model(intermediate_size=63, vocab_size=49)
    odd = apply_fsdp(copy.deepcopy(odd_ref), fsdp_mesh(group, "cpu"))
    odd_place = odd.model.layers[0].mlp.down_proj.weight.placements[0]
    run_update(odd, local, [[0, 1]], mode, group, steps=2)
    run_update(odd_ref, batch, [[0, 1, 2, 3]], mode, None, steps=2)
    a, b = full_params(odd), full_params(odd_ref)
    odd_err = max((a[n] - b[n]).abs().max().item() for n in a)
    return {"placements": placements, "grad_err": grad_err, "param_err": param_err,
            "moved": moved, "stats": stats, "ref_stats": ref_stats,
            "ckpt_err": ckpt_err, "offload_err": offload_err, "root_err": root_err, "chunk_err": chunk_err,
            "units": units, "odd": (odd_place, odd_err)}


def _invariance(rank, world):
    """1 rank x 4 micro-batches == 2 ranks x 2 micro-batches == 1 rank x 1 (per mode)."""
    out = {}
    batch = make_batch(8, 6, 5, seed=1)
    group = dist.group.WORLD
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        four = [[0], [1, 2, 3], [4, 5], [6, 7]]  # unequal sizes: naive means would differ
        one_by_one = tiny_model(seed=3)
        s1 = run_update(one_by_one, batch, [list(range(8))], mode, None)
        one_by_four = tiny_model(seed=3)
        s4 = run_update(one_by_four, batch, four, mode, None)
        two_by_two = apply_fsdp(tiny_model(seed=3), fsdp_mesh(group, "cpu"))
        local = take_rows(batch, range(rank * 4, rank * 4 + 4))
        s22 = run_update(two_by_two, local, [[0, 3], [1, 2]], mode, group)
        naive = tiny_model(seed=3)
        run_update(naive, batch, four, mode, None, naive=True)
        # Adam is blind to a global gradient scale, so the statistics are compared too
        for s in (s4, s22):
            for k in ("grad_norm", "loss"):
                # step 0, before any update: fp32 sums in another order; 1e-5 is ~80 ulp
                assert abs(s[0][k] - s1[0][k]) <= 1e-5 * abs(s1[0][k]), (mode, k, s[0][k], s1[0][k])
        a, b, c = full_params(one_by_one), full_params(one_by_four), full_params(two_by_two)
        init, d = full_params(tiny_model(seed=3)), full_params(naive)
        out[mode] = tuple(max((a[n] - x[n]).abs().max().item() for n in a)
                          for x in (b, c, init, d))
    return out


def test_shard_dim_rule():
    assert shard_dim("model.layers.0.self_attn.o_proj.weight", (32, 32), 2) == 1
    assert shard_dim("model.layers.0.mlp.down_proj.weight", (32, 64), 2) == 1
    assert shard_dim("model.layers.0.mlp.down_proj.weight", (32, 63), 2) == 0  # uneven: dim 0
    assert shard_dim("model.layers.0.self_attn.q_proj.weight", (32, 32), 2) == 0
    assert shard_dim("lm_head.weight", (48, 32), 2) == 0
    # the precision policy apply_fsdp picks by device (the CUDA branch cannot run here)
    assert default_mixed_precision("cuda") == (torch.bfloat16, torch.float32)
    assert default_mixed_precision("cpu") == (None, None)


def test_fsdp_two_ranks_match_single_process_reference():
    res = spawn_ranks(_fsdp_vs_reference, 2)
    for r in res:
        pl = r["placements"]
        assert pl["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
        assert pl["model.layers.1.mlp.down_proj.weight"] == Shard(1)
        assert pl["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
        assert pl["model.layers.0.mlp.gate_proj.weight"] == Shard(0)
        assert pl["lm_head.weight"] == Shard(0)
        # one backward, sharded sums in another order: |grad| < 0.5 (ulp 3e-8), so 1e-6 is ~30 ulp
        assert r["grad_err"] < 1e-6, r["grad_err"]
        assert r["moved"] > 1e-3  # the updates did something
        # AdamW steps: a few ulp of |w| <= 1 (1.2e-7), unless a gradient were rounding noise alone
        # (Adam would step it by up to lr = 1e-3; none is in this model): 1e-5 is ~80 ulp
        assert r["param_err"] < 1e-5, r["param_err"]
        assert r["odd"][0] == Shard(0) and r["odd"][1] < 1e-5, r["odd"]
        # recompute, CPU offload and one unit repeat the same ops in the same order (2-rank sums
        # commute): bitwise expected, 1e-6 is slack
        assert r["ckpt_err"] < 1e-6 and r["offload_err"] < 1e-6, (r["ckpt_err"], r["offload_err"])
        assert r["root_err"] < 1e-6, r["root_err"]
        # chunked LM head: the logits' matmuls over fewer rows round differently; AdamW steps
        # of a few ulp, as the sharded-vs-reference comparison above: 1e-5
        assert r["chunk_err"] < 1e-5, r["chunk_err"]
        assert r["units"]["plain"] == 3 and r["units"]["root"] == 1, r["units"]  # 2 blocks + root
        for s, s_ref in zip(r["stats"], r["ref_stats"]):
            # fp32 sums in another order: a few ulp (1.2e-7 relative); rel 1e-5 is ~80 ulp
            assert s["grad_norm"] == pytest.approx(s_ref["grad_norm"], rel=1e-5)
            assert s["loss"] == pytest.approx(s_ref["loss"], rel=1e-5)
            assert s["lr"] == s_ref["lr"]


def test_update_invariant_to_micro_batches_and_ranks():
    for r in spawn_ranks(_invariance, 2):
        for mode, (micro_err, rank_err, moved, naive_err) in r.items():
            assert moved > 1e-3, mode
            assert naive_err > 1e-4, (mode, naive_err)  # the check can fail
            # 2 AdamW steps: a few ulp of |w| <= 1, as in the test above; 1e-5 is ~80 ulp
            assert micro_err < 1e-5, (mode, micro_err)
            assert rank_err < 1e-5, (mode, rank_err)


def test_lr_schedule_by_hand():
    import math

    from minihf.workers.optim import lr_factor
    cos = OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine", total_training_steps=6,
                      min_lr_ratio=0.1)
    assert [lr_factor(s, cos) for s in range(2)] == [0.5, 1.0]
    # float64 cosines: approx's default rel=1e-6 absorbs their rounding (cos(pi/2) = 6e-17)
    assert lr_factor(4, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(6, cos) == pytest.approx(0.1) and lr_factor(60, cos) == pytest.approx(0.1)
    assert lr_factor(5, OptimConfig(warmup_steps=2)) == 1.0
    with pytest.raises(ValueError, match="total_training_steps"):
        build_lr_scheduler(build_optimizer(tiny_model().parameters(), OptimConfig()),
                           OptimConfig(lr_scheduler="cosine"))


def test_optimizer_is_fused_and_matches_torch_reference_adamw():
    """build_optimizer's fused AdamW takes the steps torch's for-loop AdamW takes."""
    a, b = tiny_model(), tiny_model()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours = build_optimizer(a.parameters(), cfg)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert ours.param_groups[0]["fused"] is True
    for step in range(3):
        batch = make_batch(3, 4, 3, seed=step)
        for m, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            nll_loss_fn(m, "token-mean", None)(batch)[0].backward()
            opt.step()
    moved = max((p - q).abs().max().item() for p, q in zip(a.parameters(), tiny_model().parameters()))
    err = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert moved > 1e-2 and err < 1e-5, (moved, err)  # fp32 rounding, amplified by 1/sqrt(v)


def test_clip_grad_norm_matches_torch_single_process():
    from minihf.workers.optim import clip_grad_norm_
    a, b = tiny_model(), tiny_model()
    batch = make_batch(3, 4, 3)
    for m in (a, b):
        nll_loss_fn(m, "token-mean", None)(batch)[0].backward()
    ours = clip_grad_norm_(a.parameters(), 0.05)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    # the same per-tensor norms, combined by another 27-term sum: ~1-2 ulp; rel 1e-6 is ~8 ulp;
    # clip coefficients a few ulp apart give relative gradient differences ~1e-7 < rtol 1e-5
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6) and ours > 0.05
    assert all(torch.allclose(p.grad, q.grad, atol=1e-8) for p, q in zip(a.parameters(), b.parameters()))


def _meta_build(rank, world, root):
    """The workers' build (meta -> FSDP -> this rank's rows) vs loading the whole
    checkpoint and sharding it, for tied/untied LMs with an odd vocabulary and a critic
    whose head is drawn fresh from an LM checkpoint; counts the elements each rank reads."""
    from minihf.models import CheckpointReader, load_hf
    from minihf.workers.config import FSDPConfig, ModelConfig
    from minihf.workers.engine import build_fsdp_model

    out = {}
    read = []
    original = CheckpointReader.read

    def counting(self, name, dim=None, start=0, end=None):
        t = original(self, name, dim, start, end)
        read.append(t.numel())
        return t
    CheckpointReader.read = counting
    try:
        for tie, head in ((False, "lm"), (True, "lm"), (True, "value")):
            path = f"{root}/tie{tie}"
            read.clear()
            ours = build_fsdp_model(ModelConfig(path=path), FSDPConfig(), head=head,
                                    group=dist.group.WORLD, device=torch.device("cpu"))
            elems = sum(read)
            full = apply_fsdp(load_hf(path, head=head), fsdp_mesh(dist.group.WORLD, "cpu"))
            pairs = list(zip(dict(ours.named_parameters()).items(), full.parameters()))
            same = all(torch.equal(a.to_local(), b.to_local()) for (_, a), b in pairs)
            tied = tie and head == "lm" and ours.lm_head.weight is ours.model.embed_tokens.weight
            total = sum(p.numel() for p in full.parameters())
            x = torch.randint(0, 47, (3, 7))
            out[(tie, head)] = (same, torch.equal(ours(x), full(x)), tied, elems / total)
    finally:
        CheckpointReader.read = original
    return out


def test_meta_build_reads_only_this_ranks_rows(tmp_path):
    import warnings

    from minihf.models import save_hf
    for tie in (False, True):
        save_hf(tiny_model(tie=tie, vocab_size=47), tmp_path / f"tie{tie}")  # 47: uneven rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = spawn_ranks(_meta_build, 2, str(tmp_path))
    for r in res:
        for (tie, head), (same, same_out, tied, fraction) in r.items():
            assert same and same_out, (tie, head)
            assert tied == (tie and head == "lm")
            assert 0.45 < fraction < 0.56, (tie, head, fraction)  # about half, not all
