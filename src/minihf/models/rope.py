"""Rotary position embeddings (RoPE) with ``rope_theta`` and llama3 / linear scaling.

Deliberate choice: the inverse frequencies are recomputed in every forward (a handful of
ops on head_dim/2 numbers) instead of living in a buffer. A buffer would be left
uninitialised by the meta-device build (``to_empty``) unless every caller remembered to
refill it; recomputing cannot go stale and costs nothing measurable. The arithmetic follows
transformers' (fp32 frequencies, cos/sin cast to the activation dtype) so logits match.
"""

from __future__ import annotations

import math

import torch

from .args import ModelArgs


def inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    freq = 1.0 / (args.rope_theta ** exponents)
    scaling = args.rope_scaling
    if scaling is None:
        return freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(freq, scaling, args.max_position_embeddings)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _llama3(freq: torch.Tensor, s: dict, max_pos: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short kept, smooth
    interpolation in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s.get("original_max_position_embeddings", max_pos)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, T, head_dim] for integer ``positions`` [B, T]."""
    angles = positions[..., None].float() * freq  # [B, T, head_dim/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, head_dim] by cos/sin [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin
