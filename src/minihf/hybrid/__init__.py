"""minihf.hybrid: the 3D-HybridEngine for FSDP (docs/hybrid-engine.md).

``plan`` (pure: which tensor is gathered over which ranks, in which bucket), ``reshard``
(executing it: FSDP2 shards -> the engine's TP shards, in place) and ``engine``
(``HybridEngine``: reshard -> generate -> sleep, and the rollout output format;
``StandaloneEngine``: the same engine on ranks that do not train), and ``transfer`` (the
weight sync from the actor's FSDP shards to a standalone rollout's TP shards, point to
point).
"""

from minihf.hybrid.engine import HybridEngine, StandaloneEngine
from minihf.hybrid.rollout_output import build_output, collect_rollout
from minihf.hybrid.plan import Bucket, TensorPlan, plan_reshard, traffic

__all__ = ["Bucket", "HybridEngine", "StandaloneEngine", "TensorPlan", "build_output", "collect_rollout",
           "plan_reshard", "traffic"]
