"""Rollout correction (``minihf.algorithms.rollout_correction``) against values worked out by
hand, the policy loss with importance weights, config errors, the driver's wiring (weights
and rejected tokens reach the update), and verl's own implementation on random inputs where
verl is installed (the project's oracle; skipped otherwise).

Tolerances, derived not measured: every figure is a few fp32 operations (exp of a log,
sums and means of <= 6 values of magnitude <= 3), each within ~1 ulp (<= 2.4e-7 absolute,
1.2e-7 relative), so atol 1e-6 and rel 1e-6 hold on any CPU with >= 4x to spare; rel 1e-5
where an exp of a difference of fp32 log-probs enters (k3, e^0.2), and against verl, whose
same formulas may sum in another order."""

import math

import pytest
import torch

from minihf.algorithms.rollout_correction import (
    compute_offpolicy_metrics, compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights, compute_rollout_rejection_mask, parse_rs_options)

LN = math.log
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# log pi_old - log pi_rollout: ratios 3, 0.5, 1 and 1.5, 0.25 (the last token is padding)
LOG_RATIO = torch.tensor([[LN(3), LN(0.5), 0.0], [LN(1.5), LN(0.25), 7.0]])


def test_token_and_sequence_is_by_hand():
    w, m = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0)
    # capped at 2 from above only; 0 on padding (fp32 exp of logs: a few ulp of values <= 3)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 0.25, 0.0]]), atol=1e-6)
    assert m["rollout_is_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 0.25) / 5, rel=1e-6)  # applied
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)   # the 3
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)    # the 0.25 < 1/2
    assert m["rollout_is_max"] == pytest.approx(2) and m["rollout_is_min"] == pytest.approx(0.25, rel=1e-6)
    # sequence level: products 3 * 0.5 * 1 = 1.5 and 1.5 * 0.25 = 0.375, on every token
    w, m = compute_rollout_correction_weights(LOG_RATIO, MASK, "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([[1.5] * 3, [0.375, 0.375, 0.0]]), atol=1e-6)
    assert m["rollout_is_max"] == pytest.approx(1.5, rel=1e-6)        # of the raw products
    # batch normalised: token weights / their mean over tokens (2 + .5 + 1 + 1.5 + .25) / 5
    w, m = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0, True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.05, rel=1e-6)
    assert torch.allclose(w[0], torch.tensor([2.0, 0.5, 1.0]) / 1.05, atol=1e-6)
    assert not w.requires_grad
    # IcePop: 'lower_upper' zeroes weights outside [0.4, 2] (the 3 and the 0.25), keeps the rest
    w, m = compute_rollout_correction_weights(LOG_RATIO, MASK, "token", "0.4_2")
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0], [1.5, 0.0, 0.0]]), atol=1e-6)
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="rollout_is_threshold='2_0.4'"):
        compute_rollout_correction_weights(LOG_RATIO, MASK, "token", "2_0.4")


def test_rejection_options_by_hand():
    # token_k1 keeps lower <= pi_rollout / pi_old <= upper: 1/3 and 4 fall out of [0.5, 2]
    mask, m = compute_rollout_rejection_mask(LOG_RATIO, MASK, "token_k1", "0.5_2.0")
    assert mask.tolist() == [[0, 1, 1], [1, 0, 0]] and mask.dtype == MASK.dtype
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == 1.0
    assert parse_rs_options("token_k1", "2") == [("token_k1", 0.5, 2.0)]      # X means 1/X_X
    # seq_mean_k1: the geometric mean of pi_rollout / pi_old per sequence: (1/1.5)^(1/3) = 0.87
    # and (1/0.375)^(1/2) = 1.63; [0.9, 1.1] rejects both, [0.8, 1.7] keeps both
    mask, _ = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_mean_k1", "0.9_1.1")
    assert mask.sum() == 0
    mask, _ = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_mean_k1", "0.8_1.7")
    assert mask.tolist() == MASK.tolist()
    # seq_max_k2: max of lr^2/2 per sequence: (ln 3)^2/2 = 0.60 and (ln 4)^2/2 = 0.96
    mask, _ = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_max_k2", 0.7)
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    # combined: every option must keep a token (token_k3 <= 0.4: k3(ln 3) = 3 - 1 - ln 3 = 0.90,
    # k3(ln .5) = 0.19, k3(ln 1.5) = 0.09, k3(ln .25) = 0.64)
    mask, m = compute_rollout_rejection_mask(LOG_RATIO, MASK, "seq_max_k2,token_k3", "0.7,0.4")
    assert mask.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert m["rollout_rs_token_k3_masked_fraction"] == pytest.approx(2 / 5)


def test_offpolicy_metrics_and_the_combined_call_by_hand():
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    roll = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = compute_offpolicy_metrics(old, roll, mask)
    assert m["kl"] == pytest.approx(-0.5 / 3, rel=1e-6)          # mean of rollout - old
    assert m["k3_kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 3, rel=1e-5)
    assert m["training_log_ppl"] == pytest.approx((1.5 + 0.5) / 2, rel=1e-6)
    assert m["rollout_log_ppl"] == pytest.approx((1.75 + 0.5) / 2, rel=1e-6)
    assert m["log_ppl_diff"] == pytest.approx((-0.25 + 0) / 2, rel=1e-6)
    w, mk, metrics = compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
        rollout_rs_threshold="0.7_1.5")
    assert torch.allclose(w, torch.tensor([[1.5, 1.0], [1.0, 0.0]]), atol=1e-6)  # e^0.5 capped
    assert mk.tolist() == [[0, 1], [1, 0]]                        # e^-0.5 = 0.61 < 0.7
    assert all(k.startswith("rollout_corr/") for k in metrics) and "rollout_corr/kl" in metrics
    none, same, _ = compute_rollout_correction_and_rejection_mask(old, roll, mask)
    assert none is None and same is mask
    with pytest.raises(ValueError, match="one shape"):
        compute_rollout_correction_and_rejection_mask(old, roll[:, :1], mask)


@pytest.mark.parametrize("rs, threshold, match", [
    ("token_k4", "1", "unknown option"), ("token_k1", None, "needs rollout_rs_threshold"),
    ("token_k1", "2_0.5", "lower_upper"), ("seq_max_k3", "0.1_0.2", "one positive upper bound"),
    ("token_k1,seq_max_k3", "1,2,3", "gives 3 values for 2 options")])
def test_bad_rejection_settings_name_the_value(rs, threshold, match):
    with pytest.raises(ValueError, match=match):
        parse_rs_options(rs, threshold)


def test_config_errors():
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    key = "algorithm.rollout_correction"
    with pytest.raises(ConfigError, match="rollout_is='tok'"):
        load_config(PPOJobConfig, "grpo", [f"{key}.rollout_is=tok"])
    with pytest.raises(ConfigError, match="rollout_is_threshold=0.0"):
        load_config(PPOJobConfig, "grpo", [f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=0"])
    with pytest.raises(ConfigError, match="bypass mode"):
        load_config(PPOJobConfig, "grpo", [f"{key}.rollout_is=token",
                                           "actor_rollout_ref.actor.recompute_log_prob=false"])
    for set_, switch in [("rollout_is_threshold=3", "rollout_is"), ("rollout_is_batch_normalize=true", "rollout_is"),
                         ("rollout_rs_threshold=2", "rollout_rs")]:  # a setting whose switch is off does nothing
        with pytest.warns(UserWarning, match=rf"{set_.split('=')[0]} is set but {switch} is null"):
            assert not load_config(PPOJobConfig, "grpo", [f"{key}.{set_}"]).algorithm.rollout_correction.enabled
    # an on-policy one-step update recomputes its old log-probs once correction is on
    on_policy = ["actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.ppo_mini_batch_size=256"]
    assert load_config(PPOJobConfig, "grpo", on_policy).old_log_prob_source == "update"
    assert load_config(PPOJobConfig, "grpo", on_policy + [f"{key}.rollout_rs=token_k1",
                                                          f"{key}.rollout_rs_threshold=2"]
                       ).old_log_prob_source == "recompute"


def test_policy_loss_multiplies_clipped_token_losses_by_the_weights():
    from types import SimpleNamespace

    from minihf.algorithms import get_policy_loss_fn
    from minihf.algorithms.policy_loss import check_takes_is_weights

    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=None)
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.0, LN(1.5), LN(0.5)]])                 # ratios 1, 1.5 (clipped), 0.5
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, *_ = get_policy_loss_fn("vanilla")(old, new, adv, mask, config=cfg, rollout_is_weights=w)
    # per token: -1 * 1 * 2; -1 * 1.2 * 0.5 (clipped); max(0.5, 0.8) * 1 for A < 0 -> mean
    assert loss.item() == pytest.approx((-2.0 - 0.6 + 0.8) / 3, abs=1e-6)
    check_takes_is_weights("vanilla")
    check_takes_is_weights("gspo")

    from minihf.algorithms import register_policy_loss
    from minihf.algorithms.policy_loss import POLICY_LOSSES

    @register_policy_loss("test_no_weights")
    def no_weights(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, normalizer, config):
        raise AssertionError
    try:
        with pytest.raises(ValueError, match="'test_no_weights' does not take rollout_is_weights"):
            check_takes_is_weights("test_no_weights")
    finally:
        POLICY_LOSSES.pop("test_no_weights")


def test_the_driver_hands_weights_and_the_rejection_mask_to_the_update(tmp_path):
    """Scripted actor (tests/test_ppo.py): old log-probs -1.0, the engine's -1.2 on every
    token, so log_ratio = 0.2 and token IS weights e^0.2; a token_k1 window [0.9, 1.1] on
    pi_rollout / pi_old = e^-0.2 = 0.82 rejects every token, [0.8, 1.2] none."""
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.trainer.ppo import PPOTrainer
    from test_ppo import ScriptedActor, job_config

    init_model(tmp_path / "model", size="tiny", task="digits")
    make_task_data("digits", tmp_path / "data", 32, 8, seed=0)

    class OffPolicy(ScriptedActor):
        def generate_sequences(self, batch):
            out = super().generate_sequences(batch)
            out.tensors["rollout_log_probs"] = torch.full_like(out["rollout_log_probs"], -1.2)
            return out

    key = "algorithm.rollout_correction"
    for window, kept in (("0.8_1.2", 1), ("0.9_1.1", 0)):
        cfg = job_config(str(tmp_path / "model"), str(tmp_path / "data"), tmp_path / f"run{window}",
                         "grpo", **{f"{key}.rollout_is": "token", f"{key}.rollout_rs": "token_k1",
                                    f"{key}.rollout_rs_threshold": window})
        actor = OffPolicy()
        m = PPOTrainer(cfg, {"actor": actor}, log=lambda *a: None).train_step(1)
        b = actor.updated
        assert torch.allclose(b["rollout_is_weights"], torch.full_like(b["old_log_probs"], math.exp(0.2)),
                              atol=1e-6)                        # fp32 exp of 0.2: ~1 ulp
        assert b["response_mask"].eq(kept).all(), window
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 1 - kept
        assert m["rollout_corr/kl"] == pytest.approx(-0.2, rel=1e-5)


def test_a_rejected_last_token_keeps_its_sequences_score(tmp_path):
    """The score sits on a response's last token. Rejection took that token out of the
    response mask before the advantages, so REINFORCE++'s returns (and GAE's, ReMax's) lost
    the score. Now the advantages are computed over every token and only the update's mask
    loses the rejected ones: the advantages equal a run without rejection."""
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.trainer.ppo import PPOTrainer
    from test_ppo import ScriptedActor, job_config

    init_model(tmp_path / "model", size="tiny", task="digits")
    make_task_data("digits", tmp_path / "data", 32, 8, seed=0)
    (tmp_path / "r.py").write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                                   "    return float(extra_info['index'] % 3)\n")

    class LastTokenOff(ScriptedActor):  # pi_rollout / pi_old = e^-2 on the last token, 1 elsewhere
        def generate_sequences(self, batch):
            out = super().generate_sequences(batch)
            out.tensors["rollout_log_probs"][:, -1] = -3.0
            return out

    key, updated = "algorithm.rollout_correction", {}
    for rs in ("null", "token_k1"):
        cfg = job_config(str(tmp_path / "model"), str(tmp_path / "data"), tmp_path / f"run_{rs}", "grpo", **{
            "algorithm.adv_estimator": "reinforce_plus_plus", f"{key}.rollout_rs": rs,
            f"{key}.rollout_rs_threshold": "null" if rs == "null" else "0.5_2.0",
            "custom_reward_function.path": f"{tmp_path}/r.py", "custom_reward_function.name": "score"})
        actor = LastTokenOff()
        PPOTrainer(cfg, {"actor": actor}, log=lambda *a: None).train_step(1)
        updated[rs] = actor.updated
    plain, rejected = updated["null"], updated["token_k1"]
    assert plain["advantages"].abs().max() > 0.5
    assert torch.equal(rejected["advantages"], plain["advantages"])
    assert rejected["response_mask"][:, -1].eq(0).all() and rejected["response_mask"][:, :-1].eq(1).all()
    assert plain["response_mask"].eq(1).all() and "rollout_rs_mask" not in rejected.tensors


def test_equals_verl_on_random_inputs():
    """verl's ``rollout_corr_helper`` as the oracle (installed: compare; else skipped)."""
    verl = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g) * 3
    roll = old + torch.randn(6, 9, generator=g) * 0.3
    mask = (torch.rand(6, 9, generator=g) > 0.2).long()
    mask[:, 0] = 1
    for kw in (dict(rollout_is="token", rollout_is_threshold=2.0),
               dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
               dict(rollout_is="token", rollout_is_threshold="0.8_1.25", rollout_is_batch_normalize=True),
               dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.7_1.4,0.5"),
               dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1")):
        w, mk, metrics = compute_rollout_correction_and_rejection_mask(old, roll, mask, **kw)
        theirs_w, theirs_mask, theirs_metrics = verl.compute_rollout_correction_and_rejection_mask(
            old, roll, mask, **kw)
        if w is not None:
            torch.testing.assert_close(w, theirs_w.batch["rollout_is_weights"])
        assert torch.equal(mk, theirs_mask.to(mk.dtype)), kw
        for k, v in metrics.items():
            if k in theirs_metrics:
                assert v == pytest.approx(float(theirs_metrics[k]), rel=1e-5, abs=1e-6), k
