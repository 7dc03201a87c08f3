"""Attention masking decided once per forward, shared by every layer.

Three layouts reach the model: a plain causal batch (SDPA ``is_causal``), a padded batch
with an ``attention_mask`` (left or right padding), and packed sequences delimited by
``cu_seqlens``. Packed input uses flash-attn's varlen kernel when it is installed and the
tensors are fp16/bf16 on CUDA, and otherwise SDPA over the sequences gathered into
right-padded batches of similar length (``segments``: sequences sorted by length and
bucketed, so the padded work is close to sum L_i^2, not S x L_max^2), then gathered back.
(A block-diagonal [T, T] mask over the packed row is the simple alternative, but its cost
grows with T^2: for the 256 short responses of an RL step packed into one row of 3,840
tokens it was 5x slower than a padded forward on CPU.) With a KV cache the cache supplies
the mask (see kv_cache.py), so none is built here.

Packed sequences may share a prefix (``shared_prefix``; the RL trainer packs a prompt
once for the ``n`` responses sampled from it): sequence ``s`` then continues sequence
``shared_prefix[s]`` and attends to that sequence's tokens as if they were written in front
of its own. flash-attn gets the keys of each continuation gathered after its prefix's
(``cu_seqlens_k`` != ``cu_seqlens``, causal aligned bottom-right); the SDPA buckets run
each continuation as the whole (prefix + own) sequence, the prefix's query rows read from
the first continuation.

Pad query rows always attend to themselves: a row with no allowed key would make SDPA
return NaN, and pads must stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

try:  # optional CUDA kernel; its absence only selects the SDPA path
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None


@dataclass
class AttnMeta:
    mask: torch.Tensor | None = None  # bool [B, 1, T, T], True = attend
    is_causal: bool = False
    cu_seqlens: torch.Tensor | None = None  # int32 [S+1], only for the flash varlen path
    max_seqlen: int = 0
    kv_gather: torch.Tensor | None = None   # flash path with shared prefixes: key/value rows
    cu_seqlens_k: torch.Tensor | None = None  # int32 [S+1] over the gathered keys
    max_seqlen_k: int = 0
    segments: Segments | None = None  # packed input without flash-attn
    sp: Any = None  # minihf.parallel.ulysses.SeqParallel: this rank runs a piece of the tokens


@dataclass
class Segments:
    """Where each packed token goes in the padded per-sequence batches, and back.

    Sequences are sorted by length and cut into buckets (:func:`plan_buckets`); bucket
    ``b`` is a right-padded ``[S_b, L_b]`` batch, gathered from the packed row by
    ``gather[b]`` (``[S_b * L_b]`` packed indices; pads repeat a real index). Right padding
    makes ``is_causal`` exact for real query rows (their keys are all real), so no mask is
    built; pad rows compute finite values nobody reads (and so get zero gradient).
    ``back`` [T] is each packed token's row in the concatenation of the buckets' outputs.
    """
    gather: list[torch.Tensor]  # per bucket, int64 [S_b * L_b]
    shapes: list[tuple[int, int]]  # per bucket, (S_b, L_b)
    back: torch.Tensor           # int64 [T]


def plan_buckets(lengths: list[int], overhead: int = 8192, max_cuts: int = 64) -> list[list[int]]:
    """Sequences (indices into ``lengths``) grouped into buckets of similar length,
    minimising the padded attention work ``sum_b S_b * L_b**2`` plus ``overhead`` per bucket
    (the fixed cost of one more kernel call), by dynamic programming over the sequences
    sorted by length. Buckets end only where the length changes, at no more than
    ``max_cuts`` evenly spread candidates (the plan stays cheap for large batches). Pure
    Python.

    >>> plan_buckets([10, 80, 12, 78])
    [[0, 2], [3, 1]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    if n == 0:
        return []
    ends = [j for j in range(1, n) if lengths[order[j]] != lengths[order[j - 1]]]
    if len(ends) > max_cuts:
        ends = [ends[round(k * (len(ends) - 1) / (max_cuts - 1))] for k in range(max_cuts)]
    ends.append(n)
    best = {0: 0.0}          # best[j]: cost of the first j sorted sequences
    cut = {}
    for j in ends:
        top = lengths[order[j - 1]]      # the longest in any bucket ending at j
        best[j], cut[j] = min((best[i] + (j - i) * top * top + overhead, i)
                              for i in best if i < j)
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


def _spans(cu_seqlens: torch.Tensor, T: int) -> tuple[list[int], list[int]]:
    """Start and length of each packed sequence; tokens past ``cu_seqlens[-1]`` form one
    more (padding) sequence."""
    cu = cu_seqlens.to(torch.int64).cpu()
    if int(cu[-1]) < T:
        cu = torch.cat([cu, cu.new_tensor([T])])
    return cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()


def _prefixes(shared_prefix: torch.Tensor | None, num_seqs: int) -> list[int]:
    """``shared_prefix`` as a list over all ``num_seqs`` sequences (the trailing padding
    sequence continues nothing), checked: a prefix is an earlier sequence that itself
    continues nothing."""
    if shared_prefix is None:
        return [-1] * num_seqs
    prefix = shared_prefix.tolist()
    prefix += [-1] * (num_seqs - len(prefix))
    for s, p in enumerate(prefix):
        if p != -1 and not (0 <= p < s and prefix[p] == -1):
            raise ValueError(f"shared_prefix[{s}]={p}: a sequence may only continue an earlier "
                             "sequence that continues nothing (-1 for none)")
    return prefix


def segments(cu_seqlens: torch.Tensor, T: int,
             shared_prefix: torch.Tensor | None = None) -> Segments:
    """``Segments`` for sequences packed at ``cu_seqlens`` in a row of ``T`` tokens; tokens
    past ``cu_seqlens[-1]`` form one more (padding) sequence. With ``shared_prefix`` a
    continuation's bucket row holds its prefix's tokens then its own; a prefix with
    continuations gets no row of its own (its tokens read back from its first
    continuation's row)."""
    starts, lens = _spans(cu_seqlens, T)
    prefix = _prefixes(shared_prefix, len(lens))
    continued = {p for p in prefix if p != -1}
    # each bucketed sequence as its packed token indices: (prefix +) own
    rows = {s: ([*range(starts[p], starts[p] + lens[p])] if p != -1 else [])
            + [*range(starts[s], starts[s] + lens[s])]
            for s, p in enumerate(prefix) if s not in continued}
    order = list(rows)
    gather, shapes, back = [], [], [0] * T
    placed = set()  # prefixes whose tokens already read back from a continuation's row
    row = 0
    for bucket in plan_buckets([len(rows[s]) for s in order]):
        L = len(rows[order[bucket[-1]]])
        idx = []
        for r, b in enumerate(bucket):
            s = order[b]
            toks, p = rows[s], prefix[s]
            reads = toks if p == -1 or p not in placed else toks[lens[p]:]
            placed.add(p)
            for j, t in enumerate(reads, start=len(toks) - len(reads)):
                back[t] = row + r * L + j
            idx += toks + toks[-1:] * (L - len(toks))
        gather.append(torch.tensor(idx, dtype=torch.int64))
        shapes.append((len(bucket), L))
        row += len(bucket) * L
    device = cu_seqlens.device
    return Segments([g.to(device) for g in gather], shapes,
                    torch.tensor(back, dtype=torch.int64, device=device))


def flash_varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (flash_attn_varlen_func is not None and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def _flash_shared_keys(cu: torch.Tensor, T: int, shared_prefix: torch.Tensor) -> dict:
    """flash-attn's view of shared prefixes: each sequence's keys are its prefix's tokens
    then its own, gathered into a new packed row (``kv_gather``) with ``cu_seqlens_k``."""
    starts, lens = _spans(cu, T)
    prefix = _prefixes(shared_prefix, len(lens))
    idx, cu_k = [], [0]
    for s, p in enumerate(prefix):
        if p != -1:
            idx += range(starts[p], starts[p] + lens[p])
        idx += range(starts[s], starts[s] + lens[s])
        cu_k.append(len(idx))
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return dict(kv_gather=torch.tensor(idx, dtype=torch.int64, device=cu.device),
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=cu.device),
                max_seqlen_k=max(lens_k))


def build_attn_meta(tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, dtype: torch.dtype,
                    shared_prefix: torch.Tensor | None = None) -> AttnMeta:
    """Decide how the layers attend for input ``tokens`` [B, T]."""
    B, T = tokens.shape
    device = tokens.device
    if shared_prefix is not None and cu_seqlens is None:
        raise ValueError("shared_prefix needs packed input (cu_seqlens): it names sequences "
                         "of the packed row")
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed rows) or attention_mask "
                             "(padded rows), not both")
        if B != 1:
            raise ValueError(f"packed input (cu_seqlens given) must have batch size 1, got "
                             f"tokens of shape {tuple(tokens.shape)}; concatenate the rows")
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        if flash_varlen_usable(device, dtype):
            if int(cu[-1]) < T:  # trailing padding becomes one extra sequence
                cu = torch.cat([cu, cu.new_tensor([T])])
            meta = AttnMeta(cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))
            if shared_prefix is not None:
                meta = AttnMeta(**{**vars(meta), **_flash_shared_keys(cu, T, shared_prefix)})
            return meta
        return AttnMeta(segments=segments(cu, T, shared_prefix))
    if attention_mask is not None:
        return AttnMeta(mask=padded_causal_mask(attention_mask.to(device)))
    return AttnMeta(is_causal=True)


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Causal mask [B, 1, T, T] that hides pad keys (attention_mask 0)."""
    T = attention_mask.shape[-1]
    idx = torch.arange(T, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    real_key = attention_mask.bool()[:, None, :]  # [B, 1, T]
    eye = torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    return ((causal & real_key) | eye)[:, None]
