"""Log-probs and entropy from the LM head in chunks (``minihf.algorithms.chunked_logits``)
against the whole-logits path and a float64 reference, forward and backward, alone and
through ``forward_log_probs`` on a model (packed and padded).

Bounds: a log-prob in fp32 is within ``logprob_rounding_bound(logit_abs_scale)`` of the
exact one (``minihf.algorithms.logprob``: the forward's rounding, whatever the summation
order), so the chunked and whole paths are each within it of float64. The gradients' bound
follows from it (``_grad_bounds``) and must hold for both paths.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minihf.algorithms import entropy_from_logits, logit_abs_scale, logprob_rounding_bound, logprobs_from_logits
from minihf.algorithms.chunked_logits import chunked_log_probs

def _whole(h, w, y, t):
    """Today's path: whole logits in fp32 (``minihf.workers.forward``)."""
    z = (h @ w.T).float() / t
    return {"log_probs": logprobs_from_logits(z, y), "entropy": entropy_from_logits(z)}


def _exact(h, w, y, t):
    """The float64 reference."""
    z = (h.double() @ w.double().T) / t
    log_p = torch.log_softmax(z, -1)
    return {"log_probs": log_p.gather(-1, y[:, None]).squeeze(-1), "entropy": -(log_p.exp() * log_p).sum(-1)}


def _case(m=37, hidden=24, vocab=211, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, hidden, generator=g, dtype=dtype) * 2
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    y = torch.randint(0, vocab, (m,), generator=g)
    a, b = torch.randn(m, generator=g, dtype=dtype), torch.randn(m, generator=g, dtype=dtype)
    return h, w, y, a, b


def _grad_bounds(h, w, y, a, b, t):
    """How far fp32 gradients of ``sum(a * log p[y]) + sum(b * H)`` may sit from float64's,
    derived from the log-prob bound: a logit is off by at most ``eps = bound / 2`` (a log-prob
    moves by at most twice its logits' error), so ``p_v`` by ``2 eps p_v``, so the gradient
    at logit v (``a (onehot - p) - b p (log p + H)``) by ``2 eps p_v (|a| + |b| (|log p_v + H| + 2))``;
    through the head's matmuls that adds up over the vocabulary (``d hidden``) or the rows
    (``d W``), plus the matmuls' own rounding (length x u x the absolute-value product)."""
    h, w, a, b = h.double(), w.double(), a.double(), b.double()
    z = h @ w.T / t
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    ent = -(p * log_p).sum(-1, keepdim=True)
    eps = logprob_rounding_bound(logit_abs_scale(h, w, t)).double()[:, None] / 2
    dz = 2 * eps * p * (a.abs()[:, None] + b.abs()[:, None] * ((log_p + ent).abs() + 2))  # [M, V]
    g = a[:, None] * (-p) - b[:, None] * p * (log_p + ent)
    g.scatter_add_(-1, y[:, None], a[:, None])
    u = 2.0 ** -24
    bound_h = (dz @ w.abs() + w.shape[0] * u * (g.abs() @ w.abs())) / t
    bound_w = (dz.T @ h.abs() + h.shape[0] * u * (g.abs().T @ h.abs())) / t
    return bound_h, bound_w


def _grads(fn, h, w, y, a, b, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, y, t)
    ((out["log_probs"] * a).sum() + (out["entropy"] * b).sum()).backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_chunks_match_the_whole_logits_and_float64(chunk, t):
    h, w, y, a, b = _case()
    chunked = lambda h, w, y, t: chunked_log_probs(h, w, y, temperature=t, chunk=chunk, calc_entropy=True)
    out, gh, gw = _grads(chunked, h, w, y, a, b, t)
    ref, rh, rw = _grads(_whole, h, w, y, a, b, t)
    exact, eh, ew = _grads(_exact, h.double(), w.double(), y, a.double(), b.double(), t)
    bound = logprob_rounding_bound(logit_abs_scale(h, w, t))
    for key in ("log_probs", "entropy"):  # each within the rounding bound of float64
        assert ((out[key].double() - exact[key]).abs() <= bound).all(), key
        assert ((ref[key].double() - exact[key]).abs() <= bound).all(), key
    bh, bw = _grad_bounds(h, w, y, a, b, t)
    for mine, whole, true, bnd in ((gh, rh, eh, bh), (gw, rw, ew, bw)):
        assert ((whole.double() - true).abs() <= bnd).all()  # the bound holds for today's path
        assert ((mine.double() - true).abs() <= bnd).all(), ((mine.double() - true).abs() / bnd).max()


def test_gradcheck_in_float64():
    h, w, y, _, _ = _case(m=6, hidden=5, vocab=9, dtype=torch.float64)
    h.requires_grad_()
    w.requires_grad_()

    def f(h, w):
        out = chunked_log_probs(h, w, y, temperature=0.8, chunk=4, calc_entropy=True)
        return out["log_probs"], out["entropy"]
    assert torch.autograd.gradcheck(f, (h, w))


def test_entropy_as_a_metric_has_no_gradient_and_shapes_follow_the_labels():
    h, w, y, _, _ = _case(m=12)
    h = h.view(3, 4, -1).requires_grad_()
    out = chunked_log_probs(h, w, y.view(3, 4), chunk=5, calc_entropy=True, entropy_grad=False)
    assert out["log_probs"].shape == (3, 4) and not out["entropy"].requires_grad
    out["log_probs"].sum().backward()
    only_lp = h.grad.view(12, -1).clone()
    h.grad = None
    _exact(h.view(12, -1), w, y, 1.0)["log_probs"].sum().backward()  # float64, no entropy term
    exact = h.grad.view(12, -1).double()
    # within the derived bound of a log-prob-only loss (b = 0), plus exact's own rounding to fp32
    bound = _grad_bounds(h.detach().view(12, -1), w, y, torch.ones(12), torch.zeros(12), 1.0)[0]
    assert ((only_lp.double() - exact).abs() <= bound + 2.0 ** -24 * exact.abs()).all()
    assert "entropy" not in chunked_log_probs(h, w, y.view(3, 4))
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_log_probs(h, w, y.view(3, 4), chunk=0)


def test_nothing_vocabulary_sized_is_kept_for_the_backward():
    h, w, y, _, _ = _case(m=64, vocab=500)
    out = chunked_log_probs(h.requires_grad_(), w.requires_grad_(), y, chunk=8, calc_entropy=True)
    saved = out["log_probs"].grad_fn.saved_tensors
    assert max(x.numel() for x in saved if x is not w) < 64 * 500 / 4  # hidden states and per-row values


# -- through forward_log_probs on a model --------------------------------------------------

@pytest.fixture(scope="module")
def model_and_batch():
    from minihf.models import CausalLM, ModelArgs, init_weights

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                     initializer_range=0.2)
    model = init_weights(CausalLM(args))
    b, p, r = 4, 6, 9
    ids = torch.randint(3, 97, (b, p + r))
    mask = torch.ones(b, p + r, dtype=torch.long)
    mask[0, :2] = 0                      # left-padded prompt
    mask[1, p + 5:] = 0                  # a short response
    mask[2, p:] = 0                      # an empty one
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    mb = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, p:]}
    return model, mb


@pytest.mark.parametrize("packed", [True, False])
def test_forward_log_probs_in_chunks_matches(model_and_batch, packed):
    """In float64, so that the bound holds on any CPU: both paths compute the same sums in
    another order, each within ``logprob_rounding_bound(scale, float64)`` of the exact
    log-prob; the parameters' gradients are sums over at most a few hundred terms of this
    model, so rounding moves them by far less than 1e-10 relative (u = 1.1e-16)."""
    import copy

    from minihf.workers.forward import forward_log_probs

    model, mb = model_and_batch
    model = copy.deepcopy(model).double()
    kw = dict(use_remove_padding=packed, temperature=0.7, calc_entropy=True, calc_logit_scale=True)
    runs = {}
    for name, chunk in (("whole", None), ("chunked", 4)):
        model.zero_grad()
        out = forward_log_probs(model, mb, logits_chunk=chunk, **kw)
        (out["log_probs"].sum() + 0.1 * out["entropy"].sum()).backward()
        runs[name] = out, {n: p.grad.clone() for n, p in model.named_parameters()}
    (whole, gw), (chunked, gc) = runs["whole"], runs["chunked"]
    assert whole["log_probs"].dtype == torch.float64
    # the same hidden states through the same function: the scale is bitwise the same
    assert torch.equal(chunked["logit_scale"], whole["logit_scale"])
    bound = logprob_rounding_bound(whole["logit_scale"], torch.float64)
    for key in ("log_probs", "entropy"):  # each within the bound of the exact value
        assert ((chunked[key] - whole[key]).abs() <= 2 * bound).all(), key
    for name in gw:
        torch.testing.assert_close(gc[name], gw[name], rtol=1e-10, atol=1e-10 * gw[name].abs().max().item())


def test_the_planner_counts_one_chunk_of_logits():
    from dataclasses import replace

    from minihf.planner.cost import micro_batch_bytes
    from minihf.planner.job import ModelShape, Role, Workload

    shape = ModelShape(params=135_000_000, layers=30, hidden=576, kv_dim=192, heads=9, kv_heads=3,
                       vocab=49152, ffn=1536, largest_block=3_500_000, shapes=(), tied=True)
    actor = Role("actor", shape, True, mini_batch=64)
    w = Workload(8, 8, 64, 4096, True, False, False, (actor,))
    whole = micro_batch_bytes(actor, 1, w, 4, train=True)
    chunked = micro_batch_bytes(replace(actor, logits_chunk=1024), 1, w, 4, train=True)
    tokens = 64 + 4096
    # the logits' share, and only it: whole, the logits, their log-softmax and gradient (3 fp32
    # buffers); in chunks, one chunk's logits and exponentials (2; the backward holds 1)
    assert whole - chunked == tokens * 49152 * 12 - 1024 * 49152 * 8
    one_chunk = micro_batch_bytes(replace(actor, logits_chunk=10**6), 1, w, 4, train=True)
    assert whole - one_chunk == tokens * 49152 * 4  # a chunk as long as the response: 2 buffers


def test_config_names_a_bad_chunk():
    from minihf.workers.config import ActorConfig, RefConfig

    assert ActorConfig(logits_chunk_size=1024).logits_chunk_size == 1024
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match=r"actor.logits_chunk_size=.* must be an int >= 1"):
            ActorConfig(logits_chunk_size=bad)
    with pytest.raises(ValueError, match=r"ref.logits_chunk_size=0"):
        RefConfig(logits_chunk_size=0)


def test_a_grpo_step_in_chunks_is_the_same_step(tmp_path, monkeypatch):
    """The actor's update, its old log-probs (checked against the engine's: check_log_probs
    error) and the reference's, all in chunks of 3 tokens: the first step's metrics are the
    unchunked run's to rounding (same samples: the rollout does not change)."""
    import minihf

    from test_install import TINY

    monkeypatch.chdir(tmp_path)
    common = TINY + ["trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.check_log_probs=error",
                     "actor_rollout_ref.actor.recompute_log_prob=true"]
    whole = minihf.train("grpo", common + ["trainer.default_local_dir=outputs/whole"]).history[-1]
    chunk = ["actor_rollout_ref.actor.logits_chunk_size=3", "actor_rollout_ref.ref.logits_chunk_size=3"]
    chunked = minihf.train("grpo", common + chunk + ["trainer.default_local_dir=outputs/chunked"]).history[-1]
    assert chunked["response_length/mean"] == whole["response_length/mean"]
    # a wiring check, with a tolerance far from both sides: a wrong position, label or role
    # moves these metrics by O(0.1); rounding moves each log-prob by at most 2 x 256 u S
    # (logprob_rounding_bound), S = sum |h| |W| ~ 1 for this tiny model (64 hidden units,
    # weights of std ~0.02), so ~3e-5, and these metrics (means of log-prob differences,
    # ratios near 1, the gradient's norm) by the same order relative to their size
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert key in whole, sorted(whole)
        assert chunked[key] == pytest.approx(whole[key], rel=1e-3, abs=1e-4), key


# -- log-probs at chosen ids (an auxiliary loss's) and the top k (a teacher's) ---------------

def _at(h, w, y, t, ids, chunk):
    if chunk is None:  # the whole-logits path, as forward_log_probs runs it
        z = (h @ w.T).to(torch.promote_types(h.dtype, torch.float32)) / t
        return {"log_probs": logprobs_from_logits(z, y),
                "log_probs_at": z.gather(-1, ids) - torch.logsumexp(z, -1, keepdim=True)}
    return chunked_log_probs(h, w, y, temperature=t, chunk=chunk, ids=ids)


@pytest.mark.parametrize("chunk", [None, 1, 5, 1000])
def test_log_probs_at_ids_match_float64_forward_and_backward(chunk):
    h, w, y, a, _ = _case()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, w.shape[0], (h.shape[0], 3), generator=g)
    ids[:, 0] = y                                         # an id may repeat the label
    c = torch.randn(h.shape[0], 3, generator=g)
    out = _at(h, w, y, 0.7, ids, chunk)
    exact = torch.log_softmax(h.double() @ w.double().T / 0.7, -1)
    bound = logprob_rounding_bound(logit_abs_scale(h, w, 0.7))[:, None]
    assert ((out["log_probs_at"].double() - exact.gather(-1, ids)).abs() <= bound).all()
    assert torch.equal(out["log_probs_at"][:, 0], out["log_probs"])  # the label's, computed alike
    # gradients: float64 through this path against autograd through float64's whole logits
    # (the same sums in another order: a few hundred terms, rounding far below 1e-10)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    mine = _at(hd, wd, y, 0.7, ids, chunk)
    ((mine["log_probs"] * a.double()).sum() + (mine["log_probs_at"] * c.double()).sum()).backward()
    z = torch.log_softmax(h.double() @ w.double().T / 0.7, -1)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    z = torch.log_softmax(hr @ wr.T / 0.7, -1)
    ((z.gather(-1, y[:, None]).squeeze(-1) * a.double()).sum() + (z.gather(-1, ids) * c.double()).sum()).backward()
    torch.testing.assert_close(hd.grad, hr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wd.grad, wr.grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_ids_in_float64():
    h, w, y, _, _ = _case(m=6, hidden=5, vocab=9, dtype=torch.float64)
    ids = torch.tensor([[0, 3], [8, 8], [1, 2], [4, 0], [5, 6], [7, 1]])

    def f(h, w):
        out = chunked_log_probs(h, w, y, temperature=0.8, chunk=4, calc_entropy=True, ids=ids)
        return out["log_probs"], out["log_probs_at"], out["entropy"]
    assert torch.autograd.gradcheck(f, (h.requires_grad_(), w.requires_grad_()))


def test_top_k_is_the_most_likely_ids_without_gradient():
    h, w, y, _, _ = _case(dtype=torch.float64)  # float64: no near-tie can flip the order
    out = chunked_log_probs(h.requires_grad_(), w, y, chunk=5, top_k=4)
    exact = torch.log_softmax(h.detach() @ w.T, -1).topk(4, dim=-1)
    assert torch.equal(out["top_k_ids"], exact.indices) and not out["top_k_log_probs"].requires_grad
    # float64 both, the sums in another order: logits |z| <~ 2 x sqrt(24) x 4 = 40 summed over 24
    # terms, a logsumexp over 211: worst case <~ (24 + 211) x 1.1e-16 x 40 = 1e-12 per value; 1e-11
    torch.testing.assert_close(out["top_k_log_probs"], exact.values, rtol=0, atol=1e-11)
    with pytest.raises(ValueError, match="top_k=300: use 1 to the vocabulary size 211"):
        chunked_log_probs(h, w, y, top_k=300)


@pytest.mark.parametrize("packed", [True, False])
def test_forward_log_probs_at_ids_and_top_k(model_and_batch, packed):
    """float64, as above: the chunked and whole paths agree within twice the float64 bound,
    a position's log-probs at ids are its log-softmax there, padding stays zero."""
    import copy

    from minihf.workers.forward import forward_log_probs

    model, mb = model_and_batch
    model = copy.deepcopy(model).double()
    r = mb["responses"].shape[1]
    ids = torch.stack([mb["responses"], (mb["responses"] + 1) % 97], -1)        # [B, R, 2]
    runs = {}
    for chunk in (None, 4):
        model.zero_grad()
        out = forward_log_probs(model, mb, use_remove_padding=packed, temperature=0.7, logits_chunk=chunk,
                                ids=ids, top_k=3, calc_logit_scale=True)
        (out["log_probs_at"] * torch.linspace(-1, 1, 2, dtype=torch.float64)).sum().backward()
        runs[chunk] = out, {n: p.grad.clone() for n, p in model.named_parameters()}
    (whole, gw), (chunked, gc) = runs[None], runs[4]
    valid = mb["attention_mask"][:, -r:].bool()
    bound = logprob_rounding_bound(whole["logit_scale"], torch.float64)[..., None]
    assert whole["log_probs_at"].shape == (4, r, 2) and whole["top_k_ids"].shape == (4, r, 3)
    assert ((chunked["log_probs_at"] - whole["log_probs_at"]).abs() <= 2 * bound).all()
    assert ((whole["log_probs_at"][..., 0] - whole["log_probs"]).abs() <= 2 * bound[..., 0]).all()
    assert torch.equal(chunked["top_k_ids"], whole["top_k_ids"])
    assert ((chunked["top_k_log_probs"] - whole["top_k_log_probs"]).abs() <= 2 * bound).all()
    assert (whole["top_k_log_probs"][valid][:, 0] >= whole["log_probs"][valid] - 2 * bound[..., 0][valid]).all()
    for out in (whole, chunked):
        assert (out["log_probs_at"][~valid] == 0).all() and (out["top_k_ids"][~valid] == 0).all()
    for name in gw:
        torch.testing.assert_close(gc[name], gw[name], rtol=1e-10, atol=1e-10 * gw[name].abs().max().item())


_PEAKS = r"""
import sys
from pathlib import Path
import torch
from minihf.algorithms.chunked_logits import chunked_log_probs

def kb(key):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))

def peak(fn):  # resident bytes above the start (VmHWM reset to VmRSS first)
    base = kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    fn()
    return (kb("VmHWM") - base) * 1024

torch.set_num_threads(1)
c, m, h, v = 64, 256, 8, 1 << 18
hid = torch.randn(m, h, requires_grad=True)
w = torch.randn(v, h, requires_grad=True)
y = torch.randint(0, v, (m,))
out = {}
fwd = peak(lambda: out.update(chunked_log_probs(hid, w, y, chunk=c, calc_entropy=True, entropy_grad=False)))
bwd = peak(lambda: out["log_probs"].sum().backward())
print(fwd / (c * v * 4), bwd / (c * v * 4))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc memory counters")
def test_a_chunk_holds_two_vocabulary_buffers_forward_and_one_backward():
    """What a chunk costs, in ``[chunk, vocab]`` fp32 buffers (64 MiB each here, far above the
    rest): the forward with the entropy holds two (the logits and their exponentials), the
    backward without the entropy's gradient one, plus the head's weight gradient (1/8 of a
    buffer, accumulated in place). Before: three and two plus a weight-sized temporary, which
    made the chunk the peak of an SP rank's update (docs/training.md). Measured in a child
    process with glibc mapping each large block on its own, so resident memory is bytes in use."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _PEAKS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    fwd, bwd = map(float, out.stdout.split())
    assert 1.5 < fwd < 2.5, fwd
    assert 0.9 < bwd < 1.5 + 2 / 8, bwd  # the weight gradient, and its copy into w.grad at most
