"""Advantage estimators, KL controllers, the Dr.GRPO aggregation, the registries and GSPO,
against values worked out by hand (the whitening reference is ``statistics``, not torch)."""

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minihf.algorithms import (
    ADV_ESTIMATORS, POLICY_LOSSES, AdaptiveKLController, AdvantageEstimator, FixedKLController,
    agg_loss, apply_kl_penalty, compute_gae_advantage_return, compute_grpo_outcome_advantage,
    compute_policy_loss_gspo, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage, get_adv_estimator_fn, get_policy_loss_fn, loss_normalizer,
    masked_var, masked_whiten, register_adv_est, register_policy_loss, vanilla_policy_loss)


def T(rows):
    return torch.tensor(rows, dtype=torch.float32)


def whiten_ref(xs):
    """Reference whitening of a list of floats (unbiased std, as torch.std)."""
    mu, sd = statistics.mean(xs), statistics.stdev(xs)
    return [(x - mu) / math.sqrt(sd * sd + 1e-8) for x in xs]


# values |x| <= 5 from a few fp32 ops (sums, whitening of <= 9 values): 1e-5 is >= 20 ulp
def assert_close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# -- masked statistics --------------------------------------------------------------------
def test_masked_var_and_whiten():
    v, m = T([[1.0, 2.0, 3.0, 100.0]]), T([[1, 1, 1, 0]])
    # small integers: fp32 exact up to the last division and scaling (~1 ulp); rel=1e-6 is 8+ ulp
    assert masked_var(v, m).item() == pytest.approx(1.0)            # ((1+0+1)/3) * 3/2
    assert masked_var(v, m, unbiased=False).item() == pytest.approx(2 / 3)
    assert_close(masked_whiten(v, m)[:, :3], [[-1.0, 0.0, 1.0]])
    assert_close(masked_whiten(v, m, shift_mean=False)[:, :3], [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="at least 2 unmasked"):
        masked_var(v, T([[0, 1, 0, 0]]))


# -- GAE ----------------------------------------------------------------------------------
def test_gae_gamma1_lam1_is_return_minus_value():
    r = T([[0, 0, 1, 0], [0, 0.5, 0, 0], [1, 0, 0, 2]])
    v = T([[0.5, 0.2, 0.1, 9], [0.3, 0.4, 9, 9], [0.1, 0.2, 0.3, 0.4]])
    m = T([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv, ret = compute_gae_advantage_return(r, v, m, gamma=1.0, lam=1.0)
    # with gamma = lam = 1, returns are the undiscounted returns-to-go G_t
    assert_close(ret[0, :3], [1, 1, 1])
    assert_close(ret[1, :2], [0.5, 0.5])
    assert_close(ret[2], [3, 2, 2, 2])
    raw = [0.5, 0.8, 0.9, 0.2, 0.1, 2.9, 1.8, 1.7, 1.6]              # G_t - V_t, row by row
    w = whiten_ref(raw)
    assert_close(adv, [w[0:3] + [0], w[3:5] + [0, 0], w[5:9]])


def test_gae_discounted_by_hand_and_masked_step_is_skipped():
    # gamma = lam = 0.5, r = [0, 1], V = [0.5, 0.25]:
    #   t=1: delta = 1 + 0.5*0 - 0.25 = 0.75;   A_1 = 0.75
    #   t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375; A_0 = -0.375 + 0.25*0.75 = -0.1875
    #   returns = A + V = [0.3125, 1.0]; whitening two values gives -+1/sqrt(2)
    adv, ret = compute_gae_advantage_return(T([[0, 1]]), T([[0.5, 0.25]]), T([[1, 1]]), 0.5, 0.5)
    assert_close(ret, [[0.3125, 1.0]])
    assert_close(adv, [[-1 / math.sqrt(2), 1 / math.sqrt(2)]])
    # a masked step in the middle (reward 5, value 7) must change nothing around it
    adv, ret = compute_gae_advantage_return(T([[0, 5, 1]]), T([[0.5, 7, 0.25]]), T([[1, 0, 1]]), 0.5, 0.5)
    # dyadic values and factors 0.5: exact in fp32; approx's default rel=1e-6 is slack
    assert ret[0, 0].item() == pytest.approx(0.3125)
    assert ret[0, 2].item() == pytest.approx(1.0)
    assert_close(adv, [[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]])


# -- group estimators ---------------------------------------------------------------------
# scores: group "a" = [1, 0, 5] (mean 2, unbiased std sqrt(14/2) = sqrt(7)); group "b" = [5]
G_REWARDS = T([[0, 1, 0], [0, 0, 0], [0, 0, 5], [0, 5, 0]])
G_MASK = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
G_INDEX = np.array(["a", "a", "a", "b"], dtype=object)


def per_row(values, mask=G_MASK):
    return [[x * mi for mi in row] for x, row in zip(values, mask.tolist())]


def test_grpo_two_groups_including_a_singleton():
    adv, ret = compute_grpo_outcome_advantage(G_REWARDS, G_MASK, G_INDEX)
    s7 = math.sqrt(7) + 1e-6
    assert_close(adv, per_row([-1 / s7, -2 / s7, 3 / s7, 5 / (1 + 1e-6)]))
    assert ret is adv
    # int group ids in a different order give the same groups
    adv2, _ = compute_grpo_outcome_advantage(G_REWARDS, G_MASK, np.array([7, 7, 7, 3]))
    assert_close(adv2, adv.tolist())
    # a tensor of ids (verl's annotation): its 0-d elements hash by identity, which made every
    # row a group of its own (the raw scores came back)
    adv_t, _ = compute_grpo_outcome_advantage(G_REWARDS, G_MASK, torch.tensor([7, 7, 7, 3]))
    assert_close(adv_t, adv.tolist())
    # Dr.GRPO: no division by the std
    adv3, _ = compute_grpo_outcome_advantage(G_REWARDS, G_MASK, G_INDEX, norm_adv_by_std_in_grpo=False)
    assert_close(adv3, per_row([-1, -2, 3, 5]))
    # a group whose scores are all equal gets 0, not NaN
    adv4, _ = compute_grpo_outcome_advantage(T([[1.0], [1.0]]), T([[1], [1]]), np.array([0, 0]))
    assert_close(adv4, [[0.0], [0.0]])
    with pytest.raises(ValueError, match="index has 3 entries but the batch has 4 rows"):
        compute_grpo_outcome_advantage(G_REWARDS, G_MASK, G_INDEX[:3])


def test_rloo_is_score_minus_mean_of_others():
    adv, ret = compute_rloo_outcome_advantage(G_REWARDS, G_MASK, G_INDEX)
    # a: 1 - (0+5)/2 = -1.5; 0 - (1+5)/2 = -3; 5 - (1+0)/2 = 4.5; b alone: baseline 0
    assert_close(adv, per_row([-1.5, -3.0, 4.5, 5.0]))
    assert ret is adv


def test_reinforce_plus_plus_baseline():
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(G_REWARDS, G_MASK, G_INDEX)
    # s - group mean = [-1, -2, 3, 5] on 2, 1, 3, 2 tokens, then whitened over those 8 tokens
    w = whiten_ref([-1, -1, -2, 3, 3, 3, 5, 5])
    assert_close(adv, [[w[0], w[1], 0], [w[2], 0, 0], w[3:6], [w[6], w[7], 0]])
    assert ret is adv


def test_reinforce_plus_plus_discounting():
    r = T([[0, 0, 1, 0], [1, 9, 2, 0]])
    m = T([[1, 1, 1, 0], [1, 0, 1, 1]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1 skips the masked reward 9: G_3 = 0, G_2 = 2, G_0 = 1 + 0.5*2
    assert_close(ret[0, :3], [0.25, 0.5, 1.0])
    assert_close(ret[1, [0, 2, 3]], [2.0, 2.0, 0.0])
    w = whiten_ref([0.25, 0.5, 1.0, 2.0, 2.0, 0.0])
    assert_close(adv, [[w[0], w[1], w[2], 0], [w[3], 0, w[4], w[5]]])


def test_remax():
    r = T([[0, 1, 2, 0], [3, 0, 0, 0]])
    m = T([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = compute_remax_outcome_advantage(r, T([1.0, 0.5]), m)
    assert_close(ret, [[3, 3, 2, 0], [3, 0, 0, 0]])
    assert_close(adv, [[2, 2, 1, 0], [2.5, -0.5, 0, 0]])


# -- KL controllers and the in-reward penalty ---------------------------------------------
def test_kl_controllers_by_hand():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    # beta is a Python float: float64 rounding (~1e-17) is far inside approx's default rel=1e-6
    c.update(current_kl=0.15, n_steps=10)   # error +0.5 clipped to +0.2: x (1 + 0.2*10/100)
    assert c.value == pytest.approx(0.204)
    c.update(0.09, 50)                      # error -0.1: x (1 - 0.1*50/100)
    assert c.value == pytest.approx(0.1938)
    c.update(0.1, 1000)                     # on target: unchanged
    assert c.value == pytest.approx(0.1938)
    c.update(0.0, 100)                      # error -1 clipped to -0.2: x 0.8
    assert c.value == pytest.approx(0.15504)
    restored = AdaptiveKLController(0.5, 0.1, 100)
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == {"value": pytest.approx(0.15504)}
    with pytest.raises(ValueError, match="horizon=0"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match="target_kl=0"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="no 'value'"):
        restored.load_state_dict({"beta": 1.0})


def test_apply_kl_penalty_by_hand():
    old = T([[-1, -2, -3], [-1, -1, -1]])
    ref = T([[-1.5, -2, -2], [-2, -1, -1]])   # k1 = old - ref = [[0.5, 0, -1], [1, 0, 0]]
    mask = T([[1, 1, 0], [1, 0, 0]])
    scores = T([[0, 1, 0], [2, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, FixedKLController(0.1), "kl")
    assert_close(rewards, [[-0.05, 1, 0], [1.9, 0, 0]])
    # per-sequence KL means: 0.5/2 and 1/1 -> mean over sequences 0.625
    # dyadic KL values (exact in fp32) and a float64 beta: approx's default rel=1e-6 is slack
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.625),
                       "actor/reward_kl_penalty_coeff": pytest.approx(0.1)}
    ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=20)
    _, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)  # beta before update
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 20))          # error 0.25 -> 0.2


# -- Dr.GRPO aggregation --------------------------------------------------------------------
LOSS = T([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_seq_mean_token_sum_norm():
    mode = "seq-mean-token-sum-norm"
    # masked token sum 1 + 2 + 4 = 7 over B = 3 rows (the empty one counts) x T = 3
    # integer sums are exact in fp32, then one or two divisions: <= 2 ulp, inside rel=1e-6 (8+ ulp)
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(7 / 9)
    assert agg_loss(LOSS, MASK, mode, loss_scale_factor=10).item() == pytest.approx(7 / 30)
    assert loss_normalizer(MASK, mode).item() == 3
    # two micro-batches of different padded widths with the global normaliser sum to the whole
    norm = loss_normalizer(MASK[:2, :2], mode) + loss_normalizer(MASK[2:], mode)
    parts = (agg_loss(LOSS[:2, :2], MASK[:2, :2], mode, norm, loss_scale_factor=3)
             + agg_loss(LOSS[2:], MASK[2:], mode, norm, loss_scale_factor=3))
    assert parts.item() == pytest.approx(7 / 9)
    with pytest.raises(ValueError, match="loss_scale_factor=0"):
        agg_loss(LOSS, MASK, mode, loss_scale_factor=0)


# -- registries ---------------------------------------------------------------------------
def test_adv_estimator_registry():
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        assert name in ADV_ESTIMATORS
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("gae") is compute_gae_advantage_return
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grop'; did you mean 'grpo'\?.*'rloo'"):
        get_adv_estimator_fn("grop")

    def mine(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    def other(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards
    try:
        assert register_adv_est("test_mine")(mine) is mine
        register_adv_est("test_mine")(mine)          # the same function again: fine
        assert get_adv_estimator_fn("test_mine") is mine
        with pytest.raises(ValueError, match="'test_mine' is already registered"):
            register_adv_est("test_mine")(other)
        with pytest.raises(ValueError, match="'grpo' is already registered"):
            register_adv_est("grpo")(other)
    finally:
        ADV_ESTIMATORS.pop("test_mine", None)
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage


def test_a_recipes_estimator_returning_something_else_is_named():
    """A recipe's estimator (``adv_estimator: file.py:fn``) that returned advantages of the
    wrong shape failed in the actor's update, a None in the metrics, NaNs only warned (with
    advice about the learning rate), grad-carrying ones were backpropagated twice; and one
    taking ``**kw`` was refused as needing an argument named 'kw'."""
    from minihf.protocol import Batch
    from minihf.trainer.advantage import estimate_advantages

    rewards, mask = torch.zeros(4, 3), torch.ones(4, 3)
    mask[0, 2] = 0
    batch = Batch({"token_level_rewards": rewards, "response_mask": mask}, {"uid": ["a", "a", "b", "b"]})
    alg = SimpleNamespace(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    nan_padding = torch.zeros(4, 3)
    nan_padding[0, 2] = math.nan  # under the mask: allowed
    cases = {"shape": (lambda **kw: (torch.zeros(4), torch.zeros(4)), r"returned advantages as a torch.float32 "
                       r"tensor of shape \(4,\); return \(advantages, returns\): two float tensors shaped like "
                       r"token_level_rewards \(4, 3\)"),
             "none": (lambda **kw: (rewards, None), "returned returns as NoneType"),
             "one": (lambda **kw: rewards, "returned Tensor; return"),
             "numpy": (lambda **kw: (np.zeros((4, 3)), rewards), "returned advantages as ndarray"),
             "nan": (lambda **kw: (rewards + math.nan, rewards), "returned non-finite advantages at 11 response tokens")}
    try:
        for name, (fn, says) in cases.items():
            register_adv_est(f"test_{name}")(fn)
            with pytest.raises(ValueError, match=says):
                estimate_advantages(batch, alg, f"test_{name}")
        graph = torch.ones(4, 3, requires_grad=True)
        register_adv_est("test_ok")(lambda token_level_rewards, **kw: (graph * 2 + nan_padding, token_level_rewards))
        adv, ret = estimate_advantages(batch, alg, "test_ok")  # **kw takes the rest of the pool
        assert not adv.requires_grad and adv[1, 0] == 2 and torch.equal(ret, rewards)
    finally:
        for name in [*cases, "ok"]:
            ADV_ESTIMATORS.pop(f"test_{name}", None)


CFG = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=None)


def test_policy_loss_registry_and_vanilla():
    assert get_policy_loss_fn("vanilla") is vanilla_policy_loss
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    with pytest.raises(ValueError, match=r"unknown policy loss 'gpso'; did you mean 'gspo'\?.*'vanilla'"):
        get_policy_loss_fn("gpso")
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    new = torch.log(T([[1.5, 0.5, 1.1]]))
    adv = T([[1.0, -1.0, 2.0]])
    loss, clipfrac, _, _ = vanilla_policy_loss(old, new, adv, mask, loss_agg_mode="token-mean",
                                               normalizer=None, config=CFG)
    # abs=1e-6: ratios via fp32 log/exp (~2 ulp), a 3-term mean of |x| <= 2.2: ~2e-7 at worst;
    # clipfrac is a count / 3 (one rounding), inside approx's default rel=1e-6
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-6)  # as test_algorithms
    assert clipfrac.item() == pytest.approx(2 / 3)
    hi = SimpleNamespace(**{**vars(CFG), "clip_ratio_high": 0.28})
    loss, *_ = vanilla_policy_loss(old, torch.log(T([[1.5, 1, 1]])), T([[1.0, 0, 0]]), mask,
                                   loss_agg_mode="token-mean", normalizer=None, config=hi)
    assert loss.item() == pytest.approx(-1.28 / 3, abs=1e-6)

    def custom(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, normalizer, config):
        raise NotImplementedError
    try:
        register_policy_loss("test_custom")(custom)
        assert get_policy_loss_fn("test_custom") is custom
    finally:
        POLICY_LOSSES.pop("test_custom", None)


# -- GSPO ---------------------------------------------------------------------------------
def test_gspo_ratio_one_is_minus_seq_mean_advantage():
    lp = T([[-1, -2, -3], [-0.5, -0.5, -0.5]])
    mask = T([[1, 1, 0], [1, 1, 1]])
    adv = T([[1, 1, 1], [-2, -2, -2]])
    loss, clipfrac, ppo_kl, lower = compute_policy_loss_gspo(
        lp, lp, adv, mask, loss_agg_mode="token-mean", normalizer=None, config=CFG)
    # seq-mean-token-mean whatever the mode: (-1 + 2) / 2 (token-mean would give 4/5)
    assert loss.item() == pytest.approx(0.5)  # ratio e^0 = 1: exact in fp32
    assert (clipfrac.item(), ppo_kl.item(), lower.item()) == (0.0, 0.0, 0.0)


def test_gspo_sequence_ratio_clip_and_gradient():
    old = torch.zeros(2, 3)
    mask = T([[1, 1, 0], [1, 1, 1]])
    adv = T([[1, 1, 1], [-2, -2, -2]])
    # row 0: mean log-ratio (0.1 + 0.3)/2 = 0.2 -> s_0 = e^0.2 = 1.2214; row 1: mean 0 -> s_1 = 1
    start = T([[0.1, 0.3, 5.0], [-0.2, 0.0, 0.2]])
    wide = SimpleNamespace(clip_ratio=0.5, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=None)
    lp = start.clone().requires_grad_(True)
    loss, clipfrac, ppo_kl, _ = compute_policy_loss_gspo(
        old, lp, adv, mask, loss_agg_mode="seq-mean-token-mean", normalizer=None, config=wide)
    e = math.exp(0.2)
    # abs=1e-6: fp32 e^(mean log-ratio) ~1.22 within ~2 ulp (2.4e-7), then halved; the KL is a
    # 5-term mean of values <= 0.3 (ulp 3e-8)
    assert loss.item() == pytest.approx((-e + 2) / 2, abs=1e-6)
    assert clipfrac.item() == 0.0
    assert ppo_kl.item() == pytest.approx(-(0.1 + 0.3 - 0.2 + 0.2) / 5, abs=1e-6)
    loss.backward()
    # dL/dlp_it = -A_i s_i / |y_i| / B, 0 on padding
    assert_close(lp.grad, [[-e / 4, -e / 4, 0], [1 / 3, 1 / 3, 1 / 3]])

    # clip_ratio_high 0.2 < 0.2214: row 0 is clipped to 1.2 and gets no gradient
    tight = SimpleNamespace(clip_ratio=0.5, clip_ratio_low=None, clip_ratio_high=0.2, clip_ratio_c=None)
    lp = start.clone().requires_grad_(True)
    loss, clipfrac, _, _ = compute_policy_loss_gspo(
        old, lp, adv, mask, loss_agg_mode="seq-mean-token-mean", normalizer=None, config=tight)
    # the clipped ratio is the constant 1.2 (0.5 ulp), far inside 1e-6; clipfrac 2/5 is one division
    assert loss.item() == pytest.approx((-1.2 + 2) / 2, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 5)
    loss.backward()
    assert_close(lp.grad, [[0, 0, 0], [1 / 3, 1 / 3, 1 / 3]])

    # a global normaliser of sequences is honoured; one counted in tokens is refused
    loss4, *_ = compute_policy_loss_gspo(old, old, adv, mask, loss_agg_mode="seq-mean-token-mean",
                                         normalizer=4.0, config=wide)
    assert loss4.item() == pytest.approx((-1 + 2) / 4)  # ratio 1, divided by 4: exact
    with pytest.raises(ValueError, match="loss_agg_mode='token-mean'"):
        compute_policy_loss_gspo(old, old, adv, mask, loss_agg_mode="token-mean", normalizer=5.0,
                                 config=wide)
