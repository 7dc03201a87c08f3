"""A recipe role that trains (``roles.<name>.train.enable``, ``minihf.workers.TrainedRoleWorker``),
shown by ``recipes/prime`` (an implicit PRM updated online): its own optimizer steps and
metrics; checkpointed and resumed with the run (a run stopped after step 2 of 3 and resumed
equals the uninterrupted one: metrics exactly, the PRM's and the actor's parameters bitwise);
its update's loss by hand; planned by the start-up check; and every bad setting in one line."""

from types import SimpleNamespace

import pytest
import torch

from minihf.config import ConfigError
from minihf.testing import spawn_ranks
from minihf.algorithms import logprob_rounding_bound
from test_ppo import _runs, final_params, job_config


def prime(model, **extra):
    return {"roles.prm.model.path": model, "roles.prm.train.ppo_mini_batch_size": 4,
            "roles.prm.train.optim.lr": 1e-2, "roles.prm.max_tokens_per_micro_batch": 64,
            "roles.prm.train.max_tokens_per_micro_batch": 64, **extra}


def logit_scale_bound(model) -> torch.Tensor:
    """An upper bound of ``logit_abs_scale`` at temperature 1, from the weights (a tied LM head)."""
    from minihf.models import load_hf

    m = load_hf(model).requires_grad_(False)
    h = m.args.hidden_size ** 0.5 * m.model.norm.weight.abs().max()
    return h * m.model.embed_tokens.weight.norm(dim=-1).max()


def test_prime_trains_its_prm_and_resumes_exactly(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    extra = prime(model, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1})
    after = {**extra, "algorithm.plugin_config.prime.update": "after"}
    cases = [("full", "prime", None, "full", extra), ("first", "prime", 2, "resumed", extra),
             ("rest", "prime", None, "resumed", extra), ("after", "prime", 1, "after", after)]
    res = spawn_ranks(_runs, 1, model, data, str(tmp_path), cases, timeout_s=600)[0]
    steps = [h for h in res["full"] if h["step"] > 0]
    for h in steps:
        assert {"prm/loss", "prm/acc", "prm/grad_norm", "prm/lr", "prm/process_reward/mean",
                "timing_s/prm", "timing_s/update_prm"} <= set(h), sorted(h)
        assert h["prm/lr"] == 1e-2 and h["prm/grad_norm"] > 0 and 0 <= h["prm/acc"] <= 1
    # 8 rows a step in mini-batches of 4: two PRM steps a step, taken before it scores
    # (update: before), so the process rewards are off zero from step 1 on: 1e-4 is 40x the
    # rounding bound below (2.3e-6 for this model), so only a PRM that moved passes
    assert all(abs(h["prm/process_reward/mean"]) > 1e-4 for h in steps)
    # update: after scores first: at step 1 the PRM is the reference's weights, and the process
    # rewards differ from 0 by two forwards' rounding only (other micro-batches): per token
    # beta x 2 x logprob_rounding_bound (each forward's log-prob within it of the exact one),
    # at a logit scale bounded from the weights alone, so on any CPU: sum_k |h_k W_vk| <=
    # ||h|| ||W_v|| (Cauchy-Schwarz), ||h|| <= sqrt(H) max|g| after the final RMSNorm (gain g)
    first = next(h for h in res["after"] if h["step"] == 1)
    bound = 0.05 * 2 * float(logprob_rounding_bound(logit_scale_bound(model)))
    assert abs(first["prm/process_reward/mean"]) <= bound and first["prm/grad_norm"] > 0

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    assert [strip(h) for h in res["full"]] == [strip(h) for h in res["first"] + res["rest"]]
    a, b = final_params(tmp_path / "full", 3), final_params(tmp_path / "resumed", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)                       # the actor
    full, resumed = (tmp_path / d / "global_step_3" / "prm" for d in ("full", "resumed"))
    for part in ("model", "optim", "extra"):                             # the PRM's weights, AdamW, RNG
        files = sorted(p.name for p in (full / part).iterdir() if p.suffix in (".distcp", ".pt"))
        assert files and all((full / part / f).read_bytes() == (resumed / part / f).read_bytes() for f in files)
    assert (full / "model" / "__0_0.distcp").read_bytes() != (
        tmp_path / "full" / "global_step_1" / "prm" / "model" / "__0_0.distcp").read_bytes()  # it trained


def test_trained_role_settings_are_checked(tiny_job, tmp_path):  # noqa: F811
    from minihf.planner.job import workload
    from minihf.trainer.plugins import plugin_classes
    from minihf.trainer.ppo_job import ppo_roles

    model, data = tiny_job
    cfg = job_config(model, data, tmp_path / "a", "prime", **prime(model))
    assert cfg.roles["prm"].train.enable
    w = workload(cfg)
    prm = w.role("prm")
    assert prm.trains and prm.mini_batch == 4 and prm.epochs == 1       # planned with its optimizer
    assert ppo_roles(cfg)["prm"].worker_cls.__name__ == "ImplicitPRM"

    def fails(match, **over):
        with pytest.raises((ConfigError, ValueError), match=match):
            ppo_roles(job_config(model, data, tmp_path / "b", "prime", **prime(model, **over)))
    fails(r"roles.prm.train.enable is true, but its worker LogProbWorker does not train: subclass "
          r"minihf.workers.TrainedRoleWorker", **{"roles.prm.worker": "LogProbWorker"})
    fails(r"roles.prm: worker .*prime.py:ImplicitPRM is a TrainedRoleWorker; set roles.prm.train.enable: true",
          **{"roles.prm.train.enable": False})
    fails(r"roles.prm.train.*ppo_mini_batch_size=0 and ppo_epochs=1 must be >= 1",
          **{"roles.prm.train.ppo_mini_batch_size": 0})
    fails(r"roles.prm.train.*loss_agg_mode='mean'; choose one of", **{"roles.prm.train.loss_agg_mode": "mean"})
    bad = job_config(model, data, tmp_path / "d", "prime", **prime(model, **{"algorithm.plugin_config.prime.update": "x"}))
    plugin = next(c for c in plugin_classes(bad) if c.key() == "prime")   # its settings: when the trainer starts
    with pytest.raises((ConfigError, ValueError), match=r"plugin_config.prime.*update='x'; choose before or after"):
        plugin(SimpleNamespace(cfg=bad))
    with pytest.raises(ConfigError, match=r"roles.prm.train.ppo_mini_batch_size=3 must divide the 8 sequences"):
        job_config(model, data, tmp_path / "c", "prime", **prime(model, **{
            "roles.prm.train.ppo_mini_batch_size": 3})).check_sizes({"roles.prm.train": 1})


def test_the_prm_loss_by_hand():
    """``ImplicitPRM.loss`` on hand-made log-probs: the cross-entropy of beta x the summed
    log-ratio against the score, averaged per response by ``agg``."""
    from minihf.algorithms import agg_loss
    from minihf.utils.imports import load_ref
    from minihf.recipes import __path__ as recipes

    cls = load_ref(f"{recipes[0]}/prime/prime.py:ImplicitPRM", "worker class")
    worker = cls.__new__(cls)
    worker.config = type("C", (), {"options": {"beta": 0.5}})()
    mask = torch.tensor([[1., 1., 0.], [1., 1., 1.]])
    log_prob = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -2.5, -9.0], [-0.5, -1.0, -0.5]])
    scores = torch.tensor([[0., 1., 0.], [0., 0., 0.25]])
    mb = {"response_mask": mask, "ref_log_prob": ref, "token_level_scores": scores}
    loss, figures = worker.loss(mb, log_prob, lambda x: agg_loss(x, mask, "seq-mean-token-mean"))
    logits = torch.tensor([0.5 * (0.5 + 0.5), 0.5 * 0.5])                 # beta x sum of log-ratios
    labels = torch.tensor([1.0, 0.25])
    ce = -(labels * torch.log(torch.sigmoid(logits)) + (1 - labels) * torch.log(1 - torch.sigmoid(logits)))
    # both sides fp32, ~6 roundings each of u = 6e-8 on values ~0.5: relative error < 1e-6
    assert loss.item() == pytest.approx(ce.mean().item(), rel=1e-6)
    assert figures["acc"].item() == 0.5 and figures["logit"].item() == pytest.approx(0.375)


def test_the_workers_own_checks():
    """A subclass without ``loss``, a loss that is not a scalar, a batch without its keys: one
    line each, naming the class (the worker's methods called in-process, no model built)."""
    from minihf.controller.worker import create_worker
    from minihf.protocol import Batch
    from minihf.workers import TrainedRoleWorker

    class NoLoss(TrainedRoleWorker):
        pass

    class Rows(TrainedRoleWorker):
        update_keys = ("ref_log_prob",)

        def loss(self, mb, log_prob, agg):
            return log_prob.sum(-1)                                      # [b]: not a scalar

    def make(cls):  # a worker as the controller makes it, with only its role known
        return create_worker(cls, SimpleNamespace(layout=SimpleNamespace(role="prm")), (None,))

    with pytest.raises(TypeError, match=r"NoLoss \(prm\) trains but defines no loss\(self, mb, log_prob, agg\)"):
        make(NoLoss).init_model(1)
    worker = make(Rows)
    worker.model = worker.state = object()                               # as if built
    worker.config = SimpleNamespace(train=SimpleNamespace())
    with pytest.raises(ValueError, match=r"Rows \(prm\)\.update: the batch has no \['ref_log_prob'\]"):
        worker.update(Batch({k: torch.zeros(2, 3) for k in ("input_ids", "attention_mask", "position_ids",
                                                              "responses", "response_mask")}))
    mask = torch.ones(2, 3)
    worker.config = SimpleNamespace(model=SimpleNamespace(use_remove_padding=True), logits_chunk_size=None,
                                    train=SimpleNamespace(loss_agg_mode="token-mean"))
    import minihf.workers.trained_role as tr
    real, tr.forward_log_probs = tr.forward_log_probs, lambda *a, **k: {"log_probs": torch.zeros(2, 3)}
    try:
        loss_fn = worker._loss_fn(1.0)(torch.tensor(6.0), torch.tensor(6.0))
        with pytest.raises(TypeError, match=r"Rows.loss returned Tensor\(2,\); return a scalar tensor"):
            loss_fn({"response_mask": mask})
    finally:
        tr.forward_log_probs = real
