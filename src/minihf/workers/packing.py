"""Padding-free micro-batches: pack the real tokens of a padded batch into one row.

A padded batch ``[B, T]`` (prompts left-padded, responses right-padded) becomes one row
``[1, N]`` with ``N = attention_mask.sum()``, positions restarting at each sequence
(taken from ``position_ids``) and ``cu_seqlens`` marking the boundaries, so the model
attends within each sequence only. Outputs computed on the packed row are scattered back
to ``[B, T]`` with :func:`unpack` (zeros at the padding), which keeps every caller's
indexing (``[:, -R-1:-1]`` for response tokens) the same as on the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    tokens: torch.Tensor      # [1, N] long
    positions: torch.Tensor   # [1, N] long, restart at 0 for each sequence
    cu_seqlens: torch.Tensor  # [S+1] int32, cumulative sequence lengths
    indices: torch.Tensor     # [N] long, flat index into the [B*T] padded layout
    shape: tuple[int, int]    # (B, T) of the padded batch

    @property
    def max_seqlen(self) -> int:
        if len(self.cu_seqlens) < 2:
            return 0
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         position_ids: torch.Tensor) -> Packed:
    """Pack the real tokens of ``input_ids`` ``[B, T]`` (``attention_mask`` 1 = real).

    Each row's real tokens must be contiguous (left-padded prompt + right-padded
    response is); rows with no real token are dropped from the packed row.
    """
    mask = attention_mask.bool()
    lens = mask.sum(-1)                                                  # [B]
    pos = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, pos, mask.shape[1]).min(-1).values        # [B]
    last = torch.where(mask, pos, -1).max(-1).values                     # [B]
    gaps = (lens > 0) & (last - first + 1 != lens)
    if bool(gaps.any()):
        bad = int(gaps.nonzero()[0].item())
        raise ValueError(f"row {bad} of attention_mask has a gap between real tokens; packing "
                         "needs each row's real tokens contiguous (left-padded prompt + "
                         "right-padded response)")
    indices = mask.flatten().nonzero().squeeze(-1)                       # [N]
    cu = torch.zeros(len(lens[lens > 0]) + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = torch.cumsum(lens[lens > 0], 0)
    return Packed(tokens=input_ids.flatten()[indices].unsqueeze(0),
                  positions=position_ids.flatten()[indices].unsqueeze(0),
                  cu_seqlens=cu, indices=indices, shape=tuple(input_ids.shape))


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Scatter per-token ``values`` ``[N, ...]`` back to ``[B, T, ...]`` (zeros at pads)."""
    b, t = packed.shape
    out = values.new_zeros((b * t,) + tuple(values.shape[1:]))
    out[packed.indices] = values
    return out.view(b, t, *values.shape[1:])


def next_token_labels(packed: Packed) -> torch.Tensor:
    """Labels for next-token log-probs on the packed row: ``tokens`` shifted left by one.

    The label at each sequence's last token is the next sequence's first token; callers
    never read it (it lies beyond the response, or under the response mask).
    """
    return torch.roll(packed.tokens, shifts=-1, dims=1)                  # [1, N]
