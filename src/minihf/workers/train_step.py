"""One optimizer step over a mini-batch cut into micro-batches, with exact normalisation.

The update must not depend on how a mini-batch is cut into micro-batches or spread over
data-parallel ranks. Every loss here is a sum over tokens (or sequences) divided by a
count, so:

1. before the micro-batch loop, the *global* normaliser of the mini-batch (all its
   micro-batches on all DP ranks) is computed with one all-reduce
   (:func:`global_normalizer`);
2. each micro-batch's loss is its partial sum divided by that global normaliser, so
   summing the micro-batch gradients (``backward`` accumulates) gives this rank's share of
   the mini-batch gradient;
3. FSDP *averages* gradients over the ``dp`` ranks in its reduce-scatter, so each loss is
   multiplied by ``dp`` before ``backward``; the average of ``dp`` scaled shares is the sum
   of the shares, i.e. the full mini-batch gradient. (Scaling by a power of two is exact in
   floating point; other DP sizes agree to rounding.)

Statistics follow the same rule: each is returned by the loss function as this
micro-batch's share of a global mean and summed over micro-batches and ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from minihf.algorithms import loss_normalizer
from minihf.workers.optim import clip_grad_norm_
from minihf.workers.micro_batch import Groups, count_token_budget, plan_fixed, plan_token_budget


def _dist(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def group_size(group) -> int:
    """Size of ``group``; ``group=None`` means "not distributed" (size 1, no collectives)."""
    return dist.get_world_size(group) if _dist(group) else 1


def all_reduce_(t: torch.Tensor, group, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) over ``group``; a no-op without distribution."""
    if _dist(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return t


def plan_micro_batches(attention_mask: torch.Tensor, *, micro_batch_size: int | None = None,
                       max_tokens: int | None = None, group=None,
                       groups: Groups | None = None) -> list[list[int]]:
    """Row groups for the micro-batches of one mini-batch on this rank.

    With ``max_tokens`` the rows are balanced by real-token count under that budget and the
    number of micro-batches is the max over ``group`` (every rank must run as many
    forward/backward passes); otherwise fixed groups of ``micro_batch_size`` rows.
    ``groups`` (rows sharing a prompt, see ``micro_batch``) keeps them together under a
    token budget.
    """
    n = attention_mask.shape[0]
    if max_tokens is None:
        if micro_batch_size is None:
            raise ValueError("give micro_batch_size or max_tokens_per_micro_batch")
        return plan_fixed(n, micro_batch_size)
    seq_lens = attention_mask.sum(-1).tolist()
    count = count_token_budget(seq_lens, max_tokens, groups)
    while True:  # until every rank plans the agreed count (each pass can only raise it)
        k = torch.tensor([count], device=attention_mask.device)
        all_reduce_(k, group, dist.ReduceOp.MAX)
        plan = plan_token_budget(seq_lens, max_tokens, num_micro_batches=int(k.item()), groups=groups)
        # a forced count past a rank's shared-prompt units plans its rows alone, each paying
        # for its prompt: that may take more micro-batches than agreed (its ranks then ran
        # more forwards than the others and the job hung in a collective)
        mine = torch.tensor([len(plan)], device=attention_mask.device)
        all_reduce_(mine, group, dist.ReduceOp.MAX)
        if int(mine.item()) == int(k.item()):
            return plan
        count = int(mine.item())


def take_rows(data: dict, rows: Sequence[int]) -> dict:
    """The ``rows`` of every tensor in ``data`` (a dict of tensors sharing dim 0)."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    return {k: v.index_select(0, idx.to(v.device)) for k, v in data.items()}


def global_normalizer(loss_mask: torch.Tensor, loss_agg_mode: str, group, counted: bool = True) -> torch.Tensor:
    """The mini-batch's loss normaliser summed over ranks (tokens, rows or non-empty
    sequences). ``counted=False``: this rank's rows are another rank's too (a sequence-
    parallel group's rows, counted on its leader) and add nothing."""
    local = loss_normalizer(loss_mask, loss_agg_mode).clone()
    return all_reduce_(local if counted else torch.zeros_like(local), group)


def global_token_count(loss_mask: torch.Tensor, group, counted: bool = True) -> torch.Tensor:
    """Masked tokens of the mini-batch over all ranks (for token-mean statistics);
    ``counted=False`` as in :func:`global_normalizer`."""
    local = loss_mask.float().sum()
    return all_reduce_(local if counted else torch.zeros_like(local), group).clamp(min=1.0)


LossFn = Callable[[dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_minibatch(model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler,
                    micro_batches: Sequence[dict], loss_fn: LossFn, *, clip_grad: float,
                    group=None, count_stats: bool = True) -> dict[str, float]:
    """Accumulate ``loss_fn`` over ``micro_batches``, clip, step; return reduced stats.

    ``loss_fn(mb) -> (loss, stats)``: ``loss`` is the micro-batch's share of the global
    mini-batch loss (partial sum / global normaliser); ``stats`` are shares of global
    statistics. Returns the stats summed over micro-batches and ranks plus ``grad_norm``
    (the true global norm, before clipping) and ``lr`` (the one used for this step). A
    non-finite gradient norm (a NaN/Inf loss or gradient) skips the parameter update and
    adds ``skipped: 1.0``. ``count_stats`` False: this rank's statistics are a copy of
    another rank's (a sequence-parallel group's, ``minihf.parallel.ulysses``) and count 0.
    """
    dp = group_size(group)
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, torch.Tensor] = {}
    for mb in micro_batches:
        loss, stats = loss_fn(mb)
        (loss * dp).backward()
        for k, v in stats.items():
            v = v.detach().float().reshape(())
            sums[k] = sums[k] + v if k in sums else v
    grad_norm = clip_grad_norm_(model.parameters(), clip_grad)
    lr = optimizer.param_groups[0]["lr"]
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if lr_scheduler is not None:
        advance_schedule(lr_scheduler, 1, taken=finite)
    keys = sorted(sums)
    out: dict[str, float] = {"grad_norm": float(grad_norm), "lr": float(lr)}
    if not finite:
        out["skipped"] = 1.0
    if keys:
        stacked = torch.stack([sums[k].to(grad_norm.device) for k in keys])
        if not count_stats:
            stacked = torch.zeros_like(stacked)
        all_reduce_(stacked, group)
        out.update({k: float(v) for k, v in zip(keys, stacked.tolist())})
    return out


def mean_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average per-step metrics over the steps of one update call."""
    if not steps:
        return {}
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def advance_schedule(lr_scheduler, steps: int, taken: bool = False) -> None:
    """Move ``lr_scheduler`` on ``steps`` optimizer steps; ``taken`` False: steps not taken
    (a skipped update, a step's dropped rows), for which torch's warning of a schedule step
    without an optimizer step is silenced."""
    if taken:  # (catch_warnings would reset which warnings were already shown)
        for _ in range(steps):
            lr_scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            lr_scheduler.step()
