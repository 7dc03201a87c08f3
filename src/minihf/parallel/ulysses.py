"""Ulysses sequence parallelism: one packed micro-batch's tokens split over an SP group.

DeepSpeed-Ulysses as verl applies it (``ulysses_sequence_parallel_size``), for the trainer's
padding-free forward. The ``s`` ranks of an SP group hold the same micro-batch; its packed
row of ``N`` tokens (padded to a multiple of ``s``) is cut into ``s`` contiguous pieces and
rank ``j`` runs the embedding, the norms, the projections and the MLPs on piece ``j`` alone,
so a block's activations per rank are ``1/s`` of the sequence's. Attention needs every
token: an all-to-all turns ``[N/s tokens, all heads]`` into ``[N tokens, heads/s]`` before it
and back after it. Query heads are split in contiguous ranges as evenly as the count allows
(SmolLM2's 9 over 2 ranks: 5 and 4), and each rank receives the KV heads its query heads
read, no more (SmolLM2's 3 KV heads: 2 to each rank, the middle one to both; verl needs SP
to divide the query heads, and to divide or be divided by the KV heads, which it repeats).
Where a rank's query heads do not group evenly over its KV heads (SmolLM2's rank 0: 3 heads
on the first, 2 on the second), :meth:`SeqParallel.to_heads` says so and attention runs once
per even group (``minihf.models.layers.Attention``).

The outputs a caller reads (log-probs at response tokens, values) are put back whole on
every rank by :meth:`SeqParallel.whole`: each rank writes its tokens into a zero tensor and
the group sums them. Every SP rank then computes the same loss from the same numbers, so
the sum's backward passes the gradient through unchanged and each rank's own tokens take
their part: the gradients of the ``s`` ranks add up (in FSDP's reduce-scatter) to the
micro-batch's. ``minihf.workers.train_state`` normalises the loss so (see ``TrainState.update``).

Which rows a rank holds: the controller gives every rank its own rows, as without SP;
:meth:`SeqParallel.gather_rows` unites the rows of an SP group on each of its ranks before
the micro-batches are cut, and :meth:`SeqParallel.own_rows` hands each rank back its own
outputs. The driver, dispatch and collect are unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F


def head_split(heads: int, size: int) -> list[int]:
    """Heads per rank: contiguous ranges as even as ``heads`` allows (the first ranks one more)."""
    if size > heads:
        raise ValueError(f"{size} sequence-parallel ranks but {heads} attention heads: every rank "
                         f"needs at least one head; use at most {heads}")
    return [heads // size + (j < heads % size) for j in range(size)]


@functools.cache  # pure in its ints, asked once per attention layer per forward
def head_ranges(heads: int, kv_heads: int, size: int) -> tuple[tuple[int, int, int, int], ...]:
    """Per rank ``(a, b, c, d)``: its query heads ``[a, b)`` (:func:`head_split`) and the KV
    heads ``[c, d)`` they read (query head ``i`` reads KV head ``i // (heads / kv_heads)``)."""
    group, out, a = heads // kv_heads, [], 0
    for n in head_split(heads, size):
        out.append((a, a + n, a // group, (a + n - 1) // group + 1))
        a += n
    return tuple(out)


@functools.cache
def attention_groups(a: int, b: int, group: int, c: int) -> tuple[tuple[int, int, int, int], ...]:
    """Query heads ``[a, b)`` reading KV heads from ``c`` on, ``group`` query heads per KV
    head, cut into calls of grouped-query attention: ``(q_lo, q_hi, kv_lo, kv_hi)`` local to
    the rank, each with the same number of query heads on each of its KV heads (runs of query
    heads on one KV head, neighbouring runs of equal length merged)."""
    runs, i = [], a
    while i < b:
        j = min(b, (i // group + 1) * group)
        runs.append([i - a, j - a, i // group - c, i // group - c + 1])
        i = j
    calls = [runs[0]]
    for r in runs[1:]:
        last = calls[-1]
        if r[1] - r[0] == (last[1] - last[0]) // (last[3] - last[2]):
            last[1], last[3] = r[1], r[3]
        else:
            calls.append(r)
    return tuple(tuple(g) for g in calls)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0; its gradient goes back by the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class _Whole(torch.autograd.Function):
    """Sum over the group; the gradient passes unchanged (every rank's loss is the same)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SeqParallel:
    """This rank's place in an SP group (``group``: a process group of ``size`` > 1 ranks)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @property
    def leader(self) -> bool:
        """Rank 0 of the group: the one whose copy of shared rows counts in global sums."""
        return self.rank == 0

    # -- the token dimension --------------------------------------------------------------
    def padded(self, n: int) -> int:
        """``n`` tokens rounded up to a multiple of the group size."""
        return -(-n // self.size) * self.size

    def pad(self, row: torch.Tensor) -> torch.Tensor:
        """A packed ``[1, N]`` row with zeros appended up to :meth:`padded` ``(N)`` (the
        attention mask makes trailing tokens a sequence of their own)."""
        return F.pad(row, (0, self.padded(row.shape[1]) - row.shape[1]))

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's tokens ``[lo, hi)`` of a padded row of ``n``."""
        if n % self.size:
            raise ValueError(f"a row of {n} tokens does not split over {self.size} sequence-"
                             "parallel ranks; pad it first (SeqParallel.pad)")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def whole(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's ``[n / size, ...]`` piece of a per-token tensor made whole ``[n, ...]``
        on every rank (see the module docstring for its gradient)."""
        lo, hi = self.bounds(n)
        rest = [0, 0] * (local.dim() - 1)
        return _Whole.apply(F.pad(local, rest + [lo, n - hi]), self.group)

    def scatter(self, values: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """``values`` computed at the positions ``mine`` (bool ``[M]``) selects, made whole
        ``[M, ...]`` on every rank (each position is some rank's)."""
        out = values.new_zeros((mine.shape[0],) + tuple(values.shape[1:]))
        out = out.index_put((mine.nonzero().squeeze(-1),), values)
        return _Whole.apply(out, self.group)

    # -- heads -----------------------------------------------------------------------------
    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``[1, heads, n, hd]`` on each rank (its tokens, every head) -> ``[1, heads_j, N,
        hd]`` (every token, its query heads) for q and ``[1, kv_j, N, hd]`` for k and v (the
        KV heads those read); and the groups attention runs over (:func:`attention_groups`:
        None for one call)."""
        h, kv = q.shape[1], k.shape[1]
        ranges = head_ranges(h, kv, self.size)
        q_ranges = [(a, b) for a, b, _, _ in ranges]
        kv_ranges = [(c, d) for _, _, c, d in ranges]
        a, b, c, _ = ranges[self.rank]
        groups = attention_groups(a, b, h // kv, c)
        return (self._gather_tokens(q, q_ranges), self._gather_tokens(k, kv_ranges),
                self._gather_tokens(v, kv_ranges), groups if len(groups) > 1 else None)

    def _gather_tokens(self, x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Every rank's tokens of the heads ``ranges[rank]`` (heads may go to several ranks)."""
        _, h, n, hd = x.shape
        lo, hi = ranges[self.rank]
        mine = hi - lo
        flat = x[0].reshape(h, n * hd)
        partition = ranges[0][0] == 0 and ranges[-1][1] == h and all(
            ranges[j][1] == ranges[j + 1][0] for j in range(self.size - 1))
        if not partition:  # a KV head read by two ranks' query heads is sent to both
            flat = torch.cat([flat[u:w] for u, w in ranges])
        out = _AllToAll.apply(flat, [mine] * self.size, [w - u for u, w in ranges], self.group)
        # [size * mine, n*hd], source rank major -> [mine, size * n, hd]
        return out.view(self.size, mine, n, hd).transpose(0, 1).reshape(1, mine, self.size * n, hd)

    def to_tokens(self, out: torch.Tensor, heads: int) -> torch.Tensor:
        """Attention's ``[1, N, heads_j * hd]`` (every token, this rank's heads) -> ``[1, n,
        heads * hd]`` (this rank's tokens, every head): the inverse of :meth:`to_heads`."""
        split = head_split(heads, self.size)
        mine = split[self.rank]
        N = out.shape[1]
        n, hd = N // self.size, out.shape[2] // mine
        x = out[0].view(self.size, n, mine, hd).permute(0, 2, 1, 3).reshape(self.size * mine, n * hd)
        x = _AllToAll.apply(x, split, [mine] * self.size, self.group)        # [heads, n*hd]
        return x.view(heads, n, hd).transpose(0, 1).reshape(1, n, heads * hd)

    # -- rows ------------------------------------------------------------------------------
    def gather_rows(self, data: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], slice]:
        """The rows of every rank of the group, in group-rank order, on each of them (every
        tensor's dims past the first must agree); and the slice that is this rank's."""
        first = next(iter(data.values()))
        counts = torch.zeros(self.size, dtype=torch.long)
        counts[self.rank] = first.shape[0]
        dist.all_reduce(counts, group=self.group)
        counts = counts.tolist()
        top = max(counts)
        out = {}
        for key, t in data.items():
            padded = torch.cat([t, t.new_zeros((top - t.shape[0],) + tuple(t.shape[1:]))])
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(parts, padded.contiguous(), group=self.group)
            out[key] = torch.cat([p[:c] for p, c in zip(parts, counts)])
        start = sum(counts[:self.rank])
        return out, slice(start, start + counts[self.rank])

    @staticmethod
    def own_rows(out: dict[str, torch.Tensor], own: slice) -> dict[str, torch.Tensor]:
        return {k: v[own] for k, v in out.items()}


def seq_parallel(group) -> SeqParallel | None:
    """A :class:`SeqParallel` for ``group``, or None for no group or a group of one rank."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    return SeqParallel(group)


def check_sp_model(size: int, args, key: str, use_remove_padding: bool) -> None:
    """``key``'s SP ``size`` against the model it splits: one line naming the fix."""
    if size == 1:
        return
    if not use_remove_padding:
        raise ValueError(f"{key}={size} splits the packed (padding-free) row: set the role's "
                         "model.use_remove_padding=true, or set it to 1")
    if args.is_moe:
        raise ValueError(f"{key}={size}: sequence parallelism runs dense models only, and this one "
                         f"({args.arch}) is a mixture of experts; set it to 1")
    if size > args.num_attention_heads:
        raise ValueError(f"{key}={size} exceeds the model's {args.num_attention_heads} attention "
                         f"heads (each rank attends over at least one); use at most "
                         f"{args.num_attention_heads}")


def check_sp_ranks(size: int, ranks: int, key: str, role: str) -> None:
    """The SP size must divide the role's rank count."""
    if ranks % size:
        ok = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(f"{key}={size} does not divide the {role}'s {ranks} ranks; use one of {ok}")
