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
    (``algorithm.plugins``, imported from their files in this process)."""
    from minihf.trainer.phases import Plugin
    from minihf.utils.imports import load_ref

    recipe = []
    for i, ref in enumerate(cfg.algorithm.plugins):
        cls = load_ref(ref, "plug-in class")
        if not (isinstance(cls, type) and issubclass(cls, Plugin)):
            raise TypeError(f"algorithm.plugins[{i}]={ref!r} is not a Plugin subclass (minihf.trainer."
                            "phases.Plugin); subclass it")
        recipe.append(cls)
    classes = [p for p in BUILTIN_PLUGINS + tuple(recipe) if p.enabled(cfg)]
    keys = [p.key() for p in classes]
    unknown = sorted(set(cfg.algorithm.plugin_config) - set(keys))
    if unknown:
        raise ValueError(f"algorithm.plugin_config has settings for {unknown}, which do not run; the "
                         f"plug-ins that run: {keys}")
    return classes


__all__ = ["BUILTIN_PLUGINS", "DynamicSampling", "OverlongPenalty", "RewardBaseline", "SafeRLHF",
           "plugin_classes"]
