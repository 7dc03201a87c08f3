"""The RL step as named phases over one ``Batch``, and the plug-in interface.

A step is a list of phases, run in order by :func:`run_phases` (``PPOTrainer.program``
builds it; docs/architecture.md, "One RL step"):

    rollout          generation rounds; one round is its own phase list:
        gen              rollout.n samples per prompt from the actor's engine
        reward           token_level_scores: the reward model, else the rule function
    balance          rows even over the actor's DP ranks (untimed)
    samples          samples.jsonl rows (untimed)
    old_log_prob     the trainer's log-probs of the samples (times itself)
    ref | values     remote calls sent together
    adv              in-reward KL, then the registered estimator
    update_critic | update_actor

A ``Phase`` is ``run(ctx, batch, metrics) -> Batch | None`` (a new batch, or None when it
changed ``batch`` in place), timed as ``timing_s/<name>`` unless ``timed=False``; times of
a phase that runs several times in a step (a round's) add up. ``Together`` holds ``Call``s,
remote methods of a role on the batch, sent at once: when the roles that train sit on
disjoint ranks (``ctx.overlap``) they run concurrently and each is timed as the driver's
wait for it; on shared ranks they run one after the other. A call whose role is not in
the job, or whose ``when(ctx)`` is false, is skipped. A result that is a ``Batch`` joins
the batch; a dict joins the metrics.

Plug-ins
--------
A plug-in is a ``Plugin`` subclass: the part of an algorithm outside the core loop
(Safe-RLHF, ReMax's baseline rollout, DAPO's dynamic sampling and overlong penalty are
plug-ins, in ``minihf.trainer.plugins``). It declares

* ``enabled(cfg)`` (a classmethod): whether it runs for a config (a recipe's, named in
  ``algorithm.plugins: [file.py:Class]``, runs unless it says otherwise); ``check_config(cfg)``
  (a classmethod) checks the config keys it owns when the config loads (the built-ins');
* ``Config``: a dataclass of its settings, read from ``algorithm.plugin_config.<name>``
  into ``self.config``;
* ``roles``: ``RoleDef`` rows it adds to the job's role table (``minihf.roles``),
  which builds, initialises, size-checks, saves and resumes them like the core roles;
* ``hooks()``: what it does to the step, each a ``Hook`` from ``before(name, phase)``,
  ``after(name, phase)``, ``replace(name, phase)``, ``wrap(name, fn)`` (``fn(ctx, batch,
  metrics, inner)``, timed as the phase it wraps) or ``alongside(name, call)`` (a call sent
  with the named one);
* ``validate(out)``: per-row validation figures by name (``{"cost": [...]}`` becomes
  ``val-core/<source>/cost/mean@k`` and ``val-core/cost``);
* ``state_dict()`` / ``load_state_dict(state)``: what it keeps across steps, saved in the
  checkpoint's driver state and given back exactly as saved (int keys, tuples, tensors:
  ``minihf.utils.state_json`` lists what it may hold). It is checked once the plug-ins are
  built, before step 1, and at each save; what a checkpoint cannot hold stops the run
  naming the plug-in and the path (``state_dict()['seen'][0] is a set``).

Mistakes in a plug-in stop the run in one line naming it (``plug-in <key> (<file.py>:<Class>)``):
``hooks()`` returning something other than a list of ``Hook``s, a hook whose phase, wrapper
or call is of the wrong type or whose target is not there, ``validate`` returning other
than one number per row for each figure (``PluginError``); state a checkpoint cannot hold,
``load_state_dict`` raising on the state saved for it (``StateError``, with the checkpoint
file on resume). Both are ``ValueError``s: the job prints them as one line.

It receives a ``StepContext`` (config, worker groups, data loader, tokenizer, the rule
reward, ``rollout``/``generate``/``score`` functions, the step's metrics, ``timed``),
never the trainer. Metrics it writes use its own prefix (``safe/``, ``train/``).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace as dc_replace
from typing import Any, Callable, ClassVar, Optional, Union

from minihf.protocol import Batch

PhaseFn = Callable[["StepContext", Batch, dict], Union[Batch, None]]


@dataclass(frozen=True)
class Phase:
    """One named phase of a step: ``run(ctx, batch, metrics)``."""
    name: str
    run: PhaseFn
    timed: bool = True


@dataclass(frozen=True)
class Call:
    """A role's remote ``method`` on the batch, as phase ``name``; skipped when the role is
    not in the job or ``when(ctx)`` is false."""
    name: str
    role: str
    method: str
    when: Callable[["StepContext"], bool] = lambda ctx: True

    def wanted(self, ctx: StepContext) -> bool:
        return self.role in ctx.groups and self.when(ctx)


@dataclass(frozen=True)
class Together:
    """Calls sent at once (see the module docstring)."""
    calls: tuple[Call, ...]


Item = Union[Phase, Together]


@dataclass
class StepContext:
    """What phases and plug-ins see of the run. ``rollout(prompts, round_index)`` runs one
    generation round (the round's phases) and returns ``(batch, the round's metrics)``;
    ``generate(batch, meta)`` samples from the actor (``(batch, the generation's meta)``);
    ``score(batch)`` runs the reward phase on a batch and returns ``(token_level_scores,
    metrics)``; ``timed(name)`` times a block into ``metrics`` as ``timing_s/<name>``."""
    cfg: Any
    groups: dict
    loader: Any
    tokenizer: Any
    reward: Any                        # the rule reward (RuleReward)
    log: Callable[[str], None]
    rollout: Callable[[Batch, int], tuple[Batch, dict]]
    generate: Callable[[Batch, dict], tuple[Batch, dict]]
    score: Callable[[Batch], tuple[Any, dict]]
    timed: Callable[[str], AbstractContextManager]
    overlap: bool = False              # the trained roles sit on disjoint ranks
    step: int = 0
    metrics: dict = field(default_factory=dict)


class Plugin:
    """Base class of plug-ins (see the module docstring); override what you need."""
    name: ClassVar[str] = ""           # key of its state and settings (default: the class name)
    roles: ClassVar[tuple] = ()        # RoleDef rows it adds to the job
    Config: ClassVar[Optional[type]] = None  # a dataclass: its settings, algorithm.plugin_config.<name>

    @classmethod
    def enabled(cls, cfg) -> bool:
        return True

    @classmethod
    def check_config(cls, cfg) -> None:
        """Check (and fill) the job config's keys this plug-in owns, as the config loads; raise
        ``ValueError`` naming the key. Run for the built-in plug-ins, enabled or not (a key
        set without its switch is an error there)."""

    @classmethod
    def key(cls) -> str:
        return cls.name or cls.__name__

    def __init__(self, ctx: StepContext):
        """``self.config``: the ``Config`` built from ``algorithm.plugin_config.<name>``
        (defaults where a key is absent; an unknown key is an error naming it)."""
        from minihf.config import ConfigError, from_dict

        self.ctx = ctx
        settings = ctx.cfg.algorithm.plugin_config.get(self.key(), {})
        if self.Config is None:
            if settings:
                raise ConfigError(f"algorithm.plugin_config.{self.key()}: plug-in {self.key()} takes "
                                  "no settings (it declares no Config)")
            self.config = None
        else:
            self.config = from_dict(self.Config, settings, f"algorithm.plugin_config.{self.key()}")

    def hooks(self) -> list[Hook]:
        return []

    def validate(self, out: Batch) -> dict[str, list[float]]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class Hook:
    how: str                           # before | after | replace | wrap | alongside
    target: str                        # the name of a phase or call
    item: Any                          # a Phase, a Call, or a wrapper function


def before(target: str, phase: Phase) -> Hook:
    return Hook("before", target, phase)


def after(target: str, phase: Phase) -> Hook:
    return Hook("after", target, phase)


def replace(target: str, phase: Phase) -> Hook:
    return Hook("replace", target, phase)


def wrap(target: str, fn: Callable) -> Hook:
    """``fn(ctx, batch, metrics, inner)``; ``inner(ctx, batch, metrics)`` runs the phase."""
    return Hook("wrap", target, fn)


def alongside(target: str, call: Call) -> Hook:
    return Hook("alongside", target, call)


def _wrapped(phase: Phase, fn: Callable) -> Phase:
    def run(ctx, batch, metrics):
        return fn(ctx, batch, metrics, phase.run)
    return dc_replace(phase, run=run)


def _apply(items: list[Item], hook: Hook) -> bool:
    """Apply ``hook`` to ``items`` in place; False if its target is not there."""
    for i, item in enumerate(items):
        if isinstance(item, Together):
            names = [c.name for c in item.calls]
            if hook.target in names:
                if hook.how != "alongside":
                    raise ValueError(f"phase {hook.target!r} is a remote call sent with others; "
                                     "a plug-in can only add a call alongside it")
                k = names.index(hook.target) + 1
                items[i] = Together(item.calls[:k] + (hook.item,) + item.calls[k:])
                return True
            continue
        if item.name != hook.target:
            continue
        if hook.how == "before":
            items.insert(i, hook.item)
        elif hook.how == "after":
            items.insert(i + 1, hook.item)
        elif hook.how == "replace":
            items[i] = hook.item
        elif hook.how == "wrap":
            items[i] = _wrapped(item, hook.item)
        else:
            raise ValueError(f"phase {hook.target!r} is not a remote call; use before/after/"
                             "replace/wrap, not alongside")
        return True
    return False


class PluginError(ValueError):
    """A plug-in that does not keep to the interface (see the module docstring)."""


def plugin_label(plugin) -> str:
    """``plug-in <key> (<where>:<Class>)`` for a plug-in or its class: where is the file of
    a recipe's class, the module of a built-in."""
    cls = plugin if isinstance(plugin, type) else type(plugin)
    where = cls.__module__
    if not where.startswith("minihf."):
        where = getattr(sys.modules.get(where), "__file__", None) or where
    return f"plug-in {cls.key()} ({where}:{cls.__qualname__})"


HOOK_ITEMS = {"before": (Phase, "a Phase"), "after": (Phase, "a Phase"), "replace": (Phase, "a Phase"),
              "wrap": (None, "a function fn(ctx, batch, metrics, inner)"), "alongside": (Call, "a Call")}


def _what(value) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def plugin_hooks(plugin: Plugin) -> list[Hook]:
    """``plugin.hooks()``, checked: a list of ``Hook``s, each item of the kind its ``how``
    takes (``PluginError`` naming the plug-in otherwise)."""
    label, hooks = plugin_label(plugin), plugin.hooks()
    make = "made with before/after/replace/wrap/alongside (minihf.trainer.phases)"
    if not isinstance(hooks, (list, tuple)):
        raise PluginError(f"{label}: hooks() returned {_what(hooks)}; return a list of Hooks {make}")
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise PluginError(f"{label}: hooks()[{i}] is {_what(hook)}, not a Hook; return a list of "
                              f"Hooks {make}")
        if not isinstance(hook.how, str) or hook.how not in HOOK_ITEMS or not isinstance(hook.target, str):
            raise PluginError(f"{label}: hooks()[{i}] is Hook({hook.how!r}, {hook.target!r}); make it "
                              f"with one of {list(HOOK_ITEMS)}, naming a phase by its str name")
        cls, wanted = HOOK_ITEMS[hook.how]
        item = hook.item
        ok = callable(item) if cls is None else isinstance(item, cls)
        if ok and isinstance(item, Phase):
            ok = isinstance(item.name, str) and callable(item.run)
        if not ok:
            raise PluginError(f"{label}: hooks()[{i}] = {hook.how}({hook.target!r}, ...) got {_what(item)}; "
                              f"{hook.how} takes {wanted}" + (" whose run is a function fn(ctx, batch, "
                                                              "metrics)" if cls is Phase else ""))
    return list(hooks)


def plugin_figures(plugin: Plugin, out: Batch) -> dict[str, list]:
    """``plugin.validate(out)``, checked: figure name -> one number per row of ``out``."""
    figures, label = plugin.validate(out), plugin_label(plugin)
    if not isinstance(figures, dict):
        raise PluginError(f"{label}: validate(out) returned {_what(figures)}; return a dict of figure "
                          "name -> one number per row of out (e.g. {'cost': [...]})")
    for name, values in figures.items():
        if not isinstance(name, str) or name == "reward":
            raise PluginError(f"{label}: validate(out) has a figure named {name!r}; name it with a str "
                              "other than 'reward' (the reward's own figure)")
        if isinstance(values, (str, dict)) or not hasattr(values, "__len__") or len(values) != len(out):
            raise PluginError(f"{label}: validate(out)[{name!r}] is {_what(values)}; give one number "
                              f"per row of out ({len(out)} rows)")
    return figures


def apply_hooks(programs: dict[str, list[Item]], plugins: list[Plugin], roles: set[str] | None = None
                ) -> dict[str, list[Item]]:
    """The phase lists (e.g. ``{"step": [...], "round": [...]}``) with every plug-in's hooks
    applied, in plug-in order. ``roles``: every role a job of this kind can have (a Call to
    one of them is skipped when the job lacks it; a Call to another name is an error: it was
    skipped in silence, and a later phase missed its keys)."""
    out = {k: list(v) for k, v in programs.items()}
    for plugin in plugins:
        for hook in plugin_hooks(plugin):
            call = hook.item  # (a Call is alongside's item; no hook takes a Together)
            if roles is not None and isinstance(call, Call) and call.role not in roles:
                raise PluginError(f"{plugin_label(plugin)}: calls role {call.role!r}, which no job of this "
                                  f"config has (known roles: {sorted(roles)}); add a roles.{call.role} section, "
                                  "or bring the role with the plug-in's roles")
            try:
                applied = any(_apply(items, hook) for items in out.values())
            except ValueError as e:
                raise PluginError(f"{plugin_label(plugin)}: {e}") from None
            if not applied:
                names = [getattr(x, "name", None) for items in out.values() for x in items
                         if isinstance(x, Phase)]
                calls = [c.name for items in out.values() for x in items if isinstance(x, Together)
                         for c in x.calls]
                raise PluginError(f"{plugin_label(plugin)}: no phase {hook.target!r} to "
                                  f"{hook.how}; phases: {names + calls}")
    return out


def run_phases(ctx: StepContext, items: list[Item], batch: Batch, metrics: dict, rows_needed: bool = True
               ) -> Batch:
    """Run ``items`` on ``batch``; the final batch. ``rows_needed``: a phase may not leave it
    empty (a step's program; a generation round's may keep no rows, rounds are joined)."""
    for item in items:
        if isinstance(item, Together):
            calls = [c for c in item.calls if c.wanted(ctx)]
            for result in _send_together(ctx, calls, batch):
                if isinstance(result, Batch):
                    batch |= result
                else:
                    metrics.update(result)
            continue
        if item.timed:
            with ctx.timed(item.name):
                out = item.run(ctx, batch, metrics)
        else:
            out = item.run(ctx, batch, metrics)
        if out is not None:
            batch = _checked_output(item.name, out, rows_needed)
    return batch


def _checked_output(name: str, out, rows_needed: bool) -> Batch:
    """A phase's returned batch, checked where the next phase would fail deep inside (a dict
    had no ``.tensors``; a batch of no rows failed at cutting micro-batches)."""
    if not isinstance(out, Batch):
        raise PluginError(f"phase {name!r} returned {_what(out)}; return the batch (a Batch, e.g. batch "
                          "or batch[rows]) or None to keep it")
    if rows_needed and len(out) == 0:
        raise PluginError(f"phase {name!r} returned a batch of no rows; the step needs at least one (to "
                          "drop every sample, filter before generating more, as algorithm.filter_groups does)")
    return out


def _send_together(ctx: StepContext, calls: list[Call], batch: Batch) -> list:
    """The calls' results, each timed as its name (see the module docstring)."""
    methods = [(c.name, getattr(ctx.groups[c.role], c.method)) for c in calls]
    if not ctx.overlap:
        results = []
        for name, method in methods:
            with ctx.timed(name):
                results.append(method(batch))
        return results
    futures = [(name, method.future(batch)) for name, method in methods]
    results = []
    for name, future in futures:
        with ctx.timed(name):
            results.append(future.result())
    return results
