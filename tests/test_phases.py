"""The RL step as phases: estimator specs, plug-in hooks, the role table, the renaming proxy.
The built-in plug-ins' results are checked where their algorithms are (test_recipes,
test_safe); here, the machinery, on the driver alone (test_ppo's scripted actor)."""

import pytest
import torch

from minihf.config import ConfigError
from minihf.protocol import Batch
from test_ppo import ScriptedActor, job_config

REMAX_LIKE = '''
import torch

def baseline_gap(token_level_rewards, reward_baselines, response_mask, scale=2.0):
    """A ReMax-like estimator from a recipe file: (score - greedy score) x scale."""
    adv = (token_level_rewards.sum(-1) - reward_baselines)[:, None] * scale * response_mask
    return adv, adv

def needs_values(token_level_rewards, response_mask, values, gamma=1.0):
    return values, values
'''


def test_estimator_spec_from_signature_and_declared():
    from minihf.algorithms import ADV_ESTIMATORS, adv_estimator_needs, register_adv_est

    assert adv_estimator_needs("gae") == {"values"}
    assert adv_estimator_needs("remax") == {"reward_baselines"}
    assert adv_estimator_needs("grpo") == frozenset()

    @register_adv_est("test_declared", needs=["values"])
    def declared(token_level_rewards, response_mask, values=None):  # optional, yet declared
        return token_level_rewards, token_level_rewards
    try:
        assert adv_estimator_needs("test_declared") == {"values"}
    finally:
        del ADV_ESTIMATORS["test_declared"]
    with pytest.raises(ValueError, match=r"\['critic'\] are not inputs a step can produce"):
        register_adv_est("test_bad", needs=["critic"])


def test_recipe_estimator_spec_decides_roles_and_plugins(tiny_job, tmp_path):  # noqa: F811
    """Read from the file without running it; a ReMax-like estimator gets the baseline
    rollout, one that reads values a critic (or an error naming the key)."""
    from minihf.trainer.plugins import RewardBaseline, plugin_classes
    from minihf.trainer.ppo import PPOTrainer

    model, data = tiny_job
    (tmp_path / "est.py").write_text(REMAX_LIKE + "\nraise SystemExit('config checks must not run me')\n")
    cfg = job_config(model, data, tmp_path / "a", "grpo",
                     **{"algorithm.adv_estimator": f"{tmp_path}/est.py:baseline_gap"})
    assert cfg.adv_needs == {"reward_baselines"} and not cfg.critic.enable
    assert RewardBaseline in plugin_classes(cfg)
    cfg = job_config(model, data, tmp_path / "b", "grpo",
                     **{"algorithm.adv_estimator": f"{tmp_path}/est.py:needs_values"})
    assert cfg.critic.enable
    with pytest.raises(ConfigError, match=r"adv_estimator=.*est.py:needs_values reads values, which "
                                          r"need a critic; set critic.enable=true"):
        job_config(model, data, tmp_path / "c", "grpo",
                   **{"algorithm.adv_estimator": f"{tmp_path}/est.py:needs_values",
                      "critic.enable": "false"})
    # run a step: the scripted actor's greedy and sampled responses are the same, so every
    # sample's score equals its baseline and the advantages are exactly 0
    (tmp_path / "est.py").write_text(REMAX_LIKE)
    cfg = job_config(model, data, tmp_path / "d", "grpo",
                     **{"algorithm.adv_estimator": f"{tmp_path}/est.py:baseline_gap"})
    actor = ScriptedActor()
    m = PPOTrainer(cfg, {"actor": actor}, log=lambda *a: None).train_step(1)
    b = actor.updated
    assert "timing_s/gen_max" in m and b["reward_baselines"].shape == (len(b),)
    assert torch.equal(b["reward_baselines"], b["token_level_scores"].sum(-1))
    assert b["advantages"].eq(0).all()


class Marks:
    """A plug-in that records what it saw, for the hook tests."""

    def __init__(self):
        self.seen = []


def make_plugin(hooks_fn, **attrs):
    from minihf.trainer.phases import Plugin

    return type("Probe", (Plugin,), {"hooks": lambda self: hooks_fn(self), **attrs})


def test_hooks_add_wrap_replace_and_alongside(tiny_job, tmp_path):  # noqa: F811
    from minihf.trainer.phases import Call, Phase, after, alongside, apply_hooks, before, replace, wrap
    from minihf.trainer.ppo import PPOTrainer

    model, data = tiny_job
    cfg = job_config(model, data, tmp_path / "run", "grpo")
    trainer = PPOTrainer(cfg, {"actor": ScriptedActor()}, log=lambda *a: None)
    order = []

    def note(name):
        def run(ctx, batch, m):
            order.append(name)
            m[f"probe/{name}"] = ctx.step
        return run

    def wrapper(ctx, batch, m, inner):
        order.append("wrap<")
        inner(ctx, batch, m)
        order.append(">wrap")

    probe = make_plugin(lambda self: [before("gen", Phase("pre", note("pre"))),
                                      after("reward", Phase("post", note("post"))),
                                      wrap("adv", wrapper),
                                      replace("samples", Phase("samples", note("samples"), timed=False)),
                                      alongside("ref", Call("probe_call", "actor", "compute_ref_log_prob"))])
    trainer.plugins = [probe(trainer.ctx)]
    trainer.program = apply_hooks(trainer.phases(), trainer.plugins)
    m = trainer.train_step(3)
    assert order == ["pre", "post", "samples", "wrap<", ">wrap"]
    assert m["probe/samples"] == m["probe/pre"] == m["probe/post"] == 3  # a round's metrics join the step's
    assert "timing_s/pre" in m and "timing_s/post" in m and "timing_s/probe_call" in m
    assert "timing_s/samples" not in m                           # untimed, as declared

    bad = make_plugin(lambda self: [after("nope", Phase("x", note("x")))])
    with pytest.raises(ValueError, match=r"plug-in Probe \(.*test_phases.py:Probe\): no phase 'nope' to "
                                         r"after; phases: \['gen', "):
        apply_hooks(trainer.phases(), [bad(trainer.ctx)])
    bad = make_plugin(lambda self: [wrap("values", wrapper)])
    with pytest.raises(ValueError, match="'values' is a remote call sent with others"):
        apply_hooks(trainer.phases(), [bad(trainer.ctx)])
    bad = make_plugin(lambda self: [alongside("adv", Call("x", "actor", "update_actor"))])
    with pytest.raises(ValueError, match="'adv' is not a remote call"):
        apply_hooks(trainer.phases(), [bad(trainer.ctx)])


def test_role_table_names_are_unique():
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.roles import RoleDef, role_table
    from minihf.config import load_config

    clash = make_plugin(lambda self: [], roles=(RoleDef("critic", "CriticWorker", "critic"),))
    with pytest.raises(ValueError, match=r"roles \['critic'\] are defined twice"):
        role_table(load_config(PPOJobConfig, "grpo", []), [clash])


class FakeCall:
    def __init__(self):
        self.got = None

    def __call__(self, batch):
        self.got = batch
        return Batch({"values": torch.ones(2)})

    def future(self, batch):
        self.got = batch
        return type("F", (), {"result": lambda self, timeout=None: {"critic/vf_loss": 1.0, "other": 2}})()


def test_renamed_proxy_maps_keys_in_and_out():
    from minihf.controller.group import Renamed

    group = type("G", (), {"compute_values": FakeCall(), "dp_size": 3})()
    proxy = Renamed(group, inputs={"values": "cost_values", "returns": "cost_returns"},
                    outputs={"values": "cost_values", "critic/": "cost_critic/"})
    batch = Batch({"values": torch.zeros(2), "cost_values": torch.full((2,), 5.0), "x": torch.zeros(2)})
    out = proxy.compute_values(batch)
    seen = group.compute_values.got
    assert torch.equal(seen["values"], torch.full((2,), 5.0))
    assert "returns" not in seen and "x" in seen                 # no cost_returns: no returns at all
    assert list(out.tensors) == ["cost_values"]
    assert proxy.compute_values.future(batch).result() == {"cost_critic/vf_loss": 1.0, "other": 2}
    assert proxy.dp_size == 3


NOT_A_PLUGIN = '''
class Loose:
    pass
'''

WITH_CONFIG = '''
from dataclasses import dataclass
from minihf.trainer.phases import Plugin

@dataclass
class Settings:
    coef: float = 1.0

class Tuned(Plugin):
    name = "tuned"
    Config = Settings

class Plain(Plugin):
    pass
'''


def test_recipe_plugins_roles_and_their_errors(tiny_job, tmp_path):  # noqa: F811
    """Plug-ins and roles from recipe files, and every bad value named in one line."""
    from minihf.trainer.phases import StepContext
    from minihf.trainer.plugins import plugin_classes
    from minihf.trainer.ppo_job import check_paths, ppo_roles

    model, data = tiny_job
    (tmp_path / "loose.py").write_text(NOT_A_PLUGIN)
    (tmp_path / "tuned.py").write_text(WITH_CONFIG)
    tuned = f"{tmp_path}/tuned.py"
    cfg = job_config(model, data, tmp_path / "a", "grpo", **{
        "algorithm.plugins": f"[{tuned}:Tuned, {tuned}:Plain]",
        "algorithm.plugin_config": "{tuned: {coef: 0.5}}",
        "roles": f"{{judge: {{model: {{path: {model}}}}}}}"})
    classes = plugin_classes(cfg)
    assert [c.key() for c in classes] == ["tuned", "Plain"]
    ctx = StepContext(cfg, {}, None, None, None, print, None, None, None, None)
    assert classes[0](ctx).config.coef == 0.5 and classes[1](ctx).config is None
    assert list(ppo_roles(cfg)) == ["actor", "judge"]
    assert ppo_roles(cfg)["judge"].worker_cls.__name__ == "LogProbWorker"

    def fails(match, **kw):
        with pytest.raises((ConfigError, ValueError, TypeError), match=match):
            c = job_config(model, data, tmp_path / "b", "grpo", **kw)
            for cls in plugin_classes(c):
                cls(StepContext(c, {}, None, None, None, print, None, None, None, None))
            check_paths(c)
    fails(r"algorithm.plugins\[0\]=.*loose.py:Gone.*has no plug-in class 'Gone'",
          **{"algorithm.plugins": f"[{tmp_path}/loose.py:Gone]"})
    fails(r"algorithm.plugins\[0\]=.*loose.py:Loose' is not a Plugin subclass",
          **{"algorithm.plugins": f"[{tmp_path}/loose.py:Loose]"})
    fails(r"algorithm.plugin_config has settings for \['other'\], which do not run",
          **{"algorithm.plugin_config": "{other: {x: 1}}"})
    fails(r"unknown key 'algorithm.plugin_config.tuned.coeff'; did you mean 'coef'",
          **{"algorithm.plugins": f"[{tuned}:Tuned]", "algorithm.plugin_config": "{tuned: {coeff: 1}}"})
    fails(r"algorithm.plugin_config.Plain: plug-in Plain takes no settings",
          **{"algorithm.plugins": f"[{tuned}:Plain]", "algorithm.plugin_config": "{Plain: {x: 1}}"})
    fails(r"roles.judge: worker='LogProbWorkr' is not a worker class; did you mean 'LogProbWorker'",
          roles=f"{{judge: {{worker: LogProbWorkr, model: {{path: {model}}}}}}}")
    fails(r"roles.judge: model.path is not set", roles="{judge: {}}")
    fails(r"roles.judge.model.path='nowhere' has no config.json .* prepare.role_recipes.judge",
          roles="{judge: {model: {path: nowhere}}}")
    fails(r"prepare.role_recipes.judge: the config has no roles.judge section",
          **{"prepare.role_recipes": "{judge: grpo}"})


MY_ACTOR = '''
from minihf.workers import ActorRolloutRefWorker, CriticWorker


class CountingActor(ActorRolloutRefWorker):
    """update_actor wrapped (no @register: it keeps the library method's dispatch and reads):
    the library's update, then a figure of its own."""

    def update_actor(self, batch):
        metrics = super().update_actor(batch)
        self.calls = getattr(self, "calls", 0) + 1
        return {**metrics, "mine/update_calls": float(self.calls), "mine/rows": float(len(batch))}


class NotAnActor(CriticWorker):
    pass
'''


def test_a_recipe_names_the_actor_class_and_plugins_replace_core_rows(tiny_job, tmp_path):  # noqa: F811
    from minihf.trainer.phases import Plugin
    from minihf.trainer.ppo_job import ppo_roles
    from minihf.roles import RoleDef, role_table
    from minihf.testing import spawn_ranks
    from test_ppo import _runs

    model, data = tiny_job
    (tmp_path / "mine.py").write_text(MY_ACTOR)
    mine = f"{tmp_path}/mine.py"
    cfg = job_config(model, data, tmp_path / "a", "grpo", **{"actor_rollout_ref.worker": f"{mine}:CountingActor"})
    assert ppo_roles(cfg)["actor"].worker_cls.__name__ == "CountingActor"
    hist = spawn_ranks(_runs, 1, model, data, str(tmp_path), [
        ("mine", "grpo", None, "mine", {"actor_rollout_ref.worker": f"{mine}:CountingActor"})], timeout_s=300)[0]
    steps = [h for h in hist["mine"] if h["step"] > 0]
    assert [h["mine/update_calls"] for h in steps] == [1.0, 2.0, 3.0] and steps[0]["mine/rows"] == 8.0
    assert "actor/pg_loss" in steps[0]                                  # the library's update ran
    with pytest.raises(ValueError, match=r"worker .*mine.py:NotAnActor must subclass minihf.workers.ActorRolloutRefWorker"):
        ppo_roles(job_config(model, data, tmp_path / "b", "grpo", **{"actor_rollout_ref.worker": f"{mine}:NotAnActor"}))
    with pytest.raises((ConfigError, ValueError), match=r"worker='CriticWorker': name ActorRolloutRefWorker, or a subclass"):
        job_config(model, data, tmp_path / "b", "grpo", **{"actor_rollout_ref.worker": "CriticWorker"})
    with pytest.raises((ConfigError, ValueError), match=r"worker: .*mine.py has no worker class 'Gone'"):
        job_config(model, data, tmp_path / "b", "grpo", **{"actor_rollout_ref.worker": f"{mine}:Gone"})

    class Replacing(Plugin):
        roles = [RoleDef("actor", f"{mine}:CountingActor", "actor_rollout_ref", trains="actor_rollout_ref.actor",
                         checkpointed=True, replaces=True)]

    class Clashing(Plugin):
        roles = [RoleDef("actor", f"{mine}:CountingActor", "actor_rollout_ref")]

    class Nothing(Plugin):
        roles = [RoleDef("judge", "LogProbWorker", "roles.judge", replaces=True)]

    plain = job_config(model, data, tmp_path / "c", "grpo")
    table = role_table(plain, [Replacing])
    assert [r.name for r in table].count("actor") == 1
    assert next(r for r in table if r.name == "actor").worker_class().__name__ == "CountingActor"
    with pytest.raises(ValueError, match=r"roles \['actor'\] are defined twice"):
        role_table(plain, [Clashing])
    with pytest.raises(ValueError, match=r"plug-in role 'judge' replaces a core role, but there is none"):
        role_table(plain, [Nothing])


def test_a_phase_that_returns_something_else_is_named():
    """A phase's return: a dict failed in the next phase ("'dict' object has no attribute
    'tensors'"), a batch of no rows (a rejection that kept nothing) at cutting micro-batches."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from minihf.protocol import Batch
    from minihf.trainer.phases import Phase, PluginError, run_phases

    batch = Batch({"x": torch.zeros(4, 2)})
    ctx = SimpleNamespace(timed=lambda name: contextlib.nullcontext())
    keep = Phase("keep", lambda c, b, m: None, timed=False)
    half = Phase("half", lambda c, b, m: b[[0, 1]])
    assert len(run_phases(ctx, [keep, half], batch, {})) == 2
    for phase, says in ((Phase("judge", lambda c, b, m: {"x": 1}), "phase 'judge' returned dict {'x': 1}; return the batch"),
                        (Phase("reject", lambda c, b, m: b[[]]), "phase 'reject' returned a batch of no rows")):
        with pytest.raises(PluginError, match=says):
            run_phases(ctx, [keep, phase], batch, {})
    assert len(run_phases(ctx, [Phase("reject", lambda c, b, m: b[[]])], batch, {}, rows_needed=False)) == 0


def test_a_plugin_calling_a_role_the_job_cannot_have_is_named():
    """A Call to a role that is not in the job is skipped (a ref in a job without one); to
    a role no job of this config can have (the docs' judge without its roles.judge section)
    it was skipped too, and a later phase failed on the keys it never produced."""
    from types import SimpleNamespace

    from minihf.trainer.phases import Call, Phase, Plugin, PluginError, Together, alongside, apply_hooks

    class Judge(Plugin):
        name = "judge"

        def hooks(self):
            return [alongside("ref", Call("judge", "judge", "compute_log_prob"))]
    program = {"step": [Phase("rollout", lambda c, b, m: None), Together((Call("ref", "actor", "compute_ref"),))]}
    ctx = SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(plugin_config={})))
    with pytest.raises(PluginError, match=r"plug-in judge .*: calls role 'judge', which no job of this config has "
                                          r"\(known roles: \['actor', 'critic'\]\); add a roles.judge section"):
        apply_hooks(program, [Judge(ctx)], {"actor", "critic"})
    applied = apply_hooks(program, [Judge(ctx)], {"actor", "critic", "judge"})
    assert [c.role for c in applied["step"][1].calls] == ["actor", "judge"]
