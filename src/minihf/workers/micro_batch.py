"""Planning micro-batches: which rows of a mini-batch go through the model together.

Pure Python (no torch), so the plans are unit-tested alone. Two ways to cut:

* :func:`plan_fixed`: consecutive groups of ``micro_batch_size`` rows.
* :func:`plan_token_budget`: as few micro-batches as keep every one under
  ``max_tokens`` real (unpadded) tokens, balanced by token count (longest-first greedy
  onto the lightest bin), deterministic (ties broken by row index). Data-parallel ranks
  must run the same number of forward/backward passes (FSDP collectives), so the count
  can be raised to an agreed ``num_micro_batches`` (e.g. the max over ranks).

Plans are lists of row-index lists; every row appears exactly once. Because losses are
normalised by the whole mini-batch (see ``minihf.algorithms.loss_agg``), the cut changes
only speed and memory, never the update.

With ``groups`` (rows that share a prompt and their prompt lengths; the packed forward
runs a shared prompt once) the token budget plans whole groups as units costing their
packed tokens, so the n responses of a prompt stay in one micro-batch; a group over the
budget is cut into consecutive chunks that fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def plan_fixed(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(i, min(i + micro_batch_size, num_rows)))
            for i in range(0, num_rows, micro_batch_size)]


def min_micro_batches(seq_lens: Sequence[int], max_tokens: int) -> int:
    """A lower bound on the micro-batch count under ``max_tokens`` (>= 1, <= len)."""
    if not seq_lens:
        return 0
    too_long = [(i, n) for i, n in enumerate(seq_lens) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"row {i} has {n} tokens, more than max_tokens_per_micro_batch="
                         f"{max_tokens}; raise the budget to at least the longest "
                         f"sequence ({max(seq_lens)})")
    return max(1, math.ceil(sum(seq_lens) / max_tokens))


def balanced_partition(seq_lens: Sequence[int], k: int) -> list[list[int]]:
    """Split rows into exactly ``k`` bins with near-equal token sums (LPT greedy).

    Rows are visited longest first (ties: lower index first) and each goes to the bin
    with the fewest tokens so far (ties: lower bin). Each bin's rows are returned in
    ascending order, bins ordered by their first row. With ``k <= len(seq_lens)`` no bin
    is empty.
    """
    if not 1 <= k <= max(1, len(seq_lens)):
        raise ValueError(f"cannot split {len(seq_lens)} rows into {k} non-empty micro-batches")
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(seq_lens)), key=lambda j: (-seq_lens[j], j)):
        b = min(range(k), key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += seq_lens[i]
    out = [sorted(b) for b in bins if b]
    return sorted(out, key=lambda b: b[0])


Groups = tuple[Sequence[Sequence[int]], Sequence[int]]  # (rows sharing a prompt, prompt lengths)


def share_units(seq_lens: Sequence[int], max_tokens: int,
                groups: Groups) -> tuple[list[list[int]], list[int]]:
    """Rows that share a prompt as units that stay in one micro-batch, and each unit's
    packed token count (its prompt once). A group over ``max_tokens`` is cut into
    consecutive chunks under it (a row over it alone is left for the caller to report)."""
    units, costs = [], []
    for rows, plen in zip(*groups):
        unit, cost = [], 0
        for i in rows:
            extra = seq_lens[i] - (plen if unit else 0)
            if unit and cost + extra > max_tokens:
                units.append(unit)
                costs.append(cost)
                unit, cost, extra = [], 0, seq_lens[i]
            unit.append(i)
            cost += extra
        if unit:
            units.append(unit)
            costs.append(cost)
    return units, costs


def plan_token_budget(seq_lens: Sequence[int], max_tokens: int,
                      num_micro_batches: int | None = None,
                      groups: Groups | None = None) -> list[list[int]]:
    """Fewest balanced micro-batches with at most ``max_tokens`` tokens each.

    ``num_micro_batches`` forces at least that many (capped at the row count), so that
    data-parallel ranks agree on a count. Raises if one row alone exceeds the budget.
    ``groups``: plan the rows sharing a prompt as units (see the module docstring); when
    the forced count exceeds the units, rows are planned alone.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} must be >= 1")
    n = len(seq_lens)
    if n == 0:
        return []
    k = max(min_micro_batches(seq_lens, max_tokens), min(num_micro_batches or 1, n))
    units, costs = [[i] for i in range(n)], list(seq_lens)
    if groups is not None:
        shared_units, shared_costs = share_units(seq_lens, max_tokens, groups)
        if sorted(i for u in shared_units for i in u) != list(range(n)):
            raise ValueError(f"groups must hold every one of the {n} rows exactly once")
        if (num_micro_batches or 1) <= len(shared_units):
            units, costs = shared_units, shared_costs
            k = max(min_micro_batches(costs, max_tokens), min(num_micro_batches or 1, n))
    while True:
        plan = balanced_partition(costs, k)
        if max(sum(costs[u] for u in b) for b in plan) <= max_tokens or k == len(units):
            return sorted((sorted(i for u in b for i in units[u]) for b in plan), key=lambda b: b[0])
        k += 1


def count_token_budget(seq_lens: Sequence[int], max_tokens: int,
                       groups: Groups | None = None) -> int:
    """How many micro-batches :func:`plan_token_budget` makes without a forced count."""
    return len(plan_token_budget(seq_lens, max_tokens, groups=groups))
