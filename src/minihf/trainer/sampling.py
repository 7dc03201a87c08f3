"""DAPO's dynamic sampling, the pure parts: which rows of a round to keep, and joining
rounds whose prompts were padded to different widths (the loop is
``PPOTrainer._dynamic_rollout``)."""

from __future__ import annotations

import numpy as np
import torch

from minihf.protocol import Batch


def varied_group_rows(scores: torch.Tensor, n: int) -> np.ndarray:
    """Row indices of the groups (``n`` consecutive rows each) whose sequence ``scores``
    [B] are not all equal, whole groups in order."""
    grouped = scores.view(-1, n)                                             # [P, n]
    varied = (grouped.max(-1).values > grouped.min(-1).values).nonzero().squeeze(-1)
    return (varied[:, None] * n + torch.arange(n)).flatten().numpy()


def align_prompts(batches: list[Batch], pad_id: int) -> list[Batch]:
    """Rollout batches whose prompts were left-padded to different widths, left-padded to
    the widest (``prompts``, and the prompt part of ``input_ids``/``attention_mask``/
    ``position_ids``) so they concatenate; the padding is masked out as any other."""
    width = max(b["prompts"].shape[1] for b in batches)
    fill = {"prompts": pad_id, "input_ids": pad_id, "attention_mask": 0, "position_ids": 0}
    out = []
    for b in batches:
        extra = width - b["prompts"].shape[1]
        if extra:
            tensors = dict(b.tensors)
            for key, value in fill.items():
                t = tensors[key]
                tensors[key] = torch.cat([t.new_full((t.shape[0], extra), value), t], dim=1)
            b = Batch(tensors, b.non_tensors, b.meta)
        out.append(b)
    return out
