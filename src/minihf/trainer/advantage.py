"""The driver's call of an advantage estimator: the registered function gets the arguments
it names, from what the step produced (verl's argument names)."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from minihf.algorithms import PRODUCED_BY, get_adv_estimator_fn
from minihf.protocol import Batch


def estimate_advantages(batch: Batch, alg, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the registered estimator ``name`` with the arguments it takes, from this pool
    (verl's names): token_level_rewards, values, response_mask, index (prompt uids),
    reward_baselines, gamma, lam, norm_adv_by_std_in_grpo."""
    fn = get_adv_estimator_fn(name)
    pool = {"token_level_rewards": batch["token_level_rewards"],
            "response_mask": batch["response_mask"],
            "index": np.asarray(batch.non_tensors["uid"], dtype=object),
            "gamma": alg.gamma, "lam": alg.lam,
            "norm_adv_by_std_in_grpo": alg.norm_adv_by_std_in_grpo}
    for key in ("values", "reward_baselines"):
        if key in batch.tensors:
            pool[key] = batch[key]
    params = inspect.signature(fn).parameters
    missing = [p for p, v in params.items()
               if v.default is inspect.Parameter.empty and p not in pool]
    if missing:
        how = "; ".join(f"{k} come from {PRODUCED_BY[k]}" for k in missing if k in PRODUCED_BY)
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which this run does not "
                         f"produce" + (f" ({how})" if how else ""))
    return fn(**{k: v for k, v in pool.items() if k in params})
