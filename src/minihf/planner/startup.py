"""The planner's memory model at an RL job's start-up: the job's own placement, checked.

On CUDA, before any role loads a model, ``check_memory`` estimates the peak memory per
device of the configured plan (``cost.estimate``: resident fp32 shards, the largest of
generation's engine weights and KV cache, a training micro-batch's gathered unit,
activations and logits, a forward's) and refuses a job whose peak exceeds the device's
memory, naming the group, the numbers and the keys that lower it. The plan is read from the
config as the job will run it: roles sharing ranks form a group (``controller.placement``),
the rollout TP size, and each role's micro-batch in rows (a token budget counts as that many
full-length rows). ``trainer.memory_check=false`` turns it off (the model is an estimate).
"""

from __future__ import annotations

from minihf.config import ConfigError, section_of
from minihf.planner.cost import Group, Plan, estimate
from minihf.planner.job import workload
from minihf.planner.profiles import BUILTIN, DeviceProfile



def _micro_keys(role) -> tuple[str, str]:
    """The config keys of a role's micro-batch, in rows and as a token budget (its update's for
    a trained role): its role-table row's first of each (``minihf.roles``)."""
    _, micro, tokens = role.row_keys()
    return micro[0], tokens[0]


def configured_plan(cfg, world: int, w) -> Plan:
    """The plan ``cfg`` runs on ``world`` ranks: its groups, rollout TP and micro-batches."""
    from minihf.controller.config import resolve_placement

    names = [r.name for r in w.roles]
    layouts = resolve_placement(cfg.controller.placement, world, names)
    by_ranks: dict[tuple, list[str]] = {}
    for name in names:  # the actor first: its group is groups[0]
        by_ranks.setdefault(layouts[name].ranks, []).append(name)
    groups = tuple(Group(tuple(roles), ranks[0], len(ranks)) for ranks, roles in by_ranks.items())
    micro = []
    tokens = w.prompt_len + w.response_len
    for name in names:
        rows_key, budget_key = _micro_keys(w.role(name))
        budget = section_of(cfg, budget_key)
        micro.append((name, max(1, budget // tokens) if budget is not None else section_of(cfg, rows_key) or 1))
    return Plan(groups, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, tuple(micro))


def device_profile(device) -> DeviceProfile:
    """A profile for a CUDA ``device``: the built-in one its name matches, with the memory
    torch reports (only the memory and the compute dtype matter for the check)."""
    import dataclasses

    import torch

    props = torch.cuda.get_device_properties(device)
    known = next((p for key, p in BUILTIN.items() if key.split("-")[0] in props.name), None)
    memory = float(props.total_memory)
    if known is None:  # rates are placeholders: the check reads the memory alone
        return DeviceProfile(props.name, memory, 1e14, 1e12, 1e11, 1e10, source="torch.cuda")
    return dataclasses.replace(known, name=props.name, memory_bytes=memory)


def check_memory(cfg, world: int, profile: DeviceProfile) -> None:
    """Refuse ``cfg`` on ``world`` devices of ``profile`` when a group's predicted peak
    memory per device exceeds the device's; the message names the numbers and the keys.
    A standalone rollout (``controller.placement.rollout``) is not in the memory model (it
    models the engine on the actor's ranks): such a job is not checked."""
    if "rollout" in cfg.controller.placement:
        return
    w = workload(cfg)
    plan = configured_plan(cfg, world, w)
    e = estimate(w, plan, profile)
    if e.fits:
        return
    over = [(i, peak) for i, peak in e.peak_bytes.items() if peak > profile.memory_bytes]
    i, peak = max(over, key=lambda x: x[1])
    group = plan.groups[i]
    keys = []
    for r in group.roles:
        rows_key, budget_key = _micro_keys(w.role(r))
        budget = section_of(cfg, budget_key)
        keys.append(f"{budget_key} (now {budget})" if budget is not None
                    else f"{rows_key} (now {dict(plan.micro_batches)[r]})")
    raise ConfigError(
        f"predicted peak memory {peak / 1e9:.1f} GB per device for roles {list(group.roles)} on "
        f"{group.devices} device(s) exceeds the {profile.memory_bytes / 1e9:.1f} GB of a {profile.name} "
        f"(the planner's memory model, minihf.planner.cost); lower the micro-batches ({', '.join(keys)}), "
        "turn on <role>.fsdp.activation_checkpointing or param_offload, give the roles more devices "
        "(`minihf plan RECIPE --devices N --profile ...` ranks placements that fit), or skip this "
        "estimate with trainer.memory_check=false")
