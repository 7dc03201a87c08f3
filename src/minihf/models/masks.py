"""Attention masking decided once per forward, shared by every layer.

Three layouts reach the model: a plain causal batch (SDPA ``is_causal``), a padded batch
with an ``attention_mask`` (left or right padding), and packed sequences delimited by
``cu_seqlens``. Packed input uses flash-attn's varlen kernel when it is installed and the
tensors are fp16/bf16 on CUDA, and otherwise a block-diagonal causal boolean mask for
SDPA. With a KV cache the cache supplies the mask (see kv_cache.py), so none is built here.

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
        return AttnMeta(mask=packed_causal_mask(cu, T))
    if attention_mask is not None:
        return AttnMeta(mask=padded_causal_mask(attention_mask.to(device)))
    return AttnMeta(is_causal=True)


def packed_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, T, T] for sequences packed at ``cu_seqlens``;
    tokens past ``cu_seqlens[-1]`` form one more (padding) sequence."""
    idx = torch.arange(T, device=cu_seqlens.device)
    seq = torch.bucketize(idx, cu_seqlens[1:].to(idx.dtype), right=True)  # [T]
    same = seq[:, None] == seq[None, :]
    causal = idx[None, :] <= idx[:, None]
    return (same & causal)[None, None]


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Causal mask [B, 1, T, T] that hides pad keys (attention_mask 0)."""
    T = attention_mask.shape[-1]
    idx = torch.arange(T, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    real_key = attention_mask.bool()[:, None, :]  # [B, 1, T]
    eye = torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    return ((causal & real_key) | eye)[:, None]
