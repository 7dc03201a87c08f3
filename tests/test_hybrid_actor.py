"""The hybrid actor through the controller (gloo): generate_sequences with resharding.

* update -> generate -> update -> generate: the engine always uses the newest weights
  (greedy tokens equal ``LLM`` on the full weights gathered at that step);
* ``rollout_log_probs`` and ``compute_log_prob`` on the same sampled responses each within
  fp32 rounding of a float64 forward of the gathered weights, and so within twice that of
  each other (t = 1, 2; see ``test_generate_update_generate``);
* sampling streams depend on (seed, step, uid, sample index) only (another step draws
  other samples, the same step the same ones);
* meta overrides and the output format;
* with t = 2 on 4 ranks, training is not duplicated: the update equals a one-process
  reference on the same global batch.
"""

import numpy as np
import pytest
import torch

from minihf.controller import Dispatch, Role, register, run
from minihf.controller.config import ControllerConfig
from minihf.protocol import Batch
from minihf.workers.optim import OptimConfig
from minihf.testing import spawn_ranks
from minihf.workers.actor import ActorRolloutRefWorker
from minihf.workers.config import (ActorConfig, ActorRolloutRefConfig, RLModelConfig,
                                   RolloutConfig)

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.algorithms import logprob_rounding_bound
from test_rollout_engine import build_tiny


class Actor(ActorRolloutRefWorker):
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def full_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.actor, options=opts)

    @staticmethod
    def reference_state(path) -> dict:
        from minihf.models import load_hf

        return load_hf(path).state_dict()


def config(path, tp, rows):
    return ActorRolloutRefConfig(
        model=RLModelConfig(path=path),
        actor=ActorConfig(ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=2,
                          log_prob_micro_batch_size_per_gpu=3,
                          optim=OptimConfig(lr=5e-2, warmup_steps=0)),
        rollout=RolloutConfig(tensor_model_parallel_size=tp, prompt_length=6, response_length=8,
                              temperature=0.7, seed=3))


def prompts(n=6, width=6, seed=0):
    """Left-padded prompts of different lengths, uid per row."""
    g = torch.Generator().manual_seed(seed)
    lens = [(i % width) + 1 for i in range(n)]
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, L in enumerate(lens):
        ids[i, width - L:] = torch.randint(1, 100, (L,), generator=g)
        mask[i, width - L:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    uids = np.array([f"p{i}" for i in range(n)], dtype=object)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, {"uid": uids})


def greedy_reference(path, state, batch, length):
    from minihf.models import load_hf
    from minihf.rollout import LLM, SamplingParams

    model = load_hf(path)
    model.load_state_dict(state)
    llm = LLM(model, max_num_seqs=4)
    ps = [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=length))
    return [o.outputs[0].token_ids for o in outs]


def responses_of(out):
    return [r[m.bool()].tolist() for r, m in zip(out["responses"], out["response_mask"])]


def train_batch(gen, seed):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(gen["response_mask"].shape, generator=g) * gen["response_mask"]
    return gen.select("input_ids", "attention_mask", "position_ids", "responses",
                      "response_mask") | Batch({"advantages": adv}, meta=dict(gen.meta))


def _driver(path, results):
    from minihf.models import load_hf

    def drive(g):
        actor = g["actor"]
        actor.init_model()
        batch = prompts()
        # update -> generate (greedy) -> compare with LLM on the gathered weights, twice
        for step in range(2):
            greedy = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors,
                                                    {"do_sample": False, "global_step": step}))
            results[f"greedy_ok_{step}"] = responses_of(greedy) == greedy_reference(
                path, actor.full_state(), batch, 8)
            old = actor.compute_log_prob(greedy)
            actor.update_actor(train_batch(greedy, step) | old)
        # sampled rollout: its log-probs vs the trainer's at the same temperature
        sampled = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors, {"global_step": 5}))
        old = actor.compute_log_prob(sampled, calc_bound=True)
        m = sampled["response_mask"].bool()
        engine, trainer = sampled["rollout_log_probs"], old["old_log_probs"]
        results["logp_diff"] = (trainer - engine)[m].abs().max().item()
        model = load_hf(path)
        model.load_state_dict(actor.full_state())
        exact, scale = float64_log_probs(model, sampled.tensors, 0.7)
        results["ratio"] = {"engine": rounding_ratio(engine, exact, scale, m),
                            "trainer": rounding_ratio(trainer, exact, scale, m),
                            "pair": rounding_ratio(engine, trainer, scale, m, pairwise=True)}
        # the actor's own bound (rollout.check_log_probs) from its sharded fp32 forward: the
        # same scale as the float64 one (to fp32 rounding of a 64-term sum, ~1e-6 relative)
        want = 2 * logprob_rounding_bound(scale)
        got = old["log_prob_bound"].double()
        results["bound_rel_err"] = ((got - want).abs() / want)[m].max().item()
        results["bound_zero_on_padding"] = bool((got[~m] == 0).all())
        # top-k / top-p sampling: the engine reports the full softmax's log-prob, as the
        # trainer computes it, so the two still agree within rounding (a renormalised
        # engine log-prob would sit -log(kept mass) above, ~1e-2 or more)
        cut = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors,
                                             {"global_step": 6, "top_k": 3, "top_p": 0.8}))
        cut_old = actor.compute_log_prob(cut, calc_bound=True)
        cm = cut["response_mask"].bool()
        results["truncated_ratio"] = ((cut["rollout_log_probs"] - cut_old["old_log_probs"]).abs()
                                      / cut_old["log_prob_bound"])[cm].max().item()
        results["meta"] = dict(sampled.meta)
        results["shapes"] = {k: tuple(v.shape) for k, v in sampled.tensors.items()}
        ids_ok = torch.equal(sampled["input_ids"], torch.cat([batch["input_ids"], sampled["responses"]], 1))
        last = batch["position_ids"][:, -1:]
        pos_ok = torch.equal(sampled["position_ids"][:, 6:], last + torch.arange(1, 9))
        results["format_ok"] = ids_ok and pos_ok and torch.equal(sampled["prompts"], batch["input_ids"])
        # streams: the same prompt under two uids differs; the same (uid, index) in another
        # row (and so another replica) draws the same tokens; n samples of a uid differ
        same = prompts(4)
        same.tensors["input_ids"][:] = same["input_ids"][0]
        same.tensors["attention_mask"][:] = same["attention_mask"][0]
        same.tensors["position_ids"][:] = same["position_ids"][0]
        a = responses_of(actor.generate_sequences(Batch(same.tensors, same.non_tensors, {"global_step": 7})))
        flipped = same[np.array([3, 2, 1, 0])]
        b = responses_of(actor.generate_sequences(Batch(flipped.tensors, flipped.non_tensors,
                                                        {"global_step": 7})))
        results["uids_differ"] = len({tuple(r) for r in a}) == 4
        # the step seeds the streams: step 8 draws other samples, step 7 again the same ones
        again = [responses_of(actor.generate_sequences(Batch(same.tensors, same.non_tensors,
                                                             {"global_step": s})))
                 for s in (7, 8)]
        results["step_seeds"] = again[0] == a and all(x != y for x, y in zip(again[1], a))
        results["rows_do_not_matter"] = a == b[::-1]
        c = actor.generate_sequences(Batch(same[np.array([0])].tensors, same[np.array([0])].non_tensors,
                                           {"global_step": 7, "n": 3, "response_length": 5}))
        rc = responses_of(c)
        results["rc"], results["a0"] = rc, a[0]
        results["n_samples"] = (len(rc) == 3 and rc[0] == a[0][:5] and len({tuple(r) for r in rc}) == 3
                                and c["responses"].shape[1] == 5
                                and list(c.non_tensors["uid"]) == ["p0"] * 3)
        v = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors,
                                           {"validate": True, "global_step": 9}))
        results["validate_is_greedy"] = responses_of(v) == greedy_reference(path, actor.full_state(), batch, 8)
        return results
    return drive


def _actor_rank(rank, world, path, tp):
    import torch.distributed as dist  # noqa: F401

    results = {}
    out = run(_driver(path, results), {"actor": Role(Actor, (config(path, tp, 6),))},
              ControllerConfig(timeout_s=120))
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_actor")
    build_tiny("llama", root / "llama", heads=4, kv_heads=2)
    return str(root / "llama")


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_update_generate(llama_dir, tp):
    """Log-probs: the engine's and the trainer's are each checked against a float64 forward
    of the same weights and tokens, within ``logprob_rounding_bound`` (256 fp32 unit
    roundoffs u times ``logit_abs_scale`` at that token; derived in its docstring), not
    against each other with a fixed absolute tolerance. The fixed 1e-5 failed on an Intel
    Xeon at t = 2 (1.0014e-5; t = 1: 3.3e-6; AMD hosts: 3.1e-6). Where that gap comes from,
    measured on an AMD Zen 4 host: the logits are large here (init std 0.2, lr 5e-2, T =
    0.7: ``|z/T|`` up to 15, ``logit_abs_scale`` up to ~40), so 1e-5 is only ~4 u of scale.
    Each side sits within 10 u of scale of float64, at t = 1 and t = 2 alike: the
    row-parallel partial sums and the all-reduce add no systematic error. Changing only
    MKL's kernels (``MKL_CBWR=COMPATIBLE``) moved the t = 2 gap from 3.3e-6 to 9.5e-6, engine
    6.5e-6 and trainer 4.1e-6 from float64 with opposite signs. So the Intel figure is two
    correct fp32 forwards rounding apart: the tolerance was wrong, not the engine."""
    res = spawn_ranks(_actor_rank, 2, llama_dir, tp, timeout_s=300)[0]
    ratio = res["ratio"]
    print(f"t={tp}: rollout vs trainer log-prob max diff {res['logp_diff']:.2e}; worst token in "
          f"units of the rounding bound: engine {ratio['engine']:.2f}, trainer "
          f"{ratio['trainer']:.2f}, pair {ratio['pair']:.2f}")
    assert res["greedy_ok_0"] and res["greedy_ok_1"]
    assert max(ratio.values()) <= 1, ratio
    assert res["bound_rel_err"] < 1e-4 and res["bound_zero_on_padding"], res["bound_rel_err"]
    assert res["truncated_ratio"] <= 1, res["truncated_ratio"]
    assert res["format_ok"], res["shapes"]
    assert res["shapes"]["responses"] == (6, 8) and res["shapes"]["input_ids"] == (6, 14)
    assert res["meta"]["temperature"] == 0.7 and res["meta"]["timing_s/gen"] > 0
    assert "timing_s/gen_pack" not in res["meta"]  # the tiny model's weights: none packed
    assert res["uids_differ"] and res["rows_do_not_matter"] and res["step_seeds"]
    assert res["n_samples"], (res["rc"], res["a0"])
    assert res["validate_is_greedy"]


def _tp2_rank(rank, world, path):
    from test_workers import actor_cfg, local_worker, make_batch, max_diff

    def drive(g):
        actor = g["actor"]
        actor.init_model()
        raw = make_batch(8, 6, 5, seed=4, vocab=128)
        batch = Batch(raw, meta={"temperature": 0.8})
        full = batch | actor.compute_log_prob(batch) | actor.compute_ref_log_prob(batch)
        la = local_worker(ActorRolloutRefWorker, actor_cfg(path, 1))  # no rollout: updates only
        # rank r holds rows 2r, 2r+1; mini-batch k takes row k of every rank
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        m, m_ref = actor.update_actor(full), la.update_actor(full[order])
        state = actor.full_state()
        return {"metrics": m, "metrics_ref": m_ref,
                "params_err": max_diff(state, la.actor.state_dict()),
                "moved": max_diff(la.actor.state_dict(), Actor.reference_state(path))}

    cfg = actor_cfg(path, 1)
    cfg.rollout = RolloutConfig(tensor_model_parallel_size=2, prompt_length=6, response_length=8)
    return run(drive, {"actor": Role(Actor, (cfg,))}, ControllerConfig(timeout_s=120))


def test_tp2_training_is_not_duplicated(llama_dir):
    """4 ranks, rollout TP 2: every rank trains its own rows (DP 4), and the update equals
    the one-process reference on the same global batch."""
    res = spawn_ranks(_tp2_rank, 4, llama_dir, timeout_s=300)[0]
    m, m_ref = res["metrics"], res["metrics_ref"]
    for k in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert abs(m[k] - m_ref[k]) <= 1e-5 * max(1.0, abs(m_ref[k])), (k, m[k], m_ref[k])
    assert res["moved"] > 1e-3
    assert res["params_err"] < 1e-5, res["params_err"]
