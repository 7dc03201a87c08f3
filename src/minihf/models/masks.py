"""Attention masking decided once per forward, shared by every layer.

Three layouts reach the model: a plain causal batch (SDPA ``is_causal``), a padded batch
with an ``attention_mask`` (left or right padding), and packed sequences delimited by
``cu_seqlens``. Packed input uses flash-attn's varlen kernel when it is installed and the
tensors are fp16/bf16 on CUDA, and otherwise SDPA over the sequences gathered into a padded
[S, L_max] batch (``segments``), then scattered back. (A block-diagonal [T, T] mask over the
packed row is the simple alternative, but its cost grows with T^2: for the 256 short
responses of an RL step packed into one row of 3,840 tokens it was 5x slower than a
padded forward on CPU; segments cost S x L_max^2.) With a KV cache the cache supplies the
mask (see kv_cache.py), so none is built here.

Pad query rows always attend to themselves: a row with no allowed key would make SDPA
return NaN, and pads must stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    segments: Segments | None = None  # packed input without flash-attn


@dataclass
class Segments:
    """Where each packed token goes in a padded [S, L_max] batch of its sequences, and back."""
    gather: torch.Tensor  # int64 [S, L_max]: packed index of (sequence s, position j); 0 on pads
    seq: torch.Tensor     # int64 [T]: each packed token's sequence
    pos: torch.Tensor     # int64 [T]: its position in that sequence
    mask: torch.Tensor    # bool [S, 1, L_max, L_max]: causal over real keys (pads see themselves)


def segments(cu_seqlens: torch.Tensor, T: int) -> Segments:
    """``Segments`` for sequences packed at ``cu_seqlens`` in a row of ``T`` tokens; tokens
    past ``cu_seqlens[-1]`` form one more (padding) sequence."""
    cu = cu_seqlens.to(torch.int64)
    if int(cu[-1]) < T:
        cu = torch.cat([cu, cu.new_tensor([T])])
    lens = cu[1:] - cu[:-1]                                                   # [S]
    L = int(lens.max())
    j = torch.arange(L, device=cu.device)
    valid = j[None, :] < lens[:, None]                                         # [S, L]
    gather = torch.where(valid, cu[:-1, None] + j[None, :], torch.zeros_like(valid, dtype=torch.int64))
    idx = torch.arange(T, device=cu.device)
    seq = torch.bucketize(idx, cu[1:], right=True)                             # [T]
    pos = idx - cu[seq]
    causal = j[None, :] <= j[:, None]                                          # [L, L]
    eye = torch.eye(L, dtype=torch.bool, device=cu.device)
    mask = ((causal[None] & valid[:, None, :]) | eye[None])[:, None]           # [S, 1, L, L]
    return Segments(gather, seq, pos, mask)


def flash_varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (flash_attn_varlen_func is not None and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16))


def build_attn_meta(tokens: torch.Tensor, attention_mask: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, dtype: torch.dtype) -> AttnMeta:
    """Decide how the layers attend for input ``tokens`` [B, T]."""
    B, T = tokens.shape
    device = tokens.device
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
            return AttnMeta(cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))
        return AttnMeta(segments=segments(cu, T))
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
