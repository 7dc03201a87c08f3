"""The planner's cost and memory model: one RL step of a placement, phase by phase.

Notation, per role: ``P`` parameters, ``b`` bytes per element in the compute dtype (the
profile's ``bytes_per_param``), ``g`` the devices of the role's group (FSDP over all of
them), ``F`` the profile's achieved matmul FLOP/s, ``M`` its memory bandwidth, ``W`` the
collective bandwidth of the group (inside a node, or across nodes when the group spans
them). The step has ``S`` sequences (prompts x n) of ``Tp`` prompt and ``Tr`` response
tokens; a forward over the batch computes ``K`` tokens (``S (Tp + Tr)``, or with shared
prompts ``S/n Tp + S Tr``). Attention's own FLOPs (the ``T^2`` term) are left out: at the
lengths RL uses they are a few percent of ``2 P`` per token.

Phases (as the driver names them):
- ``gen``: generation replicas of TP ``t`` (``r = g_actor / t``), ``q = S / r`` sequences
  each. Prefill is compute-bound: ``2 P q Tp / (t F)``. Each of the ``Tr`` decode steps is
  bound by the slower of compute ``2 P q / (t F)`` and memory: the weights ``P b / t`` plus
  the KV cache read for ``q`` sequences at the mean context ``Tp + Tr/2``
  (``2 L d_kv b`` bytes per token, ``/ t``), over ``M``; TP adds two all-reduces of
  ``q h b`` per layer and step (``2 (t-1)/t`` of it received over ``W``, plus ``l`` each). When the KV cache
  of ``q`` full-length sequences does not fit beside everything else on the device, decode
  runs in waves of what fits.
- ``reshard``: the bytes one rank receives in ``hybrid/plan.py``'s plan (``traffic``) over ``W``,
  plus ``l`` per collective of the plan.
- forwards (``old_log_prob``, ``ref``, ``values``, reward-model ``reward``):
  ``max(2 P K / (g F), m (b P (g-1)/g / W + u l))``: FSDP all-gathers each micro-batch's
  weights (``m`` micro-batches per rank, ``u`` FSDP units: one per block and the root, or
  one) while computing; prefetching overlaps the two on a GPU, while on a CPU profile
  (``comm_overlaps_compute: false``: gloo's collectives run on the cores that compute) the
  two add up instead of taking the max, here and in the updates. ``l`` is the profile's
  latency of one collective.
- updates (``update_actor``, ``update_critic``): per epoch ``max(c P K / (g F), m ((2b + 4)
  P (g-1)/g / W + 3 u l))`` with ``c = 6`` (8 with activation checkpointing: the forward
  again) and per micro-batch two all-gathers and one fp32 reduce-scatter of every unit; plus per optimizer step the
  AdamW update, memory-bound: ``32 P / g`` bytes (read parameter, gradient and both
  moments, write parameter and moments, fp32) over ``M``.
- ``reward`` by a rule, and ``adv``: on the driver, taken as 0.

The step adds the phases up, except where the driver overlaps them: when every trained
role's group is disjoint from the others', ``ref`` runs with ``values`` and the updates
run together (``trainer/ppo.py``'s ``overlap``), so those pairs cost their maximum. Ranks
that share one host's cores (a measured CPU profile: ``host_cores``) are slowed by
``busy ranks x threads / cores`` when more threads than cores are busy in a phase: the
group's ranks, or both groups' in an overlapped phase.

Memory per device of a group: resident, each trained role's fp32 shards ``16 P / g``
(parameter, gradient, two AdamW moments; with LoRA ``(4 P + 12 A) / g`` for A adapter
parameters, and no reference copy: the reference is the base) and each frozen role's
``4 P / g`` (the actor's reference too); plus, at the phase's peak, the largest of: generation's engine weights
``P b / t`` and KV cache; a training micro-batch's gathered FSDP unit (two in flight, with
fp32 gradients), activations (``b (8 h + 3 ffn)`` per token and layer; ``b h`` with
activation checkpointing, plus one layer's full set) and the LM head's logits in fp32
(``12 V`` bytes per token: logits, log-softmax and its gradient); a forward micro-batch's
unit and logits.

Ulysses sequence parallelism (a role's ``ulysses_sequence_parallel_size`` ``s``): a rank
holds ``1/s`` of a micro-batch's tokens, so its activations and logits are ``1/s``; it takes
part in ``s`` times as many micro-batches (each gathering the FSDP units) and sends, per
layer and micro-batch, its tokens' query heads and the KV heads the other ranks read, and the
other ranks' tokens of its heads' attention output, through all-to-alls in each forward and
backward (``4 (s-1)/s`` of the hidden size per token with as many KV heads as query heads;
less with grouped-query attention). Compute is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minihf.planner.job import ModelShape, Role, Workload
from minihf.planner.profiles import DeviceProfile


@dataclass(frozen=True)
class Group:
    roles: tuple[str, ...]
    first_rank: int
    devices: int

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.devices))


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]            # groups[0] holds the actor (with its rollout and reference)
    rollout_tp: int
    micro_batches: tuple[tuple[str, int], ...]  # (role, rows per forward/backward per device)

    def group_of(self, role: str) -> Group:
        return next(g for g in self.groups if role in g.roles)

    def micro(self, role: str) -> int:
        return dict(self.micro_batches)[role]


def link_bandwidth(group: Group, profile: DeviceProfile) -> float:
    """A group inside one node uses the node's links; one spanning nodes, the network."""
    per = profile.devices_per_node
    same_node = group.first_rank // per == (group.first_rank + group.devices - 1) // per
    return profile.intra_node_bandwidth if same_node else profile.inter_node_bandwidth


def gathered(params: int, g: int, itemsize: float) -> float:
    """Bytes one rank receives when ``g`` ranks all-gather ``params`` elements."""
    return params * itemsize * (g - 1) / g


def units(role: Role) -> int:
    """FSDP units of a role's model: one per block and the root, or one."""
    return role.model.layers + 1 if role.wrap_blocks else 1


def sp_bytes(model: ModelShape, tokens: int, rows: int, micro: int, sp: int, b: float) -> float:
    """Bytes a rank sends in a forward's all-to-alls over a micro-batch (Ulysses, ``sp``
    ranks), the rank that sends the most: per layer, its tokens' query heads and the KV heads
    each other rank reads (:func:`minihf.parallel.ulysses.head_ranges`; a KV head may go to
    two ranks), then the other ranks' tokens of its own heads' attention output."""
    if sp == 1:
        return 0.0
    from minihf.parallel.ulysses import head_ranges

    ranges = head_ranges(model.heads, model.kv_heads, sp)

    def heads_sent(me: int) -> int:
        others = sum((b1 - a1) + 2 * (d1 - c1) for j, (a1, b1, c1, d1) in enumerate(ranges) if j != me)
        return others + (sp - 1) * (ranges[me][1] - ranges[me][0])
    per_rank = tokens / rows * micro / sp
    head_dim = model.kv_dim // model.kv_heads
    return model.layers * per_rank * head_dim * b * max(heads_sent(j) for j in range(sp))


def forward_seconds(model: ModelShape, tokens: int, rows: int, micro: int, g: int, link: float,
                    profile: DeviceProfile, fsdp_units: int = 1, sp: int = 1) -> float:
    """A forward over ``rows`` rows (``tokens`` in all) on ``g`` ranks, micro-batches of
    ``micro`` rows; with Ulysses (``sp``) an SP group runs each micro-batch together, so a rank
    takes part in ``sp`` times as many (each gathering the weights) plus their all-to-alls."""
    compute = 2 * model.active * tokens / (g * profile.flops)
    if g == 1:
        return compute
    steps = math.ceil(rows / (g // sp) / micro)
    comm = steps * (gathered(model.params, g, profile.bytes_per_param) / link + fsdp_units * profile.collective_latency
                    + sp_bytes(model, tokens, rows, micro, sp, profile.bytes_per_param) / link)
    return _together(compute, comm, profile)


def _together(compute: float, comm: float, profile: DeviceProfile) -> float:
    """Seconds of a phase that computes and communicates: overlapped (prefetching FSDP on a
    GPU), or one after the other (gloo's collectives run on the CPU cores that compute)."""
    return max(compute, comm) if profile.comm_overlaps_compute else compute + comm


def update_seconds(role: Role, micro: int, w: Workload, g: int, link: float, profile: DeviceProfile) -> float:
    p, b = role.model.params, profile.bytes_per_param
    # forward 2P, backward 4P per token (input and weight gradients); a frozen base (LoRA)
    # skips its weight gradients: 2P; recomputation adds a forward
    flops = (2 if role.activation_checkpointing else 0) + (6 if role.lora_params is None else 4)
    compute = flops * p * w.forward_tokens / (g * profile.flops)
    comm = 0.0
    if g > 1:  # per micro-batch: two all-gathers and a reduce-scatter of every unit (Ulysses:
        # sp times the micro-batches, and their all-to-alls forward, backward and recomputed)
        a2a = (3 if role.activation_checkpointing else 2) * sp_bytes(
            role.model, w.forward_tokens, w.sequences, micro, role.sp, b)
        comm = math.ceil(w.sequences / (g // role.sp) / micro) * (
            gathered(p, g, 2 * b + 4) / link + 3 * units(role) * profile.collective_latency + a2a / link)
    adamw = math.ceil(w.sequences / role.mini_batch) * 32 * role.trained_params / g / profile.memory_bandwidth
    return role.epochs * (_together(compute, comm, profile) + adamw)


def resident_bytes(w: Workload, group: Group) -> float:
    """Bytes each device of ``group`` holds between phases (fp32 shards)."""
    total = 0.0
    for name in group.roles:
        role = w.role(name)
        # fp32 weights, and gradient + two AdamW moments of what trains
        total += (4 * role.model.params + (12 * role.trained_params if role.trains else 0)) / group.devices
        if name == "actor" and w.use_ref and role.lora_params is None:  # LoRA: the base is the reference
            total += 4 * role.model.params / group.devices
    return total


def _unit(model: ModelShape, wrap_blocks: bool) -> int:
    return model.largest_block if wrap_blocks else model.params


def micro_batch_bytes(role: Role, micro: int, w: Workload, b: int, train: bool) -> float:
    """Transient bytes of one micro-batch of ``role`` (forward, or forward + backward)."""
    m = role.model
    tokens = math.ceil(micro * (w.prompt_len + w.response_len) / role.sp)  # this rank's (Ulysses: 1/sp)
    unit = _unit(m, role.wrap_blocks)
    # value and score heads: one output. An LM head's logits, their log-softmax and gradient
    # whole (3 fp32 buffers); in chunks, one chunk's logits and exponentials at a time (2)
    per = 8 if role.logits_chunk else 12
    logits = min(tokens, role.logits_chunk or tokens) * m.vocab * per if role.name == "actor" else 0
    if not train:
        return 2 * unit * b + tokens * m.hidden * b * 4 + logits / per * 4
    per_layer = b * (8 * m.hidden + 3 * m.ffn)
    acts = (tokens * m.layers * b * m.hidden + tokens * per_layer if role.activation_checkpointing
            else tokens * m.layers * per_layer)
    return 2 * unit * b + 4 * unit + acts + logits



def kv_capacity(w: Workload, plan: Plan, profile: DeviceProfile, resident: float) -> int:
    """Sequences of full length whose KV cache fits on one device of the actor's group
    beside the resident shards and the engine's weights."""
    m, t = w.role("actor").model, plan.rollout_tp
    free = profile.memory_bytes - resident - m.params * profile.bytes_per_param / t
    per_seq = (w.prompt_len + w.response_len) * m.kv_bytes_per_token(profile.bytes_per_param) / t
    return max(0, int(free // per_seq))


def generation_seconds(w: Workload, plan: Plan, profile: DeviceProfile) -> tuple[float, float]:
    """(seconds, peak transient bytes per device) of the ``gen`` phase."""
    group = plan.group_of("actor")
    m, t, b = w.role("actor").model, plan.rollout_tp, profile.bytes_per_param
    replicas = group.devices // t
    q = math.ceil(w.sequences / replicas)
    cap = kv_capacity(w, plan, profile, resident_bytes(w, group))
    if cap == 0:
        return math.inf, math.inf
    wave = min(q, cap)
    waves = math.ceil(q / wave)
    prefill = 2 * m.active * q * w.prompt_len / (t * profile.flops)
    kv_read = wave * (w.prompt_len + w.response_len / 2) * m.kv_bytes_per_token(b) / t
    memory = (m.params * b / t + kv_read) / profile.memory_bandwidth
    compute = 2 * m.active * wave / (t * profile.flops)
    tp_comm = 0.0 if t == 1 else 2 * m.layers * (wave * m.hidden * b * 2 * (t - 1) / t / link_bandwidth(group, profile)
                                                  + profile.collective_latency)
    decode = waves * w.response_len * (max(memory, compute) + tp_comm)
    peak = m.params * b / t + wave * (w.prompt_len + w.response_len) * m.kv_bytes_per_token(b) / t
    return prefill + decode, peak


def reshard_seconds(w: Workload, plan: Plan, profile: DeviceProfile) -> float:
    from minihf.hybrid.plan import plan_reshard, traffic

    group, m = plan.group_of("actor"), w.role("actor").model
    if group.devices == 1:
        return 0.0
    buckets = plan_reshard(dict(m.shapes), group.devices, plan.rollout_tp, tied_lm_head=m.tied,
                           itemsize=profile.bytes_per_param)
    moved = traffic(buckets, group.devices, plan.rollout_tp, profile.bytes_per_param)
    return moved["bytes_received"] / link_bandwidth(group, profile) + moved["collectives"] * profile.collective_latency


@dataclass(frozen=True)
class Estimate:
    plan: Plan
    phases: dict                         # phase -> seconds
    step_seconds: float
    peak_bytes: dict                     # group index -> peak bytes per device
    fits: bool


def contended(profile: DeviceProfile, busy: int) -> DeviceProfile:
    """The profile as seen by ``busy`` ranks computing at once on a shared host: with more
    threads than cores they take turns, so each gets ``cores / (busy x threads)`` of its
    FLOP/s and memory bandwidth. Devices of their own (``host_cores = 0``) are not slowed."""
    if not profile.host_cores:
        return profile
    slow = max(1.0, busy * profile.threads_per_rank / profile.host_cores)
    return replace(profile, flops=profile.flops / slow, memory_bandwidth=profile.memory_bandwidth / slow)


def estimate(w: Workload, plan: Plan, profile: DeviceProfile) -> Estimate:
    """Predicted seconds per phase and per step, and peak memory per device of each group."""
    b = profile.bytes_per_param
    actor_group = plan.group_of("actor")
    link = {g.roles: link_bandwidth(g, profile) for g in plan.groups}
    kind = _kinds(w)
    trained = [r.name for r in w.roles if r.trains]  # the actor first
    groups = [plan.group_of(r) for r in trained]
    overlap = len(groups) > 1 and len({g.first_rank for g in groups}) == len(groups)
    together = sum(g.devices for g in groups) if overlap else None  # ranks busy in an overlapped phase

    def seen(role: str, overlapped: bool = False) -> DeviceProfile:
        return contended(profile, together if overlapped and together else plan.group_of(role).devices)

    phases: dict[str, float] = {}
    gen, gen_peak = generation_seconds(w, plan, seen("actor"))
    phases["gen"] = gen
    phases["reshard"] = reshard_seconds(w, plan, profile)

    def forward(role_name: str, overlapped: bool = False) -> float:
        g, role = plan.group_of(role_name), w.role(role_name)
        return forward_seconds(role.model, w.forward_tokens, w.sequences, plan.micro(role_name), g.devices,
                               link[g.roles], seen(role_name, overlapped), units(role), role.sp)

    phases["reward"] = sum(forward(r) for r in kind["scores"])
    phases["old_log_prob"] = forward("actor") if w.recompute_old_log_prob else 0.0
    # the reference's forward and a recipe's roles' (sent alongside it), counted as "ref"
    ref = (forward("actor", overlapped=True) if w.use_ref else 0.0) + sum(
        forward(r, overlapped=True) for r in kind["log_probs"])
    values = [forward(r, overlapped=True) for r in kind["values"]]
    updates = [update_seconds(w.role(r), plan.micro(r), w, plan.group_of(r).devices, link[plan.group_of(r).roles],
                              seen(r, overlapped=True)) for r in trained]
    phases["ref"], phases["values"] = ref, sum(values)
    phases["update_actor"], phases["update_critic"] = updates[0], sum(updates[1:])
    step = phases["gen"] + phases["reshard"] + phases["reward"] + phases["old_log_prob"]
    step += max([ref, *values]) if overlap else ref + sum(values)
    step += max(updates) if overlap else sum(updates)

    peaks = {}
    for i, g in enumerate(plan.groups):
        transient = [gen_peak] if g is actor_group else []
        for name in g.roles:
            role = w.role(name)
            # a LoRA actor's engine keeps its base weights through training (unless
            # rollout.free_base_weights; counted as kept)
            kept = role.model.params * b / plan.rollout_tp if name == "actor" and role.lora_params else 0.0
            transient.append(micro_batch_bytes(role, plan.micro(name), w, b, role.trains) + kept)
        peaks[i] = resident_bytes(w, g) + max(transient)
    fits = all(p <= profile.memory_bytes for p in peaks.values()) and math.isfinite(step)
    return Estimate(plan, phases, step, peaks, fits)


def _kinds(w: Workload) -> dict[str, list[str]]:
    """The workload's roles by what their forward is in a step (the role table's ``forward``,
    ``minihf.roles``): ``policy``, ``values``, ``scores``, ``log_probs`` (a recipe's roles)."""
    out: dict[str, list[str]] = {"policy": [], "values": [], "scores": [], "log_probs": []}
    for r in w.roles:
        out[r.row_keys()[0]].append(r.name)
    return out
