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


def plan_token_budget(seq_lens: Sequence[int], max_tokens: int,
                      num_micro_batches: int | None = None) -> list[list[int]]:
    """Fewest balanced micro-batches with at most ``max_tokens`` tokens each.

    ``num_micro_batches`` forces at least that many (capped at the row count), so that
    data-parallel ranks agree on a count. Raises if one row alone exceeds the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} must be >= 1")
    n = len(seq_lens)
    if n == 0:
        return []
    k = max(min_micro_batches(seq_lens, max_tokens), min(num_micro_batches or 1, n))
    while True:
        plan = balanced_partition(seq_lens, k)
        if max(sum(seq_lens[i] for i in b) for b in plan) <= max_tokens or k == n:
            return plan
        k += 1


def count_token_budget(seq_lens: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches :func:`plan_token_budget` makes without a forced count."""
    return len(plan_token_budget(seq_lens, max_tokens))
