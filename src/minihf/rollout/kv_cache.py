"""Slot KV cache for continuous batching (implements the models' ``update`` protocol).

One preallocated buffer ``[layers, slots, kv_heads, max_len, head_dim]`` for keys and one
for values; a slot is one sequence's row. Unlike ``minihf.models.KVCache`` (rows 0..B-1,
attends over all ``max_len`` positions) the engine tells this cache, once per forward, which
mode it is in, and the mask is built once per forward rather than once per layer:

* prefill: new sequences go to arbitrary ``slots``, their prompts right-padded to T and
  written at positions 0..T-1. Attention needs only the new keys themselves (prompts start
  at position 0), so ``update`` returns them with a causal mask and never reads the buffer.
* decode: rows ``[0, rows)`` each append one token at their own position; attention reads
  only the used prefix ``[:rows, :, :kv_len]`` of the buffer (``kv_len`` = longest row),
  with ``mask[b, s] = s <= position[b]`` hiding other rows' longer tails and stale entries
  left by a slot's previous occupant.
* extend (multi-turn): sequences already in ``slots`` append T tokens (right-padded) from
  their own start positions; attention reads each slot's cached prefix plus the new keys.

For a mixture-of-experts model the cache can also keep, beside each cached position, the
experts each MoE layer routed that token to (:meth:`enable_routes`: ``routes`` [slots,
max_len, MoE layers, k], written by the layers through ``recorder`` at the same places as
the keys, moved with them, -1 where nothing was written): rollout routing replay's record,
kept on the device with no host sync per step.
"""

from __future__ import annotations

import torch

from minihf.models.moe import MoEStep


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, n_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        # per-step index arithmetic, precomputed: key positions, and the flat offset of
        # (slot b, head h, position 0) in one layer viewed as [slots * heads * max_len, hd]
        self._keys = torch.arange(max_len, device=device)
        self._base = (torch.arange(num_slots * n_kv_heads, device=device) * max_len).view(num_slots, n_kv_heads)
        self._prefill_slots: torch.Tensor | None = None
        self._extend_slots: torch.Tensor | None = None
        self._rows = 0
        self._kv_len = 0
        self._mask: torch.Tensor | None = None
        self.routes: torch.Tensor | None = None
        self.recorder: MoEStep | None = None  # what the engine's forwards pass as the model's ``moe``
        self._route_rows: torch.Tensor | None = None

    def enable_routes(self, moe_layers: int, top_k: int, num_experts: int) -> None:
        """Keep each cached token's expert ids per MoE layer (module docstring)."""
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.routes = torch.full((self.num_slots, self.max_len, moe_layers, top_k), -1, dtype=dtype,
                                 device=self.k.device)
        self._slot_base = torch.arange(self.num_slots, device=self.k.device) * self.max_len
        self.recorder = MoEStep(record=self.record_routes)

    def record_routes(self, moe_layer: int, ids: torch.Tensor) -> None:
        """Write MoE layer ``moe_layer``'s expert ids [rows x T, k] of this forward's tokens."""
        table = self.routes.view(-1, *self.routes.shape[2:])[:, moe_layer]    # [slots*max_len, k]
        table.index_copy_(0, self._route_rows, ids.to(table.dtype))

    def routes_of(self, slot: int, length: int) -> torch.Tensor:
        """A copy of ``slot``'s first ``length`` positions' routes [length, L, k] (device)."""
        return self.routes[slot, :length].clone()

    @staticmethod
    def bytes_per_slot(num_layers: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * n_kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()

    def fits(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (self.num_slots >= num_slots and self.max_len >= max_len and self.k.dtype == dtype
                and self.k.device == torch.device(device))

    # -- the engine sets the mode before each forward -------------------------------------
    def begin_prefill(self, slots: torch.Tensor, T: int) -> None:
        """Next forward writes prompts (right-padded to ``T``) into ``slots`` [k]."""
        self._prefill_slots, self._extend_slots = slots, None
        idx = torch.arange(T, device=slots.device)
        self._mask = (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, T, T]
        if self.routes is not None:
            self._route_rows = (self._slot_base[slots][:, None] + idx).reshape(-1)

    def begin_decode(self, positions: torch.Tensor, kv_len: int, same_length: bool = False) -> None:
        """Next forward appends one token to each row ``[0, len(positions))`` at ``positions`` [B];
        ``kv_len`` = 1 + the largest position (passed in: the host knows it, no device sync).
        ``same_length``: every row is at position ``kv_len - 1``, so every key is attended to
        and no mask is needed (batch 1 always; saves the mask and its use in every layer).
        Device ops only (no host sync), so a static decode step can capture it: ``kv_len``
        may then exceed every row's position (a length bucket), the mask hiding the rest."""
        self._prefill_slots = self._extend_slots = None
        self._rows = positions.shape[0]
        self._kv_len = kv_len
        self._mask = None if same_length else \
            (self._keys[None, :kv_len] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, S]
        # one index_copy_ per layer (cheaper than an advanced-index put), index built once per step
        self._flat = (self._base[: self._rows] + positions[:, None]).reshape(-1)
        if self.routes is not None:  # decode row b is slot b
            self._route_rows = self._slot_base[: self._rows] + positions

    def begin_extend(self, slots: torch.Tensor, starts: torch.Tensor, T: int, kv_len: int) -> None:
        """Next forward writes T tokens per sequence into ``slots`` [k] at positions
        ``starts[b] .. starts[b] + T - 1`` (``kv_len`` >= every ``starts[b] + T``, at most
        ``max_len``; padding writes land past a row's real tokens, where later tokens
        overwrite them before they are read)."""
        if kv_len > self.max_len:
            raise ValueError(f"extend reaches position {kv_len} but the cache holds {self.max_len}")
        self._prefill_slots, self._extend_slots = None, slots
        self._kv_len = kv_len
        q_pos = starts[:, None] + torch.arange(T, device=slots.device)            # [k, T]
        self._mask = (self._keys[None, None, :kv_len] <= q_pos[:, :, None])[:, None]  # [k, 1, T, S]
        if self.routes is not None:
            self._route_rows = (self._slot_base[slots][:, None] + q_pos).reshape(-1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write ``k, v`` [B, n_kv, T, hd] at ``positions`` [B, T]; return keys, values, mask."""
        if self._extend_slots is not None:
            slots = self._extend_slots
            rows = slots[:, None].expand_as(positions)
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = v.transpose(1, 2)
            S = self._kv_len
            return self.k[layer][slots, :, :S], self.v[layer][slots, :, :S], self._mask
        if self._prefill_slots is not None:
            rows = self._prefill_slots[:, None].expand_as(positions)
            self.k[layer][rows, :, positions] = k.transpose(1, 2)
            self.v[layer][rows, :, positions] = v.transpose(1, 2)
            return k, v, self._mask
        hd = k.shape[-1]
        self.k[layer].view(-1, hd).index_copy_(0, self._flat, k.reshape(-1, hd))
        self.v[layer].view(-1, hd).index_copy_(0, self._flat, v.reshape(-1, hd))
        S, B = self._kv_len, self._rows
        return self.k[layer, :B, :, :S], self.v[layer, :B, :, :S], self._mask

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]
