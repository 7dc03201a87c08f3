"""Role workers through the controller on 2 gloo ranks vs the same worker code on one
unsharded process; checkpoint save -> fresh worker load -> identical next step; export."""

import pytest
import torch

from minihf.controller.config import ControllerConfig
from torch.distributed.tensor import DTensor

from minihf.controller import (Dispatch, Role, RoleLayout, WorkerContext, create_worker,
                               register, run)
from minihf.models import ModelArgs, build_model, init_weights, load_hf, save_hf
from minihf.protocol import Batch
from minihf.workers.optim import OptimConfig
from minihf.hub import export_hf
from minihf.testing import spawn_ranks
from minihf.workers.actor import ActorRolloutRefWorker
from minihf.workers.config import (ActorConfig, ActorRolloutRefConfig, CriticConfig, FSDPConfig,
                                   RefConfig, RewardModelConfig, RLModelConfig)
from minihf.workers.critic import CriticWorker
from minihf.workers.forward import forward_scores
from minihf.workers.reward_model import RewardModelWorker

from test_fsdp import ARGS, make_batch


class CheckedActor(ActorRolloutRefWorker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_sharded(self) -> bool:
        """After inference every parameter must be a DTensor shard again (resharding
        reads shards)."""
        return all(isinstance(p, DTensor) for p in self.actor.parameters())


def actor_cfg(path, micro, max_tokens=None, shuffle=False):
    return ActorRolloutRefConfig(
        model=RLModelConfig(path=path),
        actor=ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=micro,
                          max_tokens_per_micro_batch=max_tokens, ppo_epochs=2, shuffle=shuffle,
                          entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                          log_prob_micro_batch_size_per_gpu=3,
                          optim=OptimConfig(lr=1e-3, warmup_steps=2, lr_scheduler="cosine",
                                            total_training_steps=20, min_lr_ratio=0.1)),
        ref=RefConfig(fsdp=FSDPConfig(param_offload=True)))  # the reference idles on the host


def critic_cfg(path, micro, max_tokens=None):
    return CriticConfig(model=RLModelConfig(path=path), ppo_mini_batch_size=4,
                        ppo_micro_batch_size_per_gpu=micro, max_tokens_per_micro_batch=max_tokens,
                        forward_micro_batch_size_per_gpu=2, cliprange_value=0.05,
                        optim=OptimConfig(lr=1e-2))


def local_worker(cls, cfg, **kw):
    """The same worker class on one process, unsharded (group=None: no collectives)."""
    ctx = WorkerContext(rank=0, layout=RoleLayout("local", (0,)), group=None,
                        device=torch.device("cpu"))
    w = create_worker(cls, ctx, (cfg,), kw)
    w.init_model()
    return w


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _driver(path, tmp):
    def drive(g):
        actor, critic, rm, actor2 = g["actor"], g["critic"], g["rm"], g["actor2"]
        for w in (actor, critic, rm, actor2):
            w.init_model()
        raw = make_batch(8, 6, 5, seed=4)
        # its own generator: the global one is shared with rank 0's worker thread, whose
        # init_model may still be drawing the value head (the critic's clip test was flaky)
        returns = torch.randn(8, 5, generator=torch.Generator().manual_seed(3))
        raw["returns"] = returns * raw["response_mask"]
        batch = Batch(raw, meta={"temperature": 0.8})
        res = {}
        old = actor.compute_log_prob(batch, calc_entropy=True)
        res["sharded"] = all(actor.all_sharded())
        ref = actor.compute_ref_log_prob(batch)
        values = critic.compute_values(batch)
        scores = rm.compute_rm_score(batch)
        full = batch | old | ref | values

        # the same on one process; reorder rows so mini-batches hold the same rows as the
        # 2-rank run (rank r holds rows 4r..4r+3; each mini-batch takes 2 from each rank)
        la = local_worker(ActorRolloutRefWorker, actor_cfg(path, 4))
        lc = local_worker(CriticWorker, critic_cfg(path, 4))
        ref_old = la.compute_log_prob(batch, calc_entropy=True)
        res["logp_err"] = max_diff(old.tensors, ref_old.tensors)
        # the same weights through the same forward: bitwise expected; rtol 1e-5 is slack
        res["ref_eq_old"] = torch.allclose(ref["ref_log_prob"], old["old_log_probs"])
        res["values_err"] = max_diff(values.tensors, lc.compute_values(batch).tensors)
        rm_model = load_hf(path, head="score")
        with torch.no_grad():
            res["rm_err"] = (scores["rm_scores"] - forward_scores(rm_model, raw)).abs().max().item()
        res["rm_nonzero"] = int((scores["rm_scores"] != 0).sum())

        order = [0, 1, 4, 5, 2, 3, 6, 7]
        m = actor.update_actor(full)
        m_ref = la.update_actor(full[order])
        c = critic.update_critic(full)
        c_ref = lc.update_critic(full[order])
        res["metrics"], res["metrics_ref"] = m, m_ref
        res["cmetrics"], res["cmetrics_ref"] = c, c_ref
        # the reference stays frozen while the actor moves
        res["ref_frozen"] = torch.equal(actor.compute_ref_log_prob(batch)["ref_log_prob"],
                                        ref["ref_log_prob"])
        new_old = actor.compute_log_prob(batch)["old_log_probs"]
        res["actor_moved"] = (new_old - old["old_log_probs"]).abs().max().item()

        # checkpoint, then one more update; a fresh worker loads it and repeats that update
        actor.save_checkpoint(f"{tmp}/ckpt_actor", extra={"sampler": 7})
        critic.save_checkpoint(f"{tmp}/ckpt_critic")
        export_hf(f"{tmp}/ckpt_actor", f"{tmp}/hf_after_1")
        full2 = full | Batch({"advantages_": torch.zeros(8)})  # a second batch: new advantages
        full2.tensors["advantages"] = -full.tensors["advantages"]
        actor.update_actor(full2)
        actor.save_checkpoint(f"{tmp}/ckpt_a")
        res["extra"] = actor2.load_checkpoint(f"{tmp}/ckpt_actor")
        actor2.update_actor(full2)
        actor2.save_checkpoint(f"{tmp}/ckpt_b")
        export_hf(f"{tmp}/ckpt_a", f"{tmp}/hf_a")
        export_hf(f"{tmp}/ckpt_b", f"{tmp}/hf_b")
        a, b = load_hf(f"{tmp}/hf_a").state_dict(), load_hf(f"{tmp}/hf_b").state_dict()
        res["resume_bitwise"] = all(torch.equal(a[k], b[k]) for k in a)
        res["resume_moved"] = max_diff(a, load_hf(f"{tmp}/hf_after_1").state_dict())
        res["params_err"] = max_diff(load_hf(f"{tmp}/hf_after_1").state_dict(),
                                     la.actor.state_dict())
        res["moved"] = max_diff(la.actor.state_dict(), load_hf(path).state_dict())
        return res
    return drive


def _run(rank, world, path, tmp):
    roles = {
        "actor": Role(CheckedActor, (actor_cfg(path, 1),)),
        "actor2": Role(ActorRolloutRefWorker, (actor_cfg(path, 1),)),
        "critic": Role(CriticWorker, (critic_cfg(path, None, max_tokens=20),)),
        "rm": Role(RewardModelWorker, (RewardModelConfig(model=RLModelConfig(path=path)),)),
    }
    return run(_driver(path, tmp), roles, ControllerConfig(timeout_s=120))


def test_workers_two_ranks_vs_one_process_checkpoint_resume_export(tmp_path):
    model = init_weights(build_model(ModelArgs(**ARGS), "lm"), seed=5)
    path = str(save_hf(model, tmp_path / "model"))
    res = spawn_ranks(_run, 2, path, str(tmp_path), timeout_s=240)[0]
    assert res["sharded"]
    assert res["logp_err"] < 1e-5  # sharded sums; |lp| < 5 (ulp 4.8e-7): 20+ ulp
    assert res["ref_eq_old"]
    assert res["ref_frozen"] and res["actor_moved"] > 1e-4
    assert res["values_err"] < 1e-5  # values and scores |x| < 1: 80+ ulp
    assert res["rm_err"] < 1e-5 and res["rm_nonzero"] == 8
    m, m_ref = res["metrics"], res["metrics_ref"]
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/kl_loss", "actor/grad_norm", "actor/lr", "actor/kl_coef"):
        # metrics of sums in another order: 1e-5 relative (absolute below 1) is ~80 ulp
        assert abs(m[k] - m_ref[k]) <= 1e-5 * max(1.0, abs(m_ref[k])), (k, m[k], m_ref[k])
    for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        c, cr = res["cmetrics"][k], res["cmetrics_ref"][k]
        assert abs(c - cr) <= 1e-5 * max(1.0, abs(cr)), (k, c, cr)
    assert res["cmetrics"]["critic/vf_clipfrac"] > 0  # the clipped branch was exercised
    assert res["moved"] > 1e-3
    # an AdamW step: a few ulp of |w| <= 1, more for a gradient that is rounding noise (below
    # Adam's eps, e.g. k_proj.bias in the next test), which Adam amplifies; 1e-5 is ~80 ulp
    assert res["params_err"] < 1e-5, res["params_err"]
    assert res["extra"] == {"sampler": 7}
    assert res["resume_moved"] > 1e-4
    assert res["resume_bitwise"]


def test_one_step_update_uses_its_own_log_probs(tmp_path):
    """meta old_log_probs='update': no old-log-prob pass; the update equals the one with
    recomputed old log-probs (ratio 1 either way), and a multi-step update refuses it."""
    model = init_weights(build_model(ModelArgs(**ARGS), "lm"), seed=5)
    path = str(save_hf(model, tmp_path / "model"))
    cfg = actor_cfg(path, 4)
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs = 8, 1
    batch = Batch(make_batch(8, 6, 5, seed=4), meta={"temperature": 0.8})
    a, b = local_worker(ActorRolloutRefWorker, cfg), local_worker(ActorRolloutRefWorker, cfg)
    full = batch | a.compute_log_prob(batch) | a.compute_ref_log_prob(batch)
    own = Batch({k: v for k, v in full.tensors.items() if k != "old_log_probs"},
                meta={**full.meta, "old_log_probs": "update"})
    m_a, m_b = a.update_actor(full), b.update_actor(own)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        # old log-probs from another micro-batching: rounding only; 1e-5 relative is ~80 ulp
        assert abs(m_a[k] - m_b[k]) <= 1e-5 * max(1.0, abs(m_a[k])), (k, m_a[k], m_b[k])
    assert m_b["actor/ppo_kl"] == 0.0 and m_b["actor/pg_clipfrac"] == 0.0
    # k_proj.bias has zero gradient in exact arithmetic (it adds one constant to every score of
    # a query, which softmax ignores), so its gradient is rounding noise (~3e-10) that Adam
    # turns into steps of any size up to lr: left out (as in test_shared_prompt). The other
    # weights: one AdamW step from gradients equal to rounding, a few ulp of |w| < 1 (~1e-7)
    a_state, b_state = ({k: v for k, v in w.actor.state_dict().items() if not k.endswith("k_proj.bias")}
                        for w in (a, b))
    print(f"one-step vs recomputed old log-probs: max param diff {max_diff(a_state, b_state):.2e}")
    assert max_diff(a_state, b_state) < 1e-6
    assert max_diff(a.actor.state_dict(), load_hf(path).state_dict()) > 1e-4  # it moved
    cfg.actor.ppo_epochs = 2
    two = local_worker(ActorRolloutRefWorker, cfg)
    import pytest
    with pytest.raises(ValueError, match="takes 2 optimizer steps"):
        two.update_actor(own)


@pytest.mark.parametrize("kl_type", ["low_var_kl", "kl"])
def test_actor_kl_loss_by_hand(tmp_path, kl_type):
    """``actor/kl_loss`` is the token mean of ``k(log_prob, ref_log_prob)`` with the policy's
    log-prob first: the reference is moved away from the policy (by 0.2-0.5 per token), so
    swapped arguments change the figure (k1 flips its sign, k3 is asymmetric)."""
    model = init_weights(build_model(ModelArgs(**ARGS), "lm"), seed=5)
    path = str(save_hf(model, tmp_path / "model"))
    cfg = actor_cfg(path, 8)
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs = 8, 1   # one step: log_prob == old
    cfg.actor.kl_loss_type = kl_type
    actor = local_worker(ActorRolloutRefWorker, cfg)
    batch = Batch(make_batch(8, 6, 5, seed=4), meta={"temperature": 0.8})
    batch |= actor.compute_log_prob(batch)
    shift = 0.2 + 0.3 * torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    ref = batch["old_log_probs"] - shift                                  # policy > reference
    batch.tensors["ref_log_prob"] = ref
    mask = batch["response_mask"].bool()
    d = shift[mask].double()                                               # log_prob - ref
    want = (d if kl_type == "kl" else torch.exp(-d) - 1 + d).mean().item()
    got = actor.update_actor(batch)["actor/kl_loss"]
    # the update's forward and compute_log_prob pack other micro-batches: their log-probs
    # differ by fp32 rounding (~1e-7 at these logits); a swap moves the figure by >= 0.01
    assert got == pytest.approx(want, abs=1e-5), (got, want)
