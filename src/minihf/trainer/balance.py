"""Spreading each mini-batch's tokens evenly over the data-parallel ranks (verl's
``trainer.balance_batch``), without changing what any mini-batch holds.

An update call cuts its batch into ``dp`` contiguous chunks, one per rank, and each rank
cuts its chunk into mini-batches of ``mini_batch_size / dp`` contiguous rows; every
optimizer step ends in collectives, so the rank with the most tokens in a mini-batch sets
the pace and the others wait for it. In the main job's batches (2 ranks) the busiest rank
held 6-7% more tokens than the mean, 0.5-1.4% balanced (``global_seqlen/imbalance``,
``global_seqlen/balanced_imbalance``); responses whose lengths vary more make the gap
larger. :func:`balanced_order` permutes the rows so that global mini-batch ``k``
holds exactly the rows it held before, whole groups of rows sharing a prompt kept on one
rank (they run their prompt once there), and gives the ranks its groups largest first,
each to the rank with the fewest tokens so far that has room. The update's result does
not depend on which rank computes which row (``tests/test_fsdp.py``), so only the waiting
changes. verl balances the whole batch instead, which moves rows between mini-batches.

Deciding is pure Python (tested without torch); :func:`balance_batch` applies it to a
rollout ``Batch`` for the driver.
"""

from __future__ import annotations

from minihf.protocol import Batch


def _mini_batches(num_rows: int, dp: int, mini_batch_size: int) -> list[list[list[int]]] | None:
    """``[k][r]``: the rows rank ``r`` holds in mini-batch ``k``, for the current order;
    None if the batch does not cut evenly (then there is nothing to balance)."""
    if dp < 1 or num_rows % dp or mini_batch_size % dp or mini_batch_size < dp:
        return None
    chunk = num_rows // dp
    local = min(mini_batch_size // dp, chunk)  # a larger mini-batch is the whole chunk
    if chunk % local:
        return None
    return [[list(range(r * chunk + k, r * chunk + k + local)) for r in range(dp)]
            for k in range(0, chunk, local)]


def rank_tokens(tokens: list[float], dp: int, mini_batch_size: int) -> list[list[float]] | None:
    """Tokens of each rank ``[k][r]`` in each mini-batch ``k`` for rows in this order."""
    layout = _mini_batches(len(tokens), dp, mini_batch_size)
    if layout is None:
        return None
    return [[sum(tokens[i] for i in rows) for rows in ranks] for ranks in layout]


def imbalance(tokens: list[float], dp: int, mini_batch_size: int) -> float | None:
    """Tokens the busiest rank holds beyond the ranks' mean, summed over the mini-batches,
    as a fraction of the mean (0: even; what the other ranks wait for)."""
    per = rank_tokens(tokens, dp, mini_batch_size)
    if not per:
        return None
    mean = sum(sum(k) / dp for k in per)
    return sum(max(k) - sum(k) / dp for k in per) / mean if mean else 0.0


def balanced_order(tokens: list[float], group_size: int, dp: int,
                   mini_batch_size: int) -> list[int]:
    """A permutation of the rows (``tokens[i]``: the work of row ``i``, e.g. its real
    tokens; rows in groups of ``group_size`` consecutive rows sharing a prompt) that keeps
    every mini-batch's rows and evens out its ranks' token counts (see the module
    docstring). Groups that do not fit a rank's share of a mini-batch are split into single
    rows; a mini-batch the split does not improve, and a batch that does not cut evenly
    over the ranks, keep their order.

    >>> balanced_order([9, 1, 1, 1], group_size=1, dp=2, mini_batch_size=4)
    [0, 1, 2, 3]
    >>> balanced_order([9, 9, 1, 1], group_size=1, dp=2, mini_batch_size=4)
    [0, 2, 1, 3]
    """
    n = len(tokens)
    layout = _mini_batches(n, dp, mini_batch_size)
    if layout is None or dp == 1:
        return list(range(n))
    local = len(layout[0][0])
    g = group_size if group_size > 0 and local % group_size == 0 and n % group_size == 0 else 1
    order = [0] * n
    for ranks in layout:
        rows = sorted(i for r in ranks for i in r)                   # mini-batch k, all ranks
        units = [rows[j:j + g] for j in range(0, len(rows), g)]
        weight = [sum(tokens[i] for i in u) for u in units]
        load, taken = [0] * dp, [[] for _ in range(dp)]
        for u in sorted(range(len(units)), key=lambda u: (-weight[u], u)):
            r = min((r for r in range(dp) if len(taken[r]) * g < local),
                    key=lambda r: (load[r], r))
            taken[r].append(u)
            load[r] += weight[u]
        if max(load) >= max(sum(tokens[i] for i in r) for r in ranks):
            taken = [[rows.index(r[0]) // g + j for j in range(local // g)] for r in ranks]
        for r, slots in zip(range(dp), ranks):
            mine = [i for u in sorted(taken[r]) for i in units[u]]
            for slot, row in zip(slots, mine):
                order[slot] = row
    return order


def balance_batch(batch: Batch, metrics: dict, dp: int, group_size: int, mini_batch_size: int,
                  shares_prompt: bool) -> Batch:
    """``batch`` (rollout rows, ``group_size`` per prompt) in :func:`balanced_order`, each
    row weighed by its real tokens (a shared prompt's once per group); adds
    ``global_seqlen/imbalance`` and ``global_seqlen/balanced_imbalance`` to ``metrics``."""
    mask = batch["attention_mask"]
    work = mask.sum(-1).double()                                             # [B]
    if shares_prompt and group_size > 1:
        work -= (1 - 1 / group_size) * mask[:, :batch["prompts"].shape[1]].sum(-1)
    tokens = work.tolist()
    order = balanced_order(tokens, group_size, dp, mini_batch_size)
    before = imbalance(tokens, dp, mini_batch_size)
    if before is not None:
        metrics["global_seqlen/imbalance"] = before
        metrics["global_seqlen/balanced_imbalance"] = imbalance([tokens[i] for i in order], dp,
                                                                mini_batch_size)
    return batch[order]


def layout_differences(cfg, roles, groups) -> list[str]:
    """Why balancing would not keep every trained role's mini-batches (empty: it does): each
    must cut the batch as the actor does (its ranks, mini-batch size and shuffle), without
    sequence parallelism (an SP group pools its ranks' rows before cutting)."""
    from minihf.config import section_of

    a, actor_dp = cfg.actor_rollout_ref.actor, groups["actor"].dp_size
    why = []
    for r in (r for r in roles if r.trains):
        section = section_of(cfg, r.trains)
        if (groups[r.name].dp_size, section.ppo_mini_batch_size, getattr(section, "shuffle", False)) \
                != (actor_dp, a.ppo_mini_batch_size, a.shuffle):
            why.append(f"{r.name} cuts its mini-batches otherwise than the actor")
        if (getattr(section, "ulysses_sequence_parallel_size", 1) or 1) > 1:
            why.append(f"{r.name} runs sequence parallel")
    return why
