"""The loss functions against hand-computed values."""

import math

import pytest
import torch

from minihf.algorithms import (agg_loss, compute_policy_loss, compute_value_loss,
                               entropy_from_logits, kl_penalty, logprobs_from_logits,
                               loss_normalizer)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
KL3 = 2e-6  # fp32 k3 = e^-d - 1 + d at |d| = 0.5, worst case (see the KL test)


def test_agg_loss_modes_by_hand():
    # integer sums are exact in fp32, then one or two divisions: <= 2 ulp, inside rel=1e-6 (8+ ulp)
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert loss_normalizer(MASK, "token-mean").item() == 3
    assert loss_normalizer(MASK, "seq-mean-token-mean").item() == 2  # empty row not counted
    # an explicit (global) normaliser replaces the local count
    assert agg_loss(LOSS, MASK, "token-mean", normalizer=7.0).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, torch.zeros_like(MASK), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode='bad'.*token-mean"):
        agg_loss(LOSS, MASK, "bad")


def test_policy_loss_clip_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, clipfrac, ppo_kl, lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped)
    # token 2: max(-2.2, -2.2) = -2.2 (not clipped)
    # abs=1e-6: ratios via fp32 log/exp (~2 ulp), 3-term means of |x| <= 2.2: ~2e-7 at worst;
    # clipfrac is a count / 3 (one rounding), inside approx's default rel=1e-6
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3)
    assert ppo_kl.item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, abs=1e-6)
    assert lower.item() == 0.0
    # dual clip bounds the loss of a negative-advantage token with a huge ratio
    big = torch.log(torch.tensor([[10.0, 1.0, 1.0]]))
    adv2 = torch.tensor([[-1.0, 0.0, 0.0]])
    loss2, _, _, lower2 = compute_policy_loss(old, big, adv2, mask, cliprange=0.2, clip_ratio_c=3.0)
    # the dual clip gives the constant 3 (exact); 1/3 is one rounding: inside approx's rel=1e-6
    assert loss2.item() == pytest.approx(3.0 / 3)
    assert lower2.item() == pytest.approx(1 / 3)
    # asymmetric clip (clip-higher)
    l3, *_ = compute_policy_loss(old, torch.log(torch.tensor([[1.5, 1.0, 1.0]])), torch.tensor([[1.0, 0.0, 0.0]]),
                                 mask, cliprange_low=0.2, cliprange_high=0.28)
    assert l3.item() == pytest.approx(-1.28 / 3, abs=1e-6)  # clipped to 1.28: ~1 ulp of 0.43


def test_value_loss_by_hand():
    vpred = torch.tensor([[1.0, 0.0]])
    values = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0]])
    loss, clipfrac = compute_value_loss(vpred, ret, values, torch.ones(1, 2), cliprange_value=0.5)
    # token 0: vclip = 0.5 -> max((1-2)^2, (0.5-2)^2) = 2.25; token 1: both 1
    # dyadic values: exact in fp32; approx's default rel=1e-6 is slack
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


def test_log_probs_entropy_kl_against_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    dist = torch.distributions.Categorical(logits=logits)
    # the same fp32 quantities by other formulas: a few ulp of |x| <= 5, under 1e-6 + 1e-5 |x|
    assert torch.allclose(logprobs_from_logits(logits, labels), dist.log_prob(labels), atol=1e-6)
    assert torch.allclose(entropy_from_logits(logits), dist.entropy(), atol=1e-6)
    lp, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -1.0]])
    assert kl_penalty(lp, ref, "kl").tolist() == [[0.5, 0.0]]
    assert kl_penalty(lp, ref, "mse").tolist() == [[0.125, 0.0]]
    # k3 (KL3 above): fp32 e^+-0.5 is within 1 ulp (SLEEF u10) and the -1, +-0.5 are exact
    # (Sterbenz), so the worst case is rel 5.6e-7 (d=0.5) or 8e-7 (d=-0.5); rel 2e-6 holds it
    k3 = math.exp(-0.5) - 1 + 0.5
    assert kl_penalty(lp, ref, "low_var_kl")[0, 0].item() == pytest.approx(k3, rel=KL3)
    assert kl_penalty(lp, ref, "abs").tolist() == [[0.5, 0.0]]
    # Schulman's names are aliases: k1 = kl, k2 = mse, k3 = low_var_kl, on values by hand
    assert kl_penalty(lp, ref, "k1").tolist() == [[0.5, 0.0]]
    assert kl_penalty(lp, ref, "k2").tolist() == [[0.125, 0.0]]
    assert kl_penalty(ref, lp, "k3")[0, 0].item() == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=KL3)
    assert kl_penalty(lp, ref, "k3")[0, 0].item() == pytest.approx(k3, rel=KL3)
    with pytest.raises(ValueError, match="kl_penalty='x'"):
        kl_penalty(lp, ref, "x")
    # float64 (a reference computation) stays float64: 1e-12 was lost in fp32 (0 there). 1 + 1e-12
    # is stored within 2^-53 ~ 1.1e-16 of itself, 1.1e-4 of 1e-12: rel 1e-3 holds it
    tiny = kl_penalty(torch.tensor([1.0 + 1e-12], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), "k1")
    assert tiny.dtype == torch.float64 and tiny.item() == pytest.approx(1e-12, rel=1e-3)


def test_logprob_rounding_bound_by_hand():
    from minihf.algorithms import logit_abs_scale, logprob_rounding_bound

    h = torch.tensor([[1.0, -2.0], [0.5, 0.0]])                  # [2, H=2]
    w = torch.tensor([[3.0, 1.0], [-1.0, 4.0], [0.0, 0.0]])      # [V=3, H]
    # row 0: |1|*3 + |-2|*1 = 5, |1|*1 + |-2|*4 = 9 -> 9; row 1: 1.5, 0.5 -> 1.5; T = 0.5
    scale = logit_abs_scale(h, w, temperature=0.5)
    assert scale.tolist() == [18.0, 3.0]
    assert (scale >= (h @ w.T).abs().amax(-1) / 0.5).all()        # bounds |z/T| from above
    bound = logprob_rounding_bound(scale)
    assert torch.allclose(bound, torch.tensor([256 * 2.0**-24 * 18, 256 * 2.0**-24 * 3]))
    assert logprob_rounding_bound(scale, torch.bfloat16)[1].item() == pytest.approx(256 * 2.0**-8 * 3)
