"""Sampler: parameter validation, seeds, the log-prob convention and the sampled
distributions (temperature, top-k, top-p) checked statistically on a small vocabulary."""

import math
import re

import pytest
import torch

from minihf.rollout.sampling import RowParams, argmax_rows, SamplingParams, sample, sequence_key, uniforms

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0])  # V = 6
N = 20000


def draw(sp: SamplingParams, n=N, logits=LOGITS):
    rows = RowParams.build([sp] * n, [sequence_key(i, 0) for i in range(n)], "cpu")
    tok, logp = sample(logits.expand(n, -1), rows, torch.zeros(n, dtype=torch.int64))
    return tok, logp


def expected(sp: SamplingParams, logits=LOGITS):
    p = torch.softmax(logits.double() / sp.temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    k = sp.top_k if sp.top_k > 0 else len(p)
    kept = order[:k]
    mass = p[kept] / p[kept].sum()
    acc = 0.0
    for idx, m in zip(kept.tolist(), mass.tolist()):
        if acc >= sp.top_p:
            break
        keep[idx] = True
        acc += m
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.5, top_k=4, top_p=0.8),
], ids=["t1", "t0.5", "t2", "topk3", "topp0.7", "t1.5-k4-p0.8"])
def test_distribution_chi_square(sp):
    tok, _ = draw(sp)
    counts = torch.bincount(tok, minlength=6).double()
    exp = expected(sp) * N
    assert (counts[exp == 0] == 0).all(), f"drew a truncated token: {counts.tolist()} vs {exp.tolist()}"
    chi2 = (((counts - exp) ** 2)[exp > 0] / exp[exp > 0]).sum().item()
    # dof <= 5; P(chi2 > 35) < 2e-6, while a wrong temperature/top-k/top-p gives chi2 in the hundreds
    assert chi2 < 35, f"chi2={chi2:.1f}: counts {counts.tolist()} expected {exp.tolist()}"


def test_wrong_distribution_is_detected():
    tok, _ = draw(SamplingParams(temperature=1.0))
    counts = torch.bincount(tok, minlength=6).double()
    exp = expected(SamplingParams(temperature=1.2)) * N
    assert (((counts - exp) ** 2) / exp).sum().item() > 35  # the test above can fail


def test_logprob_is_full_temperature_scaled_distribution():
    sp = SamplingParams(temperature=0.7, top_k=2)
    tok, logp = draw(sp, n=50)
    ref = torch.log_softmax(LOGITS / 0.7, -1)[tok]
    # both: log_softmax of the same 6 logits, |x| < 5 (ulp 4.8e-7); default atol 1e-5 is 20+ ulp
    torch.testing.assert_close(logp, ref)
    g_tok, g_logp = draw(SamplingParams(temperature=0), n=3)
    assert g_tok.tolist() == [0, 0, 0]
    torch.testing.assert_close(g_logp, torch.log_softmax(LOGITS, -1)[[0, 0, 0]])


def test_truncated_sampling_reports_the_untruncated_log_prob_by_hand():
    """Top-k / top-p restrict which tokens are drawn; the log-prob reported is the full
    softmax's, as the trainer computes it (docs/hybrid-engine.md). Logits [2, 1, 0], T = 1,
    top-k 1: token 0 is certain under the truncated sampler (log-prob 0), and its log-prob
    under the full softmax is 2 - log(e^2 + e + 1) = -0.40760596."""
    from minihf.algorithms import logprobs_from_logits

    logits = torch.tensor([2.0, 1.0, 0.0])
    want = 2 - math.log(math.e ** 2 + math.e + 1)
    for sp in (SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams(top_k=2, top_p=0.6)):
        tok, logp = draw(sp, n=20, logits=logits)
        assert tok.tolist() == [0] * 20, sp                       # only token 0 survives the filter
        assert logp.tolist() == pytest.approx([want] * 20, abs=1e-6), sp  # fp32 of a value ~0.4
    trainer = logprobs_from_logits(logits[None], torch.tensor([0]))
    assert trainer.item() == pytest.approx(want, abs=1e-6)


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    sps = [SamplingParams(temperature=1.0, seed=s, top_p=0.9) for s in range(8)]
    keys = [sequence_key(s, 0) for s in range(8)]
    steps = torch.arange(8)
    full, _ = sample(logits, RowParams.build(sps, keys, "cpu"), steps)
    perm = [5, 2, 7]
    sub, _ = sample(logits[perm], RowParams.build([sps[i] for i in perm], [keys[i] for i in perm], "cpu"), steps[perm])
    assert sub.tolist() == full[perm].tolist()
    other, _ = sample(logits, RowParams.build(sps, [sequence_key(s + 100, 0) for s in range(8)], "cpu"), steps)
    assert other.tolist() != full.tolist()


def test_a_row_draws_the_same_token_whatever_its_batch_mates_truncate():
    """The same seed gives the same token beside rows that use top-k / top-p as beside rows
    that do not: the draw is made in vocabulary order in both cases (it was made in sorted
    order as soon as any row truncated, so a plain row's token changed with its batch-mates)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 500)
    plain = SamplingParams(temperature=1.0, seed=1)
    keys = [sequence_key(i, 0) for i in range(64)]
    steps = torch.arange(64)
    alone, alone_logp = sample(logits, RowParams.build([plain] * 64, keys, "cpu"), steps)
    for mate in (SamplingParams(top_k=10), SamplingParams(top_p=0.5), SamplingParams(top_k=500, top_p=0.9)):
        mixed = [plain if i % 2 else mate for i in range(64)]
        tok, logp = sample(logits, RowParams.build(mixed, keys, "cpu"), steps)
        assert tok[1::2].tolist() == alone[1::2].tolist(), mate
        assert torch.equal(logp[1::2], alone_logp[1::2])
        kept = logits[0::2].argsort(-1, descending=True)[:, :10]  # top-k 10 draws among the 10 largest
        if mate.top_k == 10:
            assert all(t in row for t, row in zip(tok[0::2].tolist(), kept.tolist()))


def test_uniforms_look_uniform():
    u = uniforms(torch.full((1,), sequence_key(7, 0)), torch.arange(50000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert ((hist - 5000).abs() < 5 * math.sqrt(5000)).all()


@pytest.mark.parametrize("kw,match", [
    (dict(n=0), "n must"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
])
def test_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_argmax_rows_equals_argmax_with_ties():
    torch.manual_seed(0)
    x = torch.randn(16, 1024)
    x[3, 10] = x[3, 900] = 50.0  # tie across chunks: first index wins
    x[4, 130] = x[4, 129] = 50.0  # tie within a chunk
    x[5] = 0.0  # all equal
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    y = torch.randn(4, 1000)  # not a multiple of the chunk: plain argmax
    assert torch.equal(argmax_rows(y), y.argmax(-1))


def test_inverse_cdf_equals_the_one_level_search_and_skips_zero_probabilities():
    """The two-level search picks the token a float64 cumulative sum over the whole row
    picks (the first whose cumulative mass exceeds u * total), on a real vocabulary size
    and an odd one (padded), and never a token of probability 0 (truncated rows, and u at
    the top of [0, 1) where rounding between block and in-block sums matters most)."""
    from minihf.rollout.sampling import inverse_cdf

    g = torch.Generator().manual_seed(0)
    for V in (49152, 1000):
        probs = torch.softmax(torch.randn(64, V, generator=g) * 3, -1)
        probs[:32] *= torch.rand(32, V, generator=g) < 0.05      # sparse rows, as after top-k/p
        u = torch.rand(64, generator=g, dtype=torch.float64)
        u[:4] = 1 - 2.0 ** -53                                    # the largest uniform
        cdf = probs.double().cumsum(-1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)[:, 0]
        got = inverse_cdf(probs, u)
        assert (probs.gather(1, got[:, None]) > 0).all()
        # equal except where the target is within float64 rounding of a boundary (none here)
        assert torch.equal(got[4:], ref[4:]), (got != ref).nonzero()
        last = torch.where(probs[:4] > 0, torch.arange(V), -1).amax(-1)  # u ~ 1: the last token with mass
        assert torch.equal(got[:4], last)
    nan = torch.full((2, 256), float("nan"))  # a diverged model: an id in range, never an error
    got = inverse_cdf(nan, torch.tensor([0.3, 0.9], dtype=torch.float64))
    assert ((got >= 0) & (got < 256)).all()


def check_temperature_division_is_exact(device: str) -> None:
    """The eager sampler (one temperature for the batch), the captured decode step (a
    per-row temperature tensor), the trainer's whole-logits path and its chunked LM head all
    give the correctly rounded quotient, bit for bit: computed in float64 and rounded to
    fp32, it is (53 >= 2 * 24 + 2 bits). The inputs tell a multiply by the reciprocal
    apart (what torch does on CUDA for a tensor over a Python float)."""
    from minihf.algorithms.chunked_logits import _logits
    from minihf.rollout.sampling import _scaled
    from minihf.workers.forward import scaled

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(8, 32, generator=g), torch.randn(4099, 32, generator=g)
    z = (hidden @ weight.T).to(device)
    for t in (0.7, 0.6, 1.3):
        t32 = torch.tensor(t, dtype=torch.float32)
        exact = (z.double() / t32.double()).float()
        assert not torch.equal(z * t32.reciprocal().to(device), exact)  # the inputs can tell
        same = RowParams.build([SamplingParams(temperature=t)] * 8, list(range(8)), device)
        mixed = RowParams.build([SamplingParams(temperature=t)] * 8, list(range(8)), device)
        mixed.uniform_temperature = None  # the decode step's rows: the per-row division
        assert torch.equal(_scaled(z, same), exact)
        assert torch.equal(_scaled(z, mixed), exact)
        assert torch.equal(scaled(z, t), exact)
        head = _logits(hidden.to(device), weight.to(device), t)
        assert torch.equal(head, (_logits(hidden.to(device), weight.to(device), 1.0).double() / t32.double()).float())


def test_every_path_divides_by_the_temperature_to_the_bit():
    check_temperature_division_is_exact("cpu")


def test_sampling_params_of_the_wrong_type_are_refused_by_name():
    """A string or None failed as a bare comparison TypeError; ``stop_token_ids=2`` as "'int'
    object is not iterable"; ``ignore_eos="no"`` was truthy, so EOS was ignored."""
    for kw, says in ((dict(top_p="0.5"), "top_p must be a number in (0, 1] (1 = off), got '0.5'"),
                     (dict(top_p=None), "top_p must be a number in (0, 1]"),
                     (dict(top_p=float("nan")), "top_p must be a number in (0, 1]"),
                     (dict(stop_token_ids=2), "stop_token_ids must be a list of token ids, got 2; write [2]"),
                     (dict(stop_token_ids=[True]), "stop_token_ids must be non-negative ints, got [True]"),
                     (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
                     (dict(seed=1.5), "seed must be an int or None, got 1.5")):
        with pytest.raises(ValueError, match=re.escape(says)):
            SamplingParams(**kw)
    ok = SamplingParams(top_p=1, stop_token_ids=(3, 4), seed=0, ignore_eos=True)
    assert ok.stop_token_ids == [3, 4] and ok.ignore_eos
    # numpy's numbers and vLLM's None for no stop ids, as before; kept as Python's
    import numpy as np

    ok = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_p=np.float64(0.9), stop_token_ids=None,
                        seed=np.int64(3), ignore_eos=np.bool_(False))
    assert (ok.n, ok.temperature, ok.top_p, ok.stop_token_ids, ok.seed, ok.ignore_eos) == (2, 0.5, 0.9, [], 3, False)
    assert type(ok.temperature) is float and type(ok.seed) is int and SamplingParams(ignore_eos=1).ignore_eos is True
