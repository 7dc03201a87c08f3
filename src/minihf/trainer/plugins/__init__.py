"""The built-in plug-ins (``minihf.trainer.phases`` has the interface): each runs when its
config switch (or the estimator's spec) says so, in this order.

* ``DynamicSampling`` (``algorithm.filter_groups``, DAPO): replaces ``rollout``;
* ``RewardBaseline`` (an estimator that reads ``reward_baselines``, e.g. ReMax): a phase
  ``gen_max`` before ``gen``;
* ``OverlongPenalty`` (``reward_model.overlong_buffer``, DAPO): wraps ``reward``;
* ``SafeRLHF`` (``algorithm.safe``): the cost critic and cost model roles, ``cost`` after
  ``reward``, calls alongside ``values`` and ``update_critic``, wraps ``adv``, validation
  costs, the Lagrange multiplier's state.
"""

from __future__ import annotations

from minihf.trainer.plugins.baseline import RewardBaseline
from minihf.trainer.plugins.dapo import DynamicSampling, OverlongPenalty
from minihf.trainer.plugins.safe import SafeRLHF

BUILTIN_PLUGINS = (DynamicSampling, RewardBaseline, OverlongPenalty, SafeRLHF)


def plugin_classes(cfg) -> list[type]:
    """The plug-in classes that run for ``cfg``, in order: the built-ins, then the recipe's
    (``algorithm.plugins``, imported from their files in this process). ``ConfigError``
    for an entry that is not a ``Plugin`` subclass, or two that run under one name."""
    from minihf.config import ConfigError
    from minihf.trainer.phases import Plugin, plugin_label
    from minihf.utils.imports import load_ref

    recipe = []
    for i, ref in enumerate(cfg.algorithm.plugins):
        try:
            cls = load_ref(ref, "plug-in class")
        except (AttributeError, TypeError) as e:  # no such name; a name bound to a non-callable
            raise ConfigError(f"algorithm.plugins[{i}]={ref!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Plugin)):
            what = "a class of its own" if isinstance(cls, type) else f"a {type(cls).__name__}"
            raise ConfigError(f"algorithm.plugins[{i}]={ref!r} is not a Plugin subclass (it is {what}); "
                              "make it a class that subclasses minihf.trainer.phases.Plugin")
        key = cls.key()
        if not (isinstance(key, str) and key):
            raise ConfigError(f"algorithm.plugins[{i}]={ref!r}: its name is {key!r}; set the class "
                              "attribute name to a non-empty str (the key of its state and settings)")
        recipe.append(cls)
    classes = [p for p in BUILTIN_PLUGINS + tuple(recipe) if p.enabled(cfg)]
    keys = [p.key() for p in classes]
    for j, cls in enumerate(classes):  # one key, one state and one settings entry per plug-in
        other = next((c for c in classes[:j] if c.key() == cls.key()), None)
        if other is not None:
            same = " (listed twice)" if other is cls else ""
            raise ConfigError(f"algorithm.plugins: {plugin_label(cls)} and {plugin_label(other)} have the "
                              f"same name {cls.key()!r}{same}; plug-ins' states and settings are kept "
                              "by name: list each once, and give each its own name (class attribute name)")
    unknown = sorted(set(cfg.algorithm.plugin_config) - set(keys))
    if unknown:
        raise ValueError(f"algorithm.plugin_config has settings for {unknown}, which do not run; the "
                         f"plug-ins that run: {keys}")
    return classes


__all__ = ["BUILTIN_PLUGINS", "DynamicSampling", "OverlongPenalty", "RewardBaseline", "SafeRLHF",
           "plugin_classes"]
