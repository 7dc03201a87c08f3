"""Padding-free micro-batches: pack the real tokens of a padded batch into one row.

A padded batch ``[B, T]`` (prompts left-padded, responses right-padded) becomes one row
``[1, N]`` with ``N = attention_mask.sum()``, positions restarting at each sequence
(taken from ``position_ids``) and ``cu_seqlens`` marking the boundaries, so the model
attends within each sequence only. Outputs computed on the packed row are scattered back
to ``[B, T]`` with :func:`unpack` (zeros at the padding), which keeps every caller's
indexing (``[:, -R-1:-1]`` for response tokens) the same as on the padded path.

RL batches hold ``n`` responses per prompt. Packed with ``prompt_length``, a micro-batch
runs each distinct prompt once: its responses become sequences that continue it (the
model's ``shared_prefix``), which removes ``(n - 1) x`` prompt tokens from every forward
and backward. The outputs are the same as without sharing up to float rounding; a shared
token's gradient is the sum over its responses, as it is when each row has its own copy.
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
    slot: torch.Tensor        # [B*T] long: the packed token at each padded position, -1 at pads
    shared_prefix: torch.Tensor | None = None  # [S] long: the sequence each continues (-1: none)

    @property
    def max_seqlen(self) -> int:
        if len(self.cu_seqlens) < 2:
            return 0
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max().item())


def _spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """First and one-past-last real column of each row (contiguity checked)."""
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
    return first.tolist(), (last + 1).tolist()


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor, prompt_length: int,
                  spans: tuple[list[int], list[int]] | None = None) -> tuple[list[list[int]], list[int]]:
    """Rows that share a prompt: the rows grouped by the real tokens (and positions) in
    their first ``prompt_length`` columns, in order of first appearance, and each group's
    prompt length (0 for a row with no prompt token, which shares nothing). ``spans``:
    :func:`_spans` of ``attention_mask`` when the caller has them."""
    first, end = spans or _spans(attention_mask)
    ids, pos = input_ids.cpu(), position_ids.cpu()
    groups: dict = {}
    for i, (a, b) in enumerate(zip(first, end)):
        b = min(b, prompt_length)
        key = (ids[i, a:b].numpy().tobytes(), pos[i, a:b].numpy().tobytes()) if a < b else i
        groups.setdefault(key, []).append(i)
    return list(groups.values()), [max(0, min(end[g[0]], prompt_length) - first[g[0]])
                                   for g in groups.values()]


def response_prompt_groups(data: dict) -> tuple[list[list[int]], list[int]]:
    """:func:`prompt_groups` of an RL batch (the prompt is what precedes ``responses``)."""
    prompt_length = data["input_ids"].shape[1] - data["responses"].shape[1]
    return prompt_groups(data["input_ids"], data["attention_mask"], data["position_ids"],
                         prompt_length)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         position_ids: torch.Tensor, prompt_length: int | None = None) -> Packed:
    """Pack the real tokens of ``input_ids`` ``[B, T]`` (``attention_mask`` 1 = real).

    Each row's real tokens must be contiguous (left-padded prompt + right-padded
    response is); rows with no real token are dropped from the packed row.

    With ``prompt_length`` (the prompt's column count, ``T - R``) rows with the same
    prompt share one copy of it (:func:`prompt_groups`): the packed row holds the prompt
    once (in its first row), and each row's response as a sequence that continues it
    (``shared_prefix``). A prompt of a single row stays one sequence with its response.
    ``slot`` maps every real padded position to the packed token holding it, shared ones
    included.
    """
    B, T = input_ids.shape
    first, end = spans = _spans(attention_mask)
    dev = input_ids.device
    owned = attention_mask.bool().clone()      # the positions that get a packed token
    head_of: dict[int, tuple[int, int]] = {}   # row of a shared prompt -> (head row, prompt length)
    if prompt_length is not None:
        for rows, plen in zip(*prompt_groups(input_ids, attention_mask, position_ids,
                                             prompt_length, spans)):
            if len(rows) > 1 and plen > 0:
                head_of.update((i, (rows[0], plen)) for i in rows)
                for i in rows[1:]:
                    owned[i, first[i]:first[i] + plen] = False
    lens: list[int] = []                       # each sequence's length, in packed (row) order
    prefix: list[int] = []                     # the sequence each one continues, -1: none
    prompt_seq: dict[int, int] = {}            # head row -> its prompt's sequence
    for i in range(B):  # a group's head row comes first, so its prompt precedes the readers
        h, plen = head_of.get(i, (i, 0))
        if h == i and plen:
            prompt_seq[i] = len(lens)
            lens.append(plen)
            prefix.append(-1)
        if end[i] - first[i] > plen:
            lens.append(end[i] - first[i] - plen)
            prefix.append(prompt_seq[h] if plen else -1)
    indices = owned.flatten().nonzero().squeeze(-1)                        # [N] row-major
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32, device=dev), 0)
    slot = torch.full((B * T,), -1, dtype=torch.long, device=dev)
    slot[indices] = torch.arange(len(indices), device=dev)
    for i, (h, plen) in head_of.items():  # a shared prompt's columns read the head row's tokens
        if i != h:
            slot[i * T + first[i]:i * T + first[i] + plen] = \
                slot[h * T + first[h]:h * T + first[h] + plen]
    return Packed(tokens=input_ids.flatten()[indices].unsqueeze(0),
                  positions=position_ids.flatten()[indices].unsqueeze(0),
                  cu_seqlens=cu, indices=indices, shape=(B, T), slot=slot,
                  shared_prefix=torch.tensor(prefix, dtype=torch.long, device=dev)
                  if any(p != -1 for p in prefix) else None)


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Per-token ``values`` ``[N, ...]`` back to ``[B, T, ...]`` (zeros at pads; a shared
    prompt's value at each of its rows)."""
    b, t = packed.shape
    out = values.new_zeros((b * t,) + tuple(values.shape[1:]))
    real = (packed.slot >= 0).nonzero().squeeze(-1)
    out[real] = values[packed.slot[real]]
    return out.view(b, t, *values.shape[1:])


def next_token_labels(packed: Packed) -> torch.Tensor:
    """Labels for next-token log-probs on the packed row: ``tokens`` shifted left by one.

    The label at each sequence's last token is the next sequence's first token; callers
    never read it (it lies beyond the response, or under the response mask). Not for
    shared prompts (a shared token has several next tokens).
    """
    if packed.shared_prefix is not None:
        raise ValueError("next_token_labels needs a packing without shared prompts "
                         "(pack without prompt_length)")
    return torch.roll(packed.tokens, shifts=-1, dims=1)                  # [1, N]
