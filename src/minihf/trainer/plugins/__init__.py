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
    """The plug-in classes that run for ``cfg``, in order."""
    return [p for p in BUILTIN_PLUGINS if p.enabled(cfg)]


__all__ = ["BUILTIN_PLUGINS", "DynamicSampling", "OverlongPenalty", "RewardBaseline", "SafeRLHF",
           "plugin_classes"]
