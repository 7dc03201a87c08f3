"""KVCache: the default static key/value cache for incremental decoding.

Preallocated buffers of fixed shape (so compiled / CUDA-graph decode steps see the same
shapes every step), indexed by absolute position: the key of the token at position p of
row b lives in slot p of row b. The attention layer calls
``k, v, mask = cache.update(layer_idx, k_new, v_new, positions)``; any class with that
method can replace this one.

The rollout engine brings its own (``minihf.rollout.kv_cache.SlotKVCache``: slots that
sequences take and give back, sized by a memory budget). This one stays beside it as the
model layer's own: ``minihf.models`` decodes incrementally with it, below the engine, and
the parity tests check that decoding against transformers without the engine in the way.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_batch: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (num_layers, max_batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # filled[b] = 1 + highest position written in row b (same for every layer)
        self.filled = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, max_batch: int, max_len: int, dtype=None, device=None) -> "KVCache":
        """A cache sized for ``model`` (reads head counts from its attention modules, so
        it follows tensor-parallel sharding)."""
        attn = model.model.layers[0].self_attn
        p = next(model.parameters())
        return cls(len(model.model.layers), max_batch, attn.num_kv_heads, max_len,
                   attn.head_dim, dtype or p.dtype, device or p.device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write ``k, v`` [B, n_kv, T, hd] at ``positions`` [B, T] of rows 0..B-1 and return
        the cached keys/values [B, n_kv, max_len, hd] and the mask [B, 1, T, max_len]
        (True where key slot <= query position and the slot has been written)."""
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)[:, None].expand_as(positions)
        # advanced indices on dims 0 and 2 -> the indexed view is [B, T, n_kv, hd]
        self.k[layer_idx][rows, :, positions] = k.transpose(1, 2)
        self.v[layer_idx][rows, :, positions] = v.transpose(1, 2)
        if layer_idx == 0:
            self.filled[:B] = torch.maximum(self.filled[:B], positions.max(dim=1).values + 1)
        slots = torch.arange(self.max_len, device=k.device)
        mask = (slots[None, None, :] <= positions[:, :, None]) & \
               (slots[None, None, :] < self.filled[:B, None, None])
        return self.k[layer_idx, :B], self.v[layer_idx, :B], mask[:, None]
