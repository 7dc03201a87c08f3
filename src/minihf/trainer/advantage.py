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
    rest = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)  # **kw takes the whole pool
    missing = [p for p, v in params.items()
               if v.default is inspect.Parameter.empty and v.kind not in rest and p not in pool]
    if missing:
        how = "; ".join(f"{k} come from {PRODUCED_BY[k]}" for k in missing if k in PRODUCED_BY)
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which this run does not "
                         f"produce" + (f" ({how})" if how else ""))
    takes_all = any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values())
    result = fn(**{k: v for k, v in pool.items() if takes_all or k in params})
    return _checked(result, name, batch["token_level_rewards"], batch["response_mask"])


def _checked(result, name: str, rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An estimator's ``(advantages, returns)``, checked (a wrong shape failed in the actor's
    update, a None in the metrics); detached (a graph kept would be backpropagated twice)."""
    want = f"return (advantages, returns): two float tensors shaped like token_level_rewards {tuple(rewards.shape)}"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ValueError(f"advantage estimator {name!r} returned {got}; {want}")
    for what, t in zip(("advantages", "returns"), result):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != rewards.shape:
            got = (f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"advantage estimator {name!r} returned {what} as {got}; {want}")
        bad = int((~torch.isfinite(t) & mask.bool()).sum())
        if bad:
            raise ValueError(f"advantage estimator {name!r} returned non-finite {what} at {bad} response "
                             "tokens; they would poison the update (check its divisions, e.g. a std of 0)")
    return result[0].detach(), result[1].detach()
