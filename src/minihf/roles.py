"""The RL job's role table: one row per role, declared once, read wherever roles are listed
(below both ``minihf.planner`` and ``minihf.trainer``).

A ``RoleDef`` names the role, its worker class, the config section the worker is built
from, when it is in the job, whether it trains (the section holding its
``ppo_mini_batch_size`` and ``ppo_epochs``: its optimizer steps and size checks) and
whether it is checkpointed. ``CORE_ROLES`` are the actor (with the rollout engine and the
reference), the critic, the reward model and a standalone rollout; plug-ins add theirs (Safe-RLHF: the cost
critic and the cost model), and a recipe its own under ``roles.<name>`` (a worker class and
its model, e.g. a distillation teacher; trained, checkpointed and resumed when its
``train.enable`` says so, e.g. PRIME's process reward model). The table drives building the workers (``worker_roles``),
``init_model``, the batch-size checks, and checkpoint save and resume (``PPOTrainer``);
the roles' placement is ``controller.placement``. The planner (``minihf plan`` and the start-up
memory check) reads the same rows (``planned_roles``): a row's model ``head``, what its
``forward`` is in a step (``policy``, ``values``, ``scores`` or ``log_probs``) and its
micro-batch keys (``micro_keys`` in rows, ``token_keys`` as a token budget; the first of each
sizes its planned micro-batch), so a recipe's ``roles.<name>`` is planned and memory-checked
like the core roles. Safe-RLHF's rows are declared here (``SAFE_ROLES``), where the planner
sees them; its plug-in (``minihf.trainer.plugins.safe``) adds them to the job.

``inputs`` / ``outputs`` rename batch keys on the way to and from the worker
(``minihf.controller.Renamed``), so one worker class can serve two roles.

The trained actor is open: ``actor_rollout_ref.worker`` names a recipe's subclass of
``ActorRolloutRefWorker`` (to wrap ``update_actor``, add a method), and a plug-in's row with
``replaces=True`` takes a core row's place (its class must subclass the core one's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from minihf.config import section_of
from minihf.workers.actor_checks import reference_source


def _always(cfg) -> bool:
    return True


@dataclass(frozen=True)
class RoleDef:
    name: str
    worker: str                        # a minihf.workers class name, or file.py:Class
    section: str                       # dotted config path the worker is built from
    enabled: Callable[[Any], bool] = _always
    trains: Optional[str] = None       # dotted section with ppo_mini_batch_size / ppo_epochs
    checkpointed: bool = False
    kwargs: Callable[[Any], dict] = lambda cfg: {}
    inputs: dict = field(default_factory=dict)   # worker key -> batch key
    outputs: dict = field(default_factory=dict)  # result key (or "prefix/") -> name in the step
    replaces: bool = False             # a plug-in's row that takes the place of the core row of its name
    # what the planner reads: the model's head, its forward in a step (policy | values |
    # scores | log_probs | none), its micro-batch keys in rows and as a token budget
    head: str = "lm"
    forward: str = "log_probs"
    micro_keys: tuple[str, ...] = ()
    token_keys: tuple[str, ...] = ()

    def config(self, cfg) -> Any:
        return section_of(cfg, self.section)

    def worker_class(self) -> type:
        from minihf.utils.imports import is_code_ref, load_ref

        import minihf.workers

        cls = load_ref(self.worker, "worker class") if is_code_ref(self.worker) else getattr(minihf.workers, self.worker)
        core = next((r for r in CORE_ROLES if r.name == self.name), None)
        if core is not None and core.worker != self.worker:  # a recipe's class in a core role's place
            base = getattr(minihf.workers, core.worker)
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise ValueError(f"role {self.name!r}: worker {self.worker} must subclass minihf.workers."
                                 f"{core.worker} (it is called as one)")
        if self.section == f"roles.{self.name}":  # a recipe role trains exactly when its class can
            trained = isinstance(cls, type) and issubclass(cls, minihf.workers.TrainedRoleWorker)
            if self.trains and not trained:
                raise ValueError(f"roles.{self.name}.train.enable is true, but its worker {self.worker} does not "
                                 "train: subclass minihf.workers.TrainedRoleWorker, or set train.enable: false")
            if trained and not self.trains:
                raise ValueError(f"roles.{self.name}: worker {self.worker} is a TrainedRoleWorker; set "
                                 f"roles.{self.name}.train.enable: true (with its optim and mini-batch keys)")
        return cls


def _critic_keys(section: str) -> dict:
    return dict(head="value", forward="values",
                micro_keys=(f"{section}.ppo_micro_batch_size_per_gpu", f"{section}.forward_micro_batch_size_per_gpu"),
                token_keys=(f"{section}.max_tokens_per_micro_batch",))


def _scorer_keys(section: str) -> dict:
    return dict(head="score", forward="scores", micro_keys=(f"{section}.micro_batch_size_per_gpu",),
                token_keys=(f"{section}.max_tokens_per_micro_batch",))


CORE_ROLES = (
    RoleDef("actor", "ActorRolloutRefWorker", "actor_rollout_ref", trains="actor_rollout_ref.actor",
            checkpointed=True, kwargs=lambda cfg: {
                "with_ref": cfg.use_ref,
                # a LoRA actor's reference is its own model with the adapters off
                "reference": reference_source(cfg.actor_rollout_ref.model),
                # a standalone rollout (controller.placement.rollout) generates instead
                "generates": "rollout" not in cfg.controller.placement},
            forward="policy", micro_keys=("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                          "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",
                                          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
            token_keys=("actor_rollout_ref.actor.max_tokens_per_micro_batch",
                        "actor_rollout_ref.ref.max_tokens_per_micro_batch")),
    RoleDef("critic", "CriticWorker", "critic", lambda cfg: cfg.critic.enable, trains="critic",
            checkpointed=True, **_critic_keys("critic")),
    RoleDef("reward_model", "RewardModelWorker", "reward_model", lambda cfg: cfg.reward_model.enable,
            **_scorer_keys("reward_model")),
    # a standalone rollout: the engine on ranks of its own (controller.placement.rollout); not planned
    RoleDef("rollout", "RolloutWorker", "actor_rollout_ref", lambda cfg: "rollout" in cfg.controller.placement,
            forward="none"),
)

# Safe-RLHF (algorithm.safe): the cost critic, a CriticWorker reading cost_values / cost_returns as
# its values / returns and answering cost_values and cost_critic/*; the cost model, a reward model
SAFE_ROLES = (
    RoleDef("cost_critic", "CriticWorker", "cost_critic", lambda cfg: cfg.cost_critic.enable,
            trains="cost_critic", checkpointed=True,
            inputs={"values": "cost_values", "returns": "cost_returns"},
            outputs={"values": "cost_values", "critic/": "cost_critic/"}, **_critic_keys("cost_critic")),
    RoleDef("cost_model", "RewardModelWorker", "cost_model", lambda cfg: cfg.cost_model.enable,
            **_scorer_keys("cost_model")),
)
DECLARED = CORE_ROLES + SAFE_ROLES  # the rows minihf knows by name (a recipe's roles.<name> is any other)


def recipe_role(name: str, worker: str = "LogProbWorker", trains: bool = False) -> RoleDef:
    """The row of a recipe's ``roles.<name>`` section, planned as a language model's forward
    over the step's batch (a ``LogProbWorker``'s); with ``trains`` (its ``train.enable``) it
    is also updated, checkpointed and resumed, its update's micro-batch keys first."""
    section = f"roles.{name}"
    micro, tokens = (f"{section}.log_prob_micro_batch_size_per_gpu",), (f"{section}.max_tokens_per_micro_batch",)
    if trains:
        micro = (f"{section}.train.ppo_micro_batch_size_per_gpu", *micro)
        tokens = (f"{section}.train.max_tokens_per_micro_batch", *tokens)
    return RoleDef(name, worker, section, trains=f"{section}.train" if trains else None, checkpointed=trains,
                   micro_keys=micro, token_keys=tokens)


def section_role(name: str, section) -> RoleDef:
    """The row of the config's ``roles.<name>`` section."""
    return recipe_role(name, section.worker, section.train.enable)


def declared(name: str, trains: bool = False) -> RoleDef:
    """The row minihf declares for ``name``, else a recipe role's (what the planner keys on;
    ``trains``: the recipe role trains)."""
    return next((r for r in DECLARED if r.name == name), None) or recipe_role(name, trains=trains)


def recipe_plugins(cfg) -> list[type]:
    """The classes of the recipe's plug-ins (``algorithm.plugins``, imported from their files)
    that run for ``cfg``: what the planner reads their ``roles`` from (the trainer's
    ``minihf.trainer.plugins.plugin_classes`` checks them further)."""
    from minihf.config import ConfigError
    from minihf.utils.imports import load_ref

    out = []
    for i, ref in enumerate(cfg.algorithm.plugins):
        try:
            cls = load_ref(ref, "plug-in class")
        except (AttributeError, TypeError) as e:
            raise ConfigError(f"algorithm.plugins[{i}]={ref!r}: {e}") from None
        if getattr(cls, "enabled", lambda cfg: True)(cfg):
            out.append(cls)
    return out


def planned_roles(cfg) -> list[RoleDef]:
    """The rows the planner models for ``cfg``: the job's role table (``role_table``: the core
    rows, the recipe's plug-ins' and its ``roles.<name>``) and Safe-RLHF's (its plug-in runs
    with ``algorithm.safe``); not a standalone rollout. Trained roles first."""
    table, core = role_table(cfg, recipe_plugins(cfg)), {r.name for r in CORE_ROLES}
    rows = ([r for r in table if r.name in core] + [r for r in SAFE_ROLES if r.enabled(cfg)]
            + [r for r in table if r.name not in core])
    return sorted((r for r in rows if r.forward != "none"), key=lambda r: not r.trains)


def role_table(cfg, plugin_classes=()) -> list[RoleDef]:
    """The job's roles: the core ones (the actor's class from ``actor_rollout_ref.worker``), each
    plug-in's (a row with ``replaces`` takes the core row of its name's place), then the config's
    own (``roles.<name>``: built from its section, trained when ``train.enable``), those
    enabled for ``cfg``."""
    actor_worker = cfg.actor_rollout_ref.worker
    rows = [replace(r, worker=actor_worker) if r.name == "actor" else r for r in CORE_ROLES]
    for r in (r for p in plugin_classes for r in getattr(p, "roles", ())):
        at = [i for i, core in enumerate(rows) if core.name == r.name and r.replaces]
        if r.replaces and not at:
            raise ValueError(f"plug-in role {r.name!r} replaces a core role, but there is none of that name "
                             f"(core roles: {[c.name for c in CORE_ROLES]})")
        if at:
            rows[at[0]] = r
        else:
            rows.append(r)
    rows += [section_role(name, section) for name, section in cfg.roles.items()]
    names = [r.name for r in rows]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"roles {dup} are defined twice (core roles: {[r.name for r in CORE_ROLES]}); "
                         "give a plug-in's role another name")
    return [r for r in rows if r.enabled(cfg)]


def known_roles(cfg, plugin_classes=()) -> set[str]:
    """Every role name a job of ``cfg`` could have, enabled or not: minihf's own, its
    plug-ins' and its ``roles.<name>`` sections."""
    return ({r.name for r in DECLARED} | {r.name for p in plugin_classes for r in getattr(p, "roles", ())}
            | set(cfg.roles))


def worker_roles(table: list[RoleDef], cfg) -> dict:
    """``controller.Role`` per row, for ``minihf.controller.run``."""
    from minihf.controller import Role

    return {r.name: Role(r.worker_class(), (r.config(cfg),), r.kwargs(cfg)) for r in table}


def role_groups(table: list[RoleDef], groups: dict) -> dict:
    """The driver's view of each role's group: behind a ``Renamed`` proxy where the row
    renames keys. Groups of roles not in the table are left out."""
    from minihf.controller.group import Renamed

    return {r.name: Renamed(groups[r.name], r.inputs, r.outputs) if r.inputs or r.outputs
            else groups[r.name] for r in table if r.name in groups}
