"""The actor's auxiliary losses (``actor.aux_losses``, ``minihf.workers.aux_loss``): a recipe's
loss term reads the student's log-probs at chosen ids from the update's own forward and batch
keys of its choosing; its value and figures are exact across micro-batches (aggregated as the
policy loss is), it trains, and every mistake is named in one line."""

import pytest
import torch

from minihf.algorithms import masked_mean
from minihf.models import ModelArgs, build_model, init_weights, save_hf
from minihf.protocol import Batch
from minihf.workers.actor import ActorRolloutRefWorker
from minihf.workers.aux_loss import AuxLossConfig
from minihf.workers.forward import forward_log_probs

from test_fsdp import ARGS, make_batch
from test_workers import actor_cfg, local_worker, max_diff

LOSSES = '''
import torch
from minihf.algorithms import agg_loss, masked_mean


def pull_up(log_probs_at, probe_weight, response_mask, loss_agg_mode, normalizer, options):
    """-(weighted log-probs at the probe ids), aggregated as the policy loss is."""
    term = -(log_probs_at * probe_weight).sum(-1) * options["scale"]
    return agg_loss(term, response_mask, loss_agg_mode, normalizer), {"at": masked_mean(log_probs_at.sum(-1), response_mask)}


def no_log_probs_at(log_probs_at, response_mask):
    return log_probs_at.sum()


def needs_more(log_prob, teacher_thing):
    return log_prob.sum()


def returns_list(log_prob):
    return [log_prob.sum()]


def per_token(log_prob):
    return log_prob
'''


def _setup(tmp_path, micro, **spec):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "losses.py").write_text(LOSSES)
    model = init_weights(build_model(ModelArgs(**ARGS), "lm"), seed=5)
    path = str(save_hf(model, tmp_path / "model"))
    cfg = actor_cfg(path, micro)
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs = 8, 1
    cfg.actor.entropy_coeff, cfg.actor.use_kl_loss = 0.0, False
    spec = {"fn": f"{tmp_path}/losses.py:pull_up", "coef": 0.5, "reads": ["probe_weight"],
            "log_probs_at": "probe_ids", "options": {"scale": 2.0}, **spec}
    cfg.actor.aux_losses = {"probe": AuxLossConfig(**spec)}
    batch = Batch(make_batch(8, 6, 5, seed=4), meta={"temperature": 0.8})
    g = torch.Generator().manual_seed(7)
    batch.tensors["probe_ids"] = torch.randint(0, ARGS["vocab_size"], (8, 5, 3), generator=g)
    batch.tensors["probe_weight"] = torch.rand(8, 5, 3, generator=g)
    return cfg, batch


def test_aux_loss_value_figures_and_micro_batch_exactness(tmp_path):
    cfg, batch = _setup(tmp_path, micro=8)
    one = local_worker(ActorRolloutRefWorker, cfg)
    batch |= one.compute_log_prob(batch)
    # by hand, from the same weights before the update: the student's log-probs at the ids
    mb = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    with torch.no_grad():
        at = forward_log_probs(one.actor, mb, temperature=0.8, ids=batch["probe_ids"])["log_probs_at"]
    mask = batch["response_mask"]
    want_loss = masked_mean(-(at * batch["probe_weight"]).sum(-1) * 2.0, mask).item()  # token-mean
    want_at = masked_mean(at.sum(-1), mask).item()
    before = {k: v.clone() for k, v in one.actor.state_dict().items()}
    m_one = one.update_actor(batch)
    # another micro-batching of the same forward: fp32 rounding only. Each log-prob is a dot
    # product of K <= 32 terms (hidden size) then a logsumexp over 48 logits of size O(1): it
    # rounds by <~ K u = 32 x 6e-8 = 2e-6 of its magnitude, and a token mean of such values by
    # no more; 1e-5 relative covers it on any CPU (summation order is the only free choice)
    assert m_one["actor/probe/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert m_one["actor/probe/at"] == pytest.approx(want_at, rel=1e-5)
    # micro-batches of 1: the same loss, figures and step (the normaliser is global)
    cfg1, _ = _setup(tmp_path / "b", micro=1)
    cfg1.model.path = cfg.model.path
    tiny = local_worker(ActorRolloutRefWorker, cfg1)
    m_tiny = tiny.update_actor(batch)
    for k in ("actor/probe/loss", "actor/probe/at", "actor/pg_loss", "actor/grad_norm"):
        assert m_tiny[k] == pytest.approx(m_one[k], rel=1e-5, abs=1e-7), k
    # one AdamW step from equal gradients (to rounding, <~ 1e-5 relative as above): Adam's step is
    # lr x m / sqrt(v), scale-free, so it moves by <~ lr x 1e-5 = 1e-8, plus a few ulp of |w| < 1
    # (~1e-7) from the update's own rounding: 1e-6 covers both. k_proj.bias has
    # zero gradient in exact arithmetic (softmax ignores it) and is left out, as in test_workers
    keep = lambda w: {k: v for k, v in w.actor.state_dict().items() if not k.endswith("k_proj.bias")}
    assert max_diff(keep(one), keep(tiny)) < 1e-6
    # it trains: the same update with coef 0 logs the term but takes another step
    cfg0, _ = _setup(tmp_path / "c", micro=8, coef=0.0)
    cfg0.model.path = cfg.model.path
    zero = local_worker(ActorRolloutRefWorker, cfg0)
    m_zero = zero.update_actor(batch)
    assert m_zero["actor/probe/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert max_diff(keep(zero), keep(one)) > 1e-4 and max_diff(keep(zero), before) > 1e-4


@pytest.mark.parametrize("spec, match", [
    ({"fn": "losses.py"}, "must name the loss function as file.py:function"),
    ({"coef": float("nan")}, "coef=nan must be a finite number"),
    ({"reads": [3]}, "must be a list of batch keys"),
])
def test_bad_settings_fail_at_config(tmp_path, spec, match):
    with pytest.raises(ValueError, match=match):
        _setup(tmp_path, micro=8, **spec)


@pytest.mark.parametrize("name, spec, match", [
    ("needs_more", {}, r"aux_losses.probe \(.*losses.py:needs_more\): nothing provides its parameter\(s\) "
                       r"\['teacher_thing'\]"),
    ("no_log_probs_at", {"log_probs_at": None}, r"\['log_probs_at \(set log_probs_at"),
])
def test_what_the_function_asks_for_is_checked_at_init(tmp_path, name, spec, match):
    cfg, _ = _setup(tmp_path, micro=8, fn=f"{tmp_path}/losses.py:{name}", **spec)
    with pytest.raises(ValueError, match=match):
        local_worker(ActorRolloutRefWorker, cfg)


@pytest.mark.parametrize("name, change, match", [
    ("returns_list", {}, r"returned list; return the loss as a scalar tensor"),
    ("per_token", {}, r"returned Tensor\(8, 5\); return the loss as a scalar tensor"),
    ("pull_up", {"probe_ids": torch.rand(8, 5, 3)}, r"batch key 'probe_ids' .* must hold integer token ids"),
])
def test_bad_returns_and_ids_are_named(tmp_path, name, change, match):
    cfg, batch = _setup(tmp_path, micro=8, fn=f"{tmp_path}/losses.py:{name}")
    actor = local_worker(ActorRolloutRefWorker, cfg)
    batch |= actor.compute_log_prob(batch)
    batch.tensors.update(change)
    with pytest.raises(ValueError, match=match):
        actor.update_actor(batch)


def test_the_driver_sends_what_the_losses_read(tmp_path):
    from minihf.controller import RoleLayout
    from minihf.controller.errors import ControllerError
    from minihf.controller.group import WorkerGroup

    cfg, _ = _setup(tmp_path, micro=8)
    reads = ActorRolloutRefWorker.declare_reads(cfg)
    assert reads == {"update_actor": ("probe_weight", "probe_ids")}
    group = WorkerGroup(RoleLayout("actor", (0,)), ActorRolloutRefWorker, None, reads=reads)
    assert {"probe_weight", "probe_ids", "advantages"} <= set(group.update_actor.spec.reads)
    assert "probe_ids" not in group.compute_log_prob.spec.reads
    with pytest.raises(ControllerError, match=r"declare_reads names \['update_actr'\]"):
        WorkerGroup(RoleLayout("actor", (0,)), ActorRolloutRefWorker, None, reads={"update_actr": ("x",)})


def test_a_key_the_job_does_not_have_is_named(tmp_path):
    (tmp_path / "ref.py").write_text("def kl_to_ref(log_prob, ref_log_prob):\n    return (log_prob - ref_log_prob).sum()\n")
    cfg, batch = _setup(tmp_path, micro=8, fn=f"{tmp_path}/ref.py:kl_to_ref", log_probs_at=None, reads=[])
    actor = local_worker(ActorRolloutRefWorker, cfg)          # use_kl_loss=false: no ref_log_prob sent
    batch |= actor.compute_log_prob(batch)
    with pytest.raises(ValueError, match=r"aux_losses.probe .*: the update's batch has no \['ref_log_prob'\]"):
        actor.update_actor(batch)


def test_a_read_key_no_phase_added_is_named(tmp_path):
    cfg, batch = _setup(tmp_path, micro=8)
    actor = local_worker(ActorRolloutRefWorker, cfg)
    batch |= actor.compute_log_prob(batch)
    del batch.tensors["probe_weight"]
    with pytest.raises(ValueError, match=r"aux_losses.probe \(.*losses.py:pull_up\) reads batch key 'probe_weight', "
                                         r"which the step's batch does not hold"):
        actor.update_actor(batch)


def test_a_policy_loss_returning_something_else_is_named():
    """A recipe's policy loss (``policy_loss.loss_mode: file.py:fn``): each wrong return
    failed deep in the update (a non-scalar loss at backward, a 2-tuple at unpacking, None
    figures at a multiply), and a loss without gradient trained silently on the other terms."""
    from minihf.workers.aux_loss import policy_loss_terms

    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss = (log_prob * 2).sum()
    zero = torch.zeros(())
    for result, says in (((log_prob * 2, zero, zero, zero), r"returned Tensor\(2, 3\) as the loss; return \(scalar"),
                         (loss, "returned Tensor; return"),
                         ((loss, zero), "returned 2 values; return"),
                         (None, "returned NoneType; return"),
                         ((torch.tensor(1.0), zero, zero, zero), "a loss without gradient"),
                         ((loss, None, zero, zero), "statistic 'clipfrac' is NoneType"),
                         ((loss, zero, torch.ones(3), zero), "statistic 'ppo_kl' is Tensor"),
                         ((loss, zero, zero, zero, [1.0]), r"its own figures \(the 5th value\) must be a dict")):
        with pytest.raises(ValueError, match=says):
            policy_loss_terms(result, "policy loss r/loss.py:fn", log_prob)
    out = policy_loss_terms((loss, 0.5, zero, zero, {"mine": 2}), "policy loss r/loss.py:fn", log_prob)
    assert out[0] is not None and out[0].requires_grad and float(out[1]) == 0.5 and float(out[4]["mine"]) == 2.0
    with torch.no_grad():  # no gradient asked for: none required
        policy_loss_terms((torch.tensor(1.0), zero, zero, zero), "policy loss vanilla", log_prob.detach())
