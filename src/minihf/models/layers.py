"""Decoder building blocks: RMSNorm, grouped-query attention, SwiGLU MLP, the block (whose
feed-forward is the MLP or, in a mixture-of-experts layer, ``minihf.models.moe.SparseMoE``).

Module and parameter names mirror transformers' Llama layout so state-dict keys equal
HF's and the parallelism code (apply_tp, apply_fsdp) can match on names. The attention
module reads its head counts from ``self.num_heads`` / ``self.num_kv_heads`` /
``self.head_dim`` at forward time, so tensor parallelism can shrink them after
construction. The KV cache is never owned here: it is passed in and asked for the keys
and values to attend to.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .args import ModelArgs
from .linear import Linear
from .masks import AttnMeta, flash_attn_varlen_func
from .moe import MoEStep, SparseMoE
from .rope import apply_rope


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in fp32 then cast back (as HF does);
    float64 input stays float64 (HF casts it down to fp32: a float64 reference forward then
    rounded its norms at fp32's level).

    fp32 input skips the (no-op) casts. ``F.rms_norm`` was tried: on CPU it is a composite of
    the same ops and measured no faster (5M decode step, A/B within noise). So was
    ``torch.compile`` (dynamic shapes) of this norm, SwiGLU's gate and RoPE: training
    forward+backward 1.05-1.10x on CPU (5M model, a packed GRPO micro-batch), a forward
    alone within noise, for ~25 s of compiling in every process: not adopted."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        H = args.hidden_size
        self.q_proj = Linear(H, self.num_heads * hd, bias=args.attention_bias)
        self.k_proj = Linear(H, self.num_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = Linear(H, self.num_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = Linear(self.num_heads * hd, H, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, positions, meta: AttnMeta, kv_cache=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = None
        if meta is not None and meta.sp is not None:  # Ulysses: every token, this rank's heads
            q, k, v, groups = meta.sp.to_heads(q, k, v)
        if kv_cache is not None:
            k, v, mask = kv_cache.update(self.layer_idx, k, v, positions)
            # (two batched matmuls instead: 2x faster attention at batch 128 on CPU, 1.05-1.07x
            # a whole RL generation, but their rounding flipped a greedy near-tie vs
            # transformers: 1/64 rows in bench_generate's 30M row, measured twice)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        elif groups is not None:  # Ulysses, query heads uneven over the KV heads: a call per group
            out = torch.cat([self._packed(q[:, a:b], k[:, c:d], v[:, c:d], meta) for a, b, c, d in groups], -1)
        elif meta.cu_seqlens is not None or meta.segments is not None:
            out = self._packed(q, k, v, meta)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask, is_causal=meta.is_causal,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        if out.dim() == 4:                                                       # [B, h, T, hd]
            out = out.transpose(1, 2).reshape(B, out.shape[2], -1)              # [B, T, h*hd]
        if meta is not None and meta.sp is not None:  # back to this rank's tokens, every head
            out = meta.sp.to_tokens(out, self.num_heads)
        return self.o_proj(out)

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """Causal attention within each sequence of a packed row: ``[1, heads, T, hd]`` (k, v:
        ``kv`` heads, a divisor of ``heads``) -> ``[1, T, heads * hd]``."""
        gqa = q.shape[1] != k.shape[1]
        if meta.cu_seqlens is not None:
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))                  # [T, h, hd]
            cu_k, max_k = meta.cu_seqlens, meta.max_seqlen
            if meta.kv_gather is not None:  # shared prefixes: each sequence's keys after its prefix's
                k, v = k.index_select(0, meta.kv_gather), v.index_select(0, meta.kv_gather)
                cu_k, max_k = meta.cu_seqlens_k, meta.max_seqlen_k
            # causal with more keys than queries aligns bottom-right (flash-attn >= 2.1)
            out = flash_attn_varlen_func(q, k, v, meta.cu_seqlens, cu_k, meta.max_seqlen, max_k,
                                         causal=True)                            # [T, h, hd]
            return out.reshape(1, out.shape[0], -1)
        seg, hd = meta.segments, self.head_dim  # no flash-attn: right-padded buckets
        tok = [t[0].transpose(0, 1) for t in (q, k, v)]                          # [T, h, hd]
        outs = []
        for idx, (S, L) in zip(seg.gather, seg.shapes):
            qs, ks, vs = (t.index_select(0, idx).view(S, L, -1, hd).transpose(1, 2) for t in tok)  # [S, h, L, hd]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            outs.append(o.transpose(1, 2).reshape(S * L, -1))                    # [S*L, h*hd]
        return torch.cat(outs).index_select(0, seg.back)[None]                  # [1, T, h*hd]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). ``intermediate_size``: a MoE expert's width."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        H, I = args.hidden_size, intermediate_size or args.intermediate_size
        self.gate_proj = Linear(H, I, bias=args.mlp_bias)
        self.up_proj = Linear(H, I, bias=args.mlp_bias)
        self.down_proj = Linear(I, H, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + ffn(norm(x)).

    The feed-forward's attribute is the checkpoint's name: ``mlp`` (a dense MLP, or
    Qwen3-MoE's sparse block) or ``block_sparse_moe`` (Mixtral); :attr:`ffn` reads it.
    ``moe`` (a :class:`minihf.models.moe.MoEStep`) reaches a sparse block only."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_name = "mlp"
        if not args.is_moe_layer(layer_idx):
            self.mlp = MLP(args)
        elif args.arch == "mixtral":
            self.ffn_name = "block_sparse_moe"
            self.block_sparse_moe = SparseMoE(args, layer_idx, expert_names="mixtral")
        else:
            self.mlp = SparseMoE(args, layer_idx)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x, cos, sin, positions, meta: AttnMeta, kv_cache=None, moe: MoEStep | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, meta, kv_cache)
        ffn = self.ffn
        if isinstance(ffn, SparseMoE):
            return x + ffn(self.post_attention_layernorm(x), moe)
        return x + ffn(self.post_attention_layernorm(x))
