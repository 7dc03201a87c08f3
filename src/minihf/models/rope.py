"""Rotary position embeddings (RoPE) with ``rope_theta`` and llama3 / linear scaling.

cos/sin live in a :class:`RopeTable` (one row per position), built on first use for the
device and dtype a forward runs in and then only looked up: recomputing them from the
inverse frequencies took ~10 small ops (~25 us) per forward, a visible share of a CPU decode
step. The table is a plain attribute, not a buffer, so the meta-device build
(``to_empty``), state dicts, FSDP and TP never see it and it cannot be left uninitialised.
The arithmetic follows transformers' (fp32 frequencies and angles, cos/sin cast to the
activation dtype), so logits match.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
    """cos, sin [..., head_dim] for integer ``positions`` [...] (transformers' layout: the
    head_dim/2 angles repeated twice)."""
    angles = positions[..., None].float() * freq  # [..., head_dim/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos and sign-folded sin for positions ``0..len-1``, for one device and dtype.

    ``table(positions, dtype, bound)`` returns cos, sin [B, 1, T, head_dim] ready for
    :func:`apply_rope`. ``bound``, where the caller knows one, is a host-side upper bound on
    the positions (a KV cache's length): the table covers it, with no look at the positions.
    Without it, on CPU the table grows to the largest position seen (a cheap host check);
    elsewhere it covers ``max_position_embeddings`` rows (or what :meth:`reserve` asked for),
    built once, so a forward never syncs with the device; positions beyond that are out of
    range there. A captured decode step reads no device value on the host, on any device
    (``tests/test_decode_step.py`` checks it on CPU).
    """

    def __init__(self, args: ModelArgs):
        self.args = args
        self.key: tuple | None = None
        self.cos = self.sin = None
        self.min_len = args.max_position_embeddings

    def reserve(self, length: int) -> None:
        """Cover positions ``0..length-1`` on every device (e.g. a generation engine whose
        ``max_model_len`` exceeds ``max_position_embeddings``)."""
        self.min_len = max(self.min_len, length)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None):
        if bound is None and positions.device.type == "cpu":
            bound = int(positions.max()) + 1 if positions.numel() else 1
        self.prepare(positions.device, dtype, bound)
        # F.embedding is the cheapest row gather; [B, T, hd] -> [B, 1, T, hd] broadcasts over heads
        return F.embedding(positions, self.cos)[:, None], F.embedding(positions, self.sin)[:, None]

    def prepare(self, device: torch.device, dtype: torch.dtype, bound: int | None = None) -> None:
        """Build the table for ``device`` and ``dtype`` unless it covers positions below
        ``bound`` already (and, off the CPU, ``min_len``)."""
        need = (bound or 1) if device.type == "cpu" else max(self.min_len, bound or 0)
        if self.key != (device, dtype) or self.cos.shape[0] < need:
            self._build(device, dtype, need)

    def _build(self, device: torch.device, dtype: torch.dtype, need: int) -> None:
        length = max(need, self.min_len) if device.type != "cpu" \
            else max(256, 1 << (need - 1).bit_length())  # CPU: powers of two, grown on demand
        cos, sin = rope_cos_sin(inv_freq(self.args, device), torch.arange(length, device=device), dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one op fewer per call, same bits
        self.cos, self.sin = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.key = (device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, head_dim] by cos and sign-folded sin [B, 1, T, head_dim]
    from :class:`RopeTable` (equal to transformers' ``x * cos + rotate_half(x) * sin``)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
