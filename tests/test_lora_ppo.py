"""The RL job with LoRA (2 gloo ranks, the main job's digits task on the tiny model):
GRPO with a LoRA actor stopped after step 2 of 4 and resumed equals the uninterrupted run
(adapters bitwise, metrics exactly); every sync after the first moves the adapters only;
PPO with a LoRA actor and a LoRA critic runs; bad LoRA keys fail at start-up naming them."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minihf.config import ConfigError
from minihf.models import build_model, load_args
from minihf.models.lora import apply_lora, module_names
from minihf.testing import spawn_ranks

from test_ppo import _runs, job_config

LORA = {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
        "actor_rollout_ref.actor.optim.lr": 1e-2}


def adapter_bytes(model_dir, rank=8) -> int:
    model = build_model(load_args(model_dir), "lm", device="meta")
    apply_lora(model, rank, 16.0, module_names(model, "all-linear"))
    return sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n)


def test_lora_grpo_resume_and_ppo_with_lora_critic(tiny_job, tmp_path):
    from minihf.hub import export_hf

    model, data = tiny_job
    extra = {**LORA, "trainer.total_training_steps": 4, "trainer.save_freq": 2}
    critic = {**LORA, "critic.model.lora_rank": 4, "critic.model.target_modules": "[q_proj,v_proj]"}
    cases = [("full", "grpo_lora", None, "full", extra), ("first", "grpo_lora", 2, "resumed", extra),
             ("rest", "grpo_lora", None, "resumed", extra), ("ppo", "ppo", None, "ppo", critic)]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=600)[0]

    def strip(h):  # (a resumed engine syncs every weight once more: perf/reshard_bytes differs)
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))}
    assert [strip(h) for h in res["full"]] == [strip(h) for h in res["first"] + res["rest"]]
    for run in ("full", "resumed"):
        export_hf(tmp_path / run / "global_step_4", tmp_path / f"{run}_adapter")
    a, b = (load_file(str(tmp_path / f"{r}_adapter" / "adapter_model.safetensors"))
            for r in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [h for h in res["full"] if h["step"] > 0]
    # the validation before step 1 synced every weight; each step after moves the adapters
    # only: half of them reach each rank (2 ranks, rollout TP 1)
    assert all(h["perf/reshard_bytes"] == adapter_bytes(model) // 2 for h in steps), steps
    assert steps[-1]["actor/grad_norm"] > 0 and "actor/kl_loss" in steps[-1]
    ckpt = tmp_path / "full" / "global_step_4" / "actor"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == 8 and meta["lora"]["base"] == str(Path(model).resolve())
    # the checkpoint holds the adapters alone, model and optimizer state (AdamW: 2 moments each)
    from torch.distributed.checkpoint import FileSystemReader

    def stored(sub):
        md = FileSystemReader(str(ckpt / sub)).read_metadata().state_dict_metadata
        return {k: v for k, v in md.items() if hasattr(v, "size") and len(v.size) == 2}
    weights = stored("model")
    assert all(".lora_" in k for k in weights)
    assert sum(math.prod(v.size) * 4 for v in weights.values()) == adapter_bytes(model)
    moments = stored("optim")
    assert all(".lora_" in k for k in moments) and len(moments) == 2 * len(weights)
    ppo = [h for h in res["ppo"] if h["step"] > 0]
    assert len(ppo) == 3 and all("critic/vf_loss" in h for h in ppo)
    critic_meta = json.loads((tmp_path / "ppo" / "global_step_3" / "critic" / "meta.json").read_text())
    assert critic_meta["lora"]["target_modules"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("override,message", [
    ({"actor_rollout_ref.model.target_modules": "[q_proj,lm_head]"},
     "actor_rollout_ref.model.target_modules: 'lm_head' names no adaptable module"),
    ({"actor_rollout_ref.model.exclude_modules": "[qproj]"},
     "actor_rollout_ref.model.exclude_modules: 'qproj'"),
    ({"actor_rollout_ref.model.lora_adapter_path": "nowhere"},
     "actor_rollout_ref.model.lora_adapter_path='nowhere' is not a PEFT adapter dir"),
])
def test_bad_lora_keys_fail_at_start(tiny_job, tmp_path, override, message):
    from minihf.trainer.ppo_job import check_paths

    model, data = tiny_job
    cfg = job_config(model, data, tmp_path / "out", "grpo", **LORA, **override)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        check_paths(cfg)


def test_lora_config_errors(tiny_job, tmp_path):
    model, data = tiny_job
    with pytest.raises(ConfigError, match="free_base_weights frees a LoRA actor's base"):
        job_config(model, data, tmp_path, "grpo", **{"actor_rollout_ref.rollout.free_base_weights": True})
    with pytest.raises(ConfigError, match="actor_rollout_ref.model: lora_adapter_path set but lora_rank=0"):
        job_config(model, data, tmp_path, "grpo", **{"actor_rollout_ref.model.lora_adapter_path": "x"})


def test_planner_counts_the_adapters_alone(tiny_job, tmp_path):
    from minihf.planner.cost import Group, resident_bytes
    from minihf.planner.job import workload

    model, data = tiny_job
    full = workload(job_config(model, data, tmp_path, "grpo"))
    lora = workload(job_config(model, data, tmp_path, "grpo", **LORA))
    actor = lora.role("actor")
    assert actor.lora_params == adapter_bytes(model) // 4 and full.role("actor").lora_params is None
    group, p = Group(("actor",), 0, 2), actor.model.params
    # grpo uses a reference: a copy of the weights without LoRA, the base itself with it
    assert resident_bytes(full, group) == (16 * p + 4 * p) / 2
    assert resident_bytes(lora, group) == (4 * p + 12 * actor.lora_params) / 2


@pytest.mark.slow
def test_main_job_learns_with_lora(tmp_path):
    """The main job with a LoRA policy (``recipe=grpo_lora``) from scratch in an empty dir:
    measured 0.35 -> 0.79, 0.76 and 0.80 with three seeds in ~250 s on a 2-core AMD EPYC
    (Zen 4; full parameters: 0.89), so it must gain >= 0.2 and end >= 0.6 within 10 minutes.
    (At the recipe's former 3x higher learning rate the same host reached 0.51.)"""
    from test_controller_launch import run_main_job

    before, after, elapsed, log = run_main_job(tmp_path, "recipe=grpo_lora")
    print(f"main job with LoRA: validation {before:.3f} -> {after:.3f} in {elapsed:.0f}s")
    assert after - before >= 0.2 and after >= 0.6 and elapsed <= 600, log
