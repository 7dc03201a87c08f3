"""minihf.hybrid: the 3D-HybridEngine for FSDP (docs/hybrid-engine.md).

``plan`` (pure: which tensor is gathered over which ranks, in which bucket), ``reshard``
(executing it: FSDP2 shards -> the engine's TP shards, in place) and ``engine``
(``HybridEngine``: reshard -> generate -> sleep, and the rollout output format).
"""

from minihf.hybrid.engine import HybridEngine, build_output, collect_rollout
from minihf.hybrid.plan import Bucket, TensorPlan, plan_reshard, traffic

__all__ = ["Bucket", "HybridEngine", "TensorPlan", "build_output", "collect_rollout",
           "plan_reshard", "traffic"]
