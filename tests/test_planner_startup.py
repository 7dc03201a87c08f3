"""The planner at a job's start-up: the configured plan read from the job's own keys, the
memory check that refuses a job too large for its devices, and the roles of recipes and
plug-ins in both."""

from dataclasses import replace

import pytest

from minihf.planner import estimate, plan_overrides

from test_planner import _a100


def test_start_up_memory_check_reads_the_configured_plan(tmp_path):
    """The job's own placement, TP and micro-batches (rows, or a token budget as full rows),
    estimated as ``minihf plan`` would; a device too small refuses the job in one message
    naming the group, the numbers and the keys; one large enough passes."""
    from minihf.config import ConfigError, load_config
    from minihf.hub import init_model
    from minihf.planner.startup import check_memory, configured_plan
    from minihf.trainer.ppo_job import PPOJobConfig

    model = init_model(tmp_path / "m", size="tiny", task="sort")
    cfg = load_config(PPOJobConfig, "ppo", [
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        "controller.placement={actor: {ranks: [0, 1]}, critic: {ranks: [2, 3]}}",
        "actor_rollout_ref.actor.max_tokens_per_micro_batch=88",
        "critic.max_tokens_per_micro_batch=null", "critic.ppo_micro_batch_size_per_gpu=3"])
    from minihf.planner import workload

    w = workload(cfg)
    plan = configured_plan(cfg, 4, w)
    assert [(g.roles, g.first_rank, g.devices) for g in plan.groups] == [(("actor",), 0, 2), (("critic",), 2, 2)]
    assert dict(plan.micro_batches) == {"actor": 88 // (24 + 20), "critic": 3}   # the recipe's 24 + 20 tokens
    small = replace(_a100(), memory_bytes=1e6)
    with pytest.raises(ConfigError, match=r"predicted peak memory [\d.]+ GB per device for roles \['actor'\] on 2 "
                                          r"device\(s\) exceeds the 0.0 GB of a A100-80GB .*"
                                          r"actor_rollout_ref.actor.max_tokens_per_micro_batch \(now 88\).*"
                                          r"trainer.memory_check=false"):
        check_memory(cfg, 4, small)
    check_memory(cfg, 4, _a100())   # a tiny model on 80 GB: fits
    # a standalone rollout is not in the memory model: not checked (no unknown-role error)
    cfg = load_config(PPOJobConfig, "grpo", [
        f"actor_rollout_ref.model.path={model}", "controller.placement={actor: {ranks: [0, 1]}, rollout: {ranks: [2]}}"])
    check_memory(cfg, 3, small)


def test_a_recipe_role_is_planned_and_memory_checked(tmp_path):
    """A recipe's ``roles.<name>`` (a teacher) is in the workload, the configured plan, the
    estimate (a forward over the step's batch, counted as ``ref``: it is sent alongside the
    reference) and the memory check, with its own keys, as the role table declares."""
    from minihf.config import ConfigError, load_config
    from minihf.hub import init_model
    from minihf.planner import workload
    from minihf.planner.startup import check_memory, configured_plan
    from minihf.trainer.ppo_job import PPOJobConfig

    model = init_model(tmp_path / "m", size="tiny", task="sort")
    base = [f"actor_rollout_ref.model.path={model}", "controller.placement={actor: {ranks: [0, 1]}}"]
    plain = load_config(PPOJobConfig, "grpo", base)
    cfg = load_config(PPOJobConfig, "grpo", base + [
        f"roles={{teacher: {{model: {{path: {model}}}, log_prob_micro_batch_size_per_gpu: 5}}}}",
        "controller.placement={actor: {ranks: [0, 1]}, teacher: {ranks: [2]}}"])
    w, w0 = workload(cfg), workload(plain)
    assert [r.name for r in w.roles] == ["actor", "teacher"] and not w.role("teacher").trains
    assert w.role("teacher").model == w.role("actor").model       # the same checkpoint, an LM head
    plan = configured_plan(cfg, 3, w)
    assert [(g.roles, g.first_rank, g.devices) for g in plan.groups] == [(("actor",), 0, 2), (("teacher",), 2, 1)]
    assert dict(plan.micro_batches)["teacher"] == 5
    e, e0 = estimate(w, plan, _a100()), estimate(w0, configured_plan(plain, 2, w0), _a100())
    assert e.phases["ref"] > e0.phases["ref"] and len(e.peak_bytes) == 2
    keys = plan_overrides(plan, 3, w)
    assert keys["roles.teacher.log_prob_micro_batch_size_per_gpu"] == 5 and keys["controller.placement.teacher.ranks"] == [2]
    # the teacher's group alone too large: a micro-batch of 4096 rows, on a device between the peaks
    big = load_config(PPOJobConfig, "grpo", base + [
        f"roles={{teacher: {{model: {{path: {model}}}, log_prob_micro_batch_size_per_gpu: 4096}}}}",
        "controller.placement={actor: {ranks: [0, 1]}, teacher: {ranks: [2]}}"])
    wb = workload(big)
    peaks = estimate(wb, configured_plan(big, 3, wb), _a100()).peak_bytes
    assert peaks[1] > 2 * peaks[0], peaks
    with pytest.raises(ConfigError, match=r"for roles \['teacher'\] on 1 device\(s\) .*"
                                          r"roles.teacher.log_prob_micro_batch_size_per_gpu \(now 4096\)"):
        check_memory(big, 3, replace(_a100(), memory_bytes=(peaks[0] + peaks[1]) / 2))
    check_memory(big, 3, replace(_a100(), memory_bytes=peaks[1] * 1.01))


PLUGIN_ROLE = '''
from minihf.roles import RoleDef
from minihf.trainer.phases import Plugin


class WithScorer(Plugin):
    name = "scorer"
    roles = (RoleDef("scorer", "RewardModelWorker", "reward_model", head="score", forward="scores",
                     micro_keys=("reward_model.micro_batch_size_per_gpu",),
                     token_keys=("reward_model.max_tokens_per_micro_batch",)),)

    def hooks(self):
        return []
'''


def test_a_plugins_role_and_a_trained_recipe_role_are_planned(tmp_path):
    """A recipe plug-in's ``roles`` row is in the workload with its own keys and kind, and a
    ``roles.<name>`` with ``train.enable`` is planned as trained (its optimizer, its update's
    micro-batch keys first), so the start-up memory check counts both."""
    from minihf.config import load_config
    from minihf.hub import init_model
    from minihf.planner import workload
    from minihf.planner.startup import configured_plan
    from minihf.trainer.ppo_job import PPOJobConfig

    model = init_model(tmp_path / "m", size="tiny", task="sort")
    (tmp_path / "mine.py").write_text(PLUGIN_ROLE)
    base = [f"actor_rollout_ref.model.path={model}", f"reward_model.model.path={model}",
            "reward_model.micro_batch_size_per_gpu=3"]
    cfg = load_config(PPOJobConfig, "grpo", base + [f"algorithm.plugins=[{tmp_path}/mine.py:WithScorer]"])
    w = workload(cfg)
    assert [r.name for r in w.roles] == ["actor", "scorer"] and w.role("scorer").row_keys()[0] == "scores"
    plan = configured_plan(cfg, 2, w)
    assert dict(plan.micro_batches)["scorer"] == 3
    w0 = workload(load_config(PPOJobConfig, "grpo", base))
    e0 = estimate(w0, configured_plan(load_config(PPOJobConfig, "grpo", base), 2, w0), _a100())
    assert estimate(w, plan, _a100()).phases["reward"] > e0.phases.get("reward", 0.0)
    prm = load_config(PPOJobConfig, "prime", base + [f"roles.prm.model.path={model}",
                                                     "roles.prm.train.ppo_micro_batch_size_per_gpu=2",
                                                     "roles.prm.train.max_tokens_per_micro_batch=null"])
    wp = workload(prm)
    assert [r.name for r in wp.roles] == ["actor", "prm"] and wp.role("prm").trains
    assert wp.role("prm").mini_batch == 64
    assert dict(configured_plan(prm, 2, wp).micro_batches)["prm"] == 2
    frozen = load_config(PPOJobConfig, "distill", base + [f"roles.teacher.model.path={model}"])
    one = estimate(wp, configured_plan(prm, 2, wp), _a100()).peak_bytes[0]
    assert one > estimate(workload(frozen), configured_plan(frozen, 2, workload(frozen)), _a100()).peak_bytes[0]


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA L40S"])
def test_the_device_profile_of_a_known_and_an_unknown_gpu(monkeypatch, name):
    """A GPU a built-in profile names gets its rates; any other gets placeholders (the start-up
    check reads the memory alone): both with the memory torch reports."""
    from types import SimpleNamespace

    import torch

    from minihf.planner.profiles import BUILTIN
    from minihf.planner.startup import device_profile

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=48 * 2**30))
    profile = device_profile(0)
    assert profile.name == name and profile.memory_bytes == 48 * 2**30
    assert (profile.flops == BUILTIN["H200"].flops) == (name == "NVIDIA H200")
