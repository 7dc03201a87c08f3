"""Standalone rollout placement (``controller.placement.rollout``, docs/async.md) on 4
processes with the tiny model: the actor trains on ranks 0-1 while a TP-2 rollout engine
on ranks 2-3 generates, its weights sent point to point each step. Against the colocated
hybrid engine (the actor alone on ranks 0-1, TP 2: the same single replica), on the same
schedule (``async_training.staleness``), the samples and updates are the same (metrics
exactly, parameters bitwise), at k = 0 (synchronous) and k = 1. A standalone k = 1 run
stopped after step 2 and resumed equals the uninterrupted one. Each rollout rank receives
exactly its TP slice of every weight per sync (the plan's bytes, counted from the model's
shapes here), and the generation of step n + 1 overlaps step n's update (wall-clock
intervals recorded on the ranks)."""

import time

import pytest
import torch

from minihf.config import ConfigError
from minihf.testing import spawn_ranks
from test_ppo import final_params, job_config

COLOCATED = {"controller.placement": "{actor: {ranks: [0, 1]}}",
             "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
STANDALONE = {"controller.placement": "{actor: {ranks: [0, 1]}, rollout: {ranks: [2, 3]}}",
              "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
RUN = {"trainer.total_training_steps": 3, "trainer.save_freq": 2}


def _run(rank, world, model, data, tmp, cases):
    from minihf.controller import run
    from minihf.trainer.ppo_job import ppo_driver, ppo_roles
    from minihf.workers import ActorRolloutRefWorker, RolloutWorker

    log = []
    for cls, name in ((ActorRolloutRefWorker, "update_actor"), (RolloutWorker, "generate_sequences")):
        method = cls.__dict__[name]
        inner = method.fn

        def timed(self, *args, _inner=inner, _name=name, **kwargs):
            t0 = time.time()
            out = _inner(self, *args, **kwargs)
            log.append((rank, _name, t0, time.time()))
            return out
        method.fn = timed
    out = {}
    for name, stop, subdir, extra in cases:
        cfg = job_config(model, data, f"{tmp}/{subdir}", "grpo", **extra)
        log.clear()
        out[name] = (run(ppo_driver(cfg, stop_after=stop), ppo_roles(cfg), cfg.controller), list(log))
    return out


def strip(hist):
    """The metrics that depend on the samples and the updates, not on timing or placement."""
    return [{k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))} for h in hist]


def slice_bytes(model_dir, tp):
    """What one rollout rank of a TP-``tp`` engine holds: its slice of every weight (fp32),
    and with tied embeddings a vocab-parallel LM head's slice besides the whole embedding."""
    from minihf.models import load_hf
    from minihf.parallel.placement import tp_dim, vocab_parallel

    model = load_hf(model_dir)
    total = 0
    for name, p in model.named_parameters():
        d = tp_dim(name, tuple(p.shape), tp)
        total += p.numel() // (tp if d is not None else 1) * 4
    embed = model.model.embed_tokens.weight
    if model.args.tie_word_embeddings and vocab_parallel(embed.shape[0], tp):
        total += embed.numel() // tp * 4
    return total


LENGTH_REWARD = """\
def length(data_source, solution_str, ground_truth, extra_info):
    return len(solution_str) / 10.0
"""


def test_standalone_equals_colocated_and_resumes(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)  # scores that differ: advantages that do
    k1 = {**RUN, "async_training.staleness": 1, "custom_reward_function.path": str(tmp_path / "reward.py"),
          "custom_reward_function.name": "length"}
    k0 = {**k1, "async_training.staleness": 0}
    cases = [("colocated0", None, "colocated0", {**COLOCATED, **k0}),
             ("standalone0", None, "standalone0", {**STANDALONE, **k0}),
             ("colocated", None, "colocated", {**COLOCATED, **k1}),
             ("standalone", None, "standalone", {**STANDALONE, **k1}),
             ("first", 2, "resumed", {**STANDALONE, **k1}), ("rest", None, "resumed", {**STANDALONE, **k1})]
    res = spawn_ranks(_run, 4, model, data, str(tmp_path), cases, timeout_s=900)
    hist = {name: res[0][name][0] for name, *_ in cases}
    assert strip(hist["standalone0"]) == strip(hist["colocated0"])  # synchronous: the hybrid engine's run
    assert strip(hist["standalone"]) == strip(hist["colocated"])
    assert strip(hist["standalone"]) != strip(hist["standalone0"])  # k = 1 trains on other samples
    assert strip(hist["first"] + hist["rest"]) == strip(hist["standalone"])
    a = final_params(tmp_path / "colocated0", 3)
    assert all(torch.equal(a[k], b[k]) for b in [final_params(tmp_path / "standalone0", 3)] for k in a)
    a = final_params(tmp_path / "colocated", 3)
    for other in ("standalone", "resumed"):
        b = final_params(tmp_path / other, 3)
        assert all(torch.equal(a[k], b[k]) for k in a), other
    steps = [h for h in hist["standalone"] if h["step"] > 0]
    assert [h["async/staleness/max"] for h in steps] == [0, 1, 1]
    assert all(h["actor/pg_loss"] != 0 for h in steps)
    # a sync whenever the weights changed before a generation: none at step 1 (step 0's
    # validation synced the initial weights, nothing trained since), then each step
    want = slice_bytes(model, 2)
    assert [h.get("perf/weight_sync_bytes") for h in steps] == [None, want, want]
    assert all(h["timing_s/busy/actor"] > 0 and h["timing_s/idle/actor"] >= 0 for h in steps)
    # the rollout generates at steps 1 (the batches of steps 1 and 2) and 2 (step 3's), not at 3
    assert [h["timing_s/busy/rollout"] > 0 for h in steps] == [True, True, False]
    # the rollout's generate of step n + 1 runs while the actor's ranks update at step n
    logs = [x for r in res for x in r["standalone"][1]]
    gens = [x for x in logs if x[1] == "generate_sequences"]
    updates = [x for x in logs if x[1] == "update_actor"]
    assert any(g[2] < u[3] and u[2] < g[3] for g in gens for u in updates), logs


def adapter_slice_bytes(model_dir, tp, rank, targets):
    """What one rollout rank of a TP-``tp`` engine holds of the adapters (fp32)."""
    from minihf.models import build_model, load_args
    from minihf.models.lora import apply_lora, is_lora_param, module_names
    from minihf.parallel.placement import tp_dim

    model = build_model(load_args(model_dir), "lm", device="meta")
    apply_lora(model, rank, 2.0 * rank, module_names(model, targets))
    return sum(p.numel() // (tp if tp_dim(n, tuple(p.shape), tp) is not None else 1) * 4
               for n, p in model.named_parameters() if is_lora_param(n))


def test_lora_actor_on_a_standalone_rollout(tiny_job, tmp_path):  # noqa: F811
    """A LoRA actor: the base weights reach the rollout once, the adapters at every sync; the
    run equals the colocated one (metrics, parameters bitwise)."""
    model, data = tiny_job
    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    lora = {**RUN, "async_training.staleness": 1, "custom_reward_function.path": str(tmp_path / "reward.py"),
            "custom_reward_function.name": "length", "actor_rollout_ref.model.lora_rank": 4,
            "actor_rollout_ref.model.lora_alpha": 8, "actor_rollout_ref.model.target_modules": "[q_proj,up_proj]"}
    cases = [("colocated", None, "colocated", {**COLOCATED, **lora}),
             ("standalone", None, "standalone", {**STANDALONE, **lora})]
    res = spawn_ranks(_run, 4, model, data, str(tmp_path), cases, timeout_s=900)
    hist = {name: res[0][name][0] for name, *_ in cases}
    assert strip(hist["standalone"]) == strip(hist["colocated"])
    from safetensors.torch import load_file

    from minihf.hub import export_hf

    for run in ("colocated", "standalone"):  # a LoRA run exports its adapters (PEFT)
        export_hf(tmp_path / run / "global_step_3", tmp_path / f"{run}_adapter")
    a, b = (load_file(str(tmp_path / f"{r}_adapter" / "adapter_model.safetensors"))
            for r in ("colocated", "standalone"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [h for h in hist["standalone"] if h["step"] > 0]
    want = adapter_slice_bytes(model, 2, 4, ["q_proj", "up_proj"])
    assert [h.get("perf/weight_sync_bytes") for h in steps] == [None, want, want]  # step 0 sent the base


def test_bad_standalone_placements(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    for placement, says in (
            ("{rollout: {ranks: [1]}}", r"controller.placement.actor: a standalone rollout needs ranks "
                                        r"of its own, but the actor is not placed"),
            ("{actor: {ranks: [0, 1]}, rollout: {ranks: [1, 2]}}",
             r"controller.placement.rollout.ranks=\[1, 2\] overlaps controller.placement.actor.ranks=\[0, 1\] on \[1\]"),
            ("{actor: {ranks: [0]}, rollout: {ranks: all}}", r"controller.placement.rollout.ranks: .* it runs on all ranks")):
        with pytest.raises(ConfigError, match=says):
            job_config(model, data, tmp_path, "grpo", **{"controller.placement": placement})
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 does not divide the 3 rollout ranks "
                                          r"\[1, 2, 3\] \(controller.placement.rollout.ranks\); use one of \[1, 3\]"):
        job_config(model, data, tmp_path, "grpo", **{
            "controller.placement": "{actor: {ranks: [0]}, rollout: {ranks: [1, 2, 3]}}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2})


def test_layouts_of_a_standalone_rollout(tiny_job, tmp_path):  # noqa: F811
    """The rollout TP size splits the rollout's ranks, not the actor's (which builds no
    engine): actor on rank 0, a TP-2 rollout on ranks 1-2."""
    from minihf.controller.config import resolve_placement
    from minihf.controller.setup import role_layouts, role_links
    from minihf.trainer.ppo_job import ppo_roles

    model, data = tiny_job
    cfg = job_config(model, data, tmp_path, "grpo", **{
        "controller.placement": "{actor: {ranks: [0]}, rollout: {ranks: [1, 2]}}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2})
    roles = ppo_roles(cfg)
    layouts = role_layouts(roles, resolve_placement(cfg.controller.placement, 3, roles=list(roles)))
    assert layouts["rollout"]["rollout"].tp_size == 2 and layouts["actor"]["rollout"].tp_size == 1
    assert roles["actor"].kwargs["generates"] is False
    assert role_links(roles) == [("actor", "rollout")]


FAILING_REWARD = """\
calls = []


def flaky(data_source, solution_str, ground_truth, extra_info):
    calls.append(1)
    if len(calls) > 16:  # validation (8 prompts) and step 1's batch (4 x 2) pass; the batch made ahead fails
        raise ValueError("boom in the reward")
    return 0.0
"""


def _fails(rank, world, model, data, tmp):
    from minihf.controller import run
    from minihf.trainer.ppo_job import ppo_driver, ppo_roles

    cfg = job_config(model, data, f"{tmp}/run", "grpo", **{
        **STANDALONE, "async_training.staleness": 1, "custom_reward_function.path": f"{tmp}/reward.py",
        "custom_reward_function.name": "flaky"})
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def test_error_in_the_batch_made_ahead_ends_the_job(tiny_job, tmp_path, capfd):  # noqa: F811
    """A reward that raises while the batch of step 2 is made in the driver's thread (step 1
    training meanwhile) ends the whole job with the reward's error, on every rank."""
    from minihf.testing import SpawnError

    model, data = tiny_job
    (tmp_path / "reward.py").write_text(FAILING_REWARD)
    t0 = time.time()
    with pytest.raises(SpawnError, match="boom in the reward") as e:
        spawn_ranks(_fails, 4, model, data, str(tmp_path), timeout_s=300)
    assert time.time() - t0 < 120
    assert "reward function 'flaky' raised on sample 0" in str(e.value)
    out = capfd.readouterr().out
    assert "step=0 " in out and "step=1 " not in out  # step 1 never finished: the thread's error ended it
