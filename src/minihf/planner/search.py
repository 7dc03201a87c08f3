"""Enumerate placements of an RL job on N devices, estimate each, rank them.

The candidates (HybridFlow's Algorithm 1, over minihf's knobs):
1. role groups: the actor, its rollout and its reference are one hybrid group; every other
   role (critic, reward model, cost model, cost critic) joins it or another group: every
   set partition of the roles (Bell(k) of them for k roles);
2. devices per group: every way to give the groups N devices, each at least one, or each a
   multiple of ``unit`` devices (the groups get contiguous ranks, the actor's group first);
3. per group: FSDP over all its devices; for the actor's group each rollout TP size that
   divides its devices and the model's query and KV heads; per trained role the largest
   power-of-two micro-batch (rows per device) up to its share of a mini-batch that fits in
   memory (1 if none does; such a plan is then infeasible).
Each candidate is estimated with ``cost.estimate``; those whose predicted peak memory
exceeds a device are counted as infeasible and dropped. The placements grow as
C(N - 1, groups - 1): a search past ``MAX_PLACEMENTS`` of them is refused before it starts
(``check_size`` names the ``--unit`` that fits), and a long one reports its progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from minihf.planner.cost import Estimate, Group, Plan, estimate
from minihf.planner.job import Workload
from minihf.planner.profiles import DeviceProfile


def set_partitions(items: list) -> Iterator[list[list]]:
    """Every partition of ``items`` into non-empty blocks (Bell(len(items)) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ``parts``-tuple of positive integers summing to ``total`` (C(total-1, parts-1))."""
    if parts == 1:
        if total >= 1:
            yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first,) + rest


def tp_options(devices: int, heads: int, kv_heads: int) -> list[int]:
    top = min(devices, heads, kv_heads)  # a TP size divides the heads: no need to try past them
    return [t for t in range(1, top + 1) if devices % t == 0 and heads % t == 0 and kv_heads % t == 0]


def _micro_options(rows_per_device: int) -> list[int]:
    """Powers of two up to ``rows_per_device``, largest first."""
    top = max(1, rows_per_device)
    return [1 << k for k in range(int(math.log2(top)), -1, -1)]


def groupings(w: Workload) -> Iterator[list[tuple[str, ...]]]:
    """Role groups, the actor's first."""
    others = [r.name for r in w.roles if r.name != "actor"]
    for part in set_partitions(others):
        for i in range(len(part) + 1):  # the block (if any) that joins the actor
            if i == len(part):
                yield [("actor",)] + [tuple(b) for b in part]
            else:
                yield [("actor", *part[i])] + [tuple(b) for j, b in enumerate(part) if j != i]


# Placements (role groups x device counts) a search may enumerate. Most are refused at once
# by the batch sizes (ppo_rm on 256 devices: 33,151 placements, 99.7% refused, searched in
# ~5 s); the others are estimated, up to ~50 ms each with their micro-batches fitted, and a
# long search reports its progress. A count past the bound is refused before it starts.
MAX_PLACEMENTS = 100_000
PROGRESS_EVERY = 1000


def placement_count(w: Workload, units: int) -> int:
    """Placements ``search`` enumerates on ``units`` groups of devices: per role grouping
    of g groups, C(units - 1, g - 1) ways to size them (before the rollout TP sizes)."""
    return sum(math.comb(units - 1, len(g) - 1) for g in groupings(w))


def check_size(w: Workload, devices: int, unit: int = 1) -> None:
    """A ValueError when ``devices / unit`` gives more than ``MAX_PLACEMENTS`` placements,
    naming the count, the bound and the ``--unit`` that fits."""
    units = devices // unit
    count = placement_count(w, units)
    if count <= MAX_PLACEMENTS:
        return
    lo, hi = 1, units  # the most units within the bound (the count grows with units)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if placement_count(w, mid) <= MAX_PLACEMENTS else (lo, mid - 1)
    raise ValueError(
        f"--devices {devices} --unit {unit}: {count:.3g} placements of the {len(w.roles)} roles "
        f"({', '.join(r.name for r in w.roles)}) to estimate, over the planner's bound of {MAX_PLACEMENTS:,} "
        f"(each may take ~50 ms); pass a --unit U that divides {devices} with {devices} / U <= {lo} (groups then "
        "take multiples of U devices, e.g. U = the node size)")


@dataclass
class SearchResult:
    ranked: list[Estimate]               # feasible plans, fastest first
    considered: int
    infeasible: int                      # predicted peak memory above a device's
    refused: int                         # a trained role's ppo_mini_batch_size does not split over its devices


def search(w: Workload, devices: int, profile: DeviceProfile, unit: int = 1,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Every candidate of ``w`` on ``devices``, groups sized in multiples of ``unit`` devices
    (1: any size; the node size on a large cluster, where sizes in between multiply the
    candidates without new shapes of plan). More than ``MAX_PLACEMENTS`` placements is a
    ValueError (``check_size``) before any is estimated; ``progress(done, total)`` is called
    every ``PROGRESS_EVERY`` placements (the CLI says how far a long search is)."""
    if devices < 1:
        raise ValueError(f"--devices {devices}: need at least 1")
    if unit < 1 or devices % unit:
        raise ValueError(f"--unit {unit} must be >= 1 and divide --devices {devices}")
    check_size(w, devices, unit)
    total, done = placement_count(w, devices // unit), 0
    actor = w.role("actor").model
    seen: set = set()
    ranked, considered, infeasible, refused = [], 0, 0, 0
    for grouping in groupings(w):
        if len(grouping) > devices // unit:
            continue
        for units in compositions(devices // unit, len(grouping)):
            done += 1
            if progress is not None and done % PROGRESS_EVERY == 0:
                progress(done, total)
            counts = [n * unit for n in units]
            first, groups = 0, []
            for roles, n in zip(grouping, counts):
                groups.append(Group(roles, first, n))
                first += n
            for t in tp_options(groups[0].devices, actor.heads, actor.kv_heads):
                plan = Plan(tuple(groups), t, ())
                key = (tuple((g.roles, g.devices) for g in groups), t)
                if key in seen:
                    continue
                seen.add(key)
                considered += 1
                if any(r.trains and r.mini_batch % plan.group_of(r.name).devices for r in w.roles):
                    refused += 1  # the job would refuse it (PPOConfig.check_sizes)
                    continue
                best = _fit_micro_batches(w, plan, profile)
                if best is None:
                    infeasible += 1
                else:
                    ranked.append(best)
    ranked.sort(key=lambda e: e.step_seconds)
    return SearchResult(ranked, considered, infeasible, refused)


def _fit_micro_batches(w: Workload, plan: Plan, profile: DeviceProfile) -> Estimate | None:
    """The plan with each role's largest micro-batch that fits (roles are sized in turn,
    the others at 1 row while one is sized), or None when even 1 row each does not fit."""
    micro = {r.name: 1 for r in w.roles}
    low = estimate(w, replace(plan, micro_batches=tuple(micro.items())), profile)
    if not low.fits:
        return None
    for role in w.roles:
        devices = plan.group_of(role.name).devices  # a micro-batch is cut from one device's mini-batch rows
        rows = math.ceil((role.mini_batch if role.trains else w.sequences) / devices)
        for m in _micro_options(rows):
            trial = replace(plan, micro_batches=tuple({**micro, role.name: m}.items()))
            if estimate(w, trial, profile).fits:
                micro[role.name] = m
                break
    return estimate(w, replace(plan, micro_batches=tuple(micro.items())), profile)


def plan_overrides(plan: Plan, devices: int, w: Workload | None = None) -> dict:
    """The plan as config keys ``train_ppo.py`` takes: placement, rollout TP, micro-batches
    (rows; or, for a role whose config cuts micro-batches by tokens, a token budget of
    that many full-length rows)."""
    out: dict = {"actor_rollout_ref.rollout.tensor_model_parallel_size": plan.rollout_tp}
    for g in plan.groups:
        for role in g.roles:
            out[f"controller.placement.{role}.ranks"] = "all" if g.devices == devices else g.ranks
    from minihf.roles import declared

    for role, m in plan.micro_batches:  # every key of the role's micro-batches (minihf.roles)
        _, micro, tokens = w.role(role).row_keys() if w is not None else ("", declared(role).micro_keys, ())
        if w is not None and w.role(role).token_budget:
            for key in tokens:
                out[key] = m * (w.prompt_len + w.response_len)
        else:
            for key in micro:
                out[key] = m
    return out


def describe(plan: Plan) -> str:
    """e.g. ``[actor,reward_model]x2 tp2 + [critic]x2``."""
    parts = [f"[{','.join(g.roles)}]x{g.devices}" + (f" tp{plan.rollout_tp}" if i == 0 else "")
             for i, g in enumerate(plan.groups)]
    return " + ".join(parts)
