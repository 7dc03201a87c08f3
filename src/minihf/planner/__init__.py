"""minihf.planner: choose where an RL job's roles run, from a cost model (``minihf plan``).

HybridFlow's auto device mapping (its Section 6, Algorithm 1) over minihf's knobs: which
roles share devices, how many devices each group gets, the rollout TP size and the
micro-batch sizes; each candidate's step time and memory are estimated phase by phase.

* ``profiles`` -- what one device can do (built-in datasheet profiles; ``measure`` for this
  machine);
* ``job`` -- the roles' model shapes and the step's workload, from a ``PPOJobConfig``;
* ``cost`` -- the formulas (in its docstring): seconds per phase, memory per device;
* ``search`` -- the candidates, ranked; ``plan_overrides`` turns one into config keys.
"""

from minihf.planner.cost import Estimate, Group, Plan, estimate
from minihf.planner.job import Workload, model_shape, workload
from minihf.planner.profiles import BUILTIN, DeviceProfile, load_profile, measure
from minihf.planner.search import SearchResult, describe, plan_overrides, search

__all__ = ["Estimate", "Group", "Plan", "estimate", "Workload", "model_shape", "workload", "BUILTIN",
           "DeviceProfile", "load_profile", "measure", "SearchResult", "describe", "plan_overrides", "search"]
