"""DAPO's plug-ins (Yu et al., 2025).

``DynamicSampling`` (``algorithm.filter_groups``) replaces the step's ``rollout`` phase by
``dynamic_rollout``: generation rounds, each keeping the groups whose samples score
differently, joined across rounds whose prompts were padded to different widths.
``OverlongPenalty`` (``reward_model.overlong_buffer``) wraps the ``reward`` phase: a
response past ``max_response_length - len`` tokens loses up to ``penalty_factor``.
"""

from __future__ import annotations

import numpy as np
import torch

from minihf.protocol import Batch
from minihf.trainer.metrics import group_metrics
from minihf.trainer.phases import Phase, Plugin, StepContext, replace, wrap
from minihf.trainer.reward import at_last_token, overlong_penalty


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


def dynamic_rollout(ctx: StepContext, m: dict) -> tuple[Batch, dict]:
    """Generation rounds of ``data.gen_batch_size`` prompts, each keeping only the groups
    whose samples score differently, until ``train_batch_size`` prompts are kept (the
    surplus is dropped). ``train/num_gen_batches``: the rounds; the rounds' own metrics
    are returned averaged over their rows."""
    cfg, n = ctx.cfg, ctx.cfg.actor_rollout_ref.rollout.n
    need, limit = cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches
    kept, generated, weighted, rows = [], [], {}, 0
    while sum(len(b) for b in kept) < need * n:
        if limit and len(generated) >= limit:
            have = sum(len(b) for b in kept) // n
            raise RuntimeError(
                f"algorithm.filter_groups: after {len(generated)} generation rounds only {have} of "
                f"data.train_batch_size={need} prompts had samples that score differently (the task "
                "is too easy or too hard for the policy); raise algorithm.filter_groups."
                "max_num_gen_batches (0: no limit), actor_rollout_ref.rollout.n or "
                "data.gen_batch_size, or set algorithm.filter_groups.enable=false")
        batch, metrics = ctx.rollout(ctx.loader.next_batch(), len(generated))
        for k, v in metrics.items():
            weighted[k] = weighted.get(k, 0.0) + v * len(batch)
        rows += len(batch)
        generated.append((batch["token_level_scores"].sum(-1), batch.non_tensors["uid"]))
        rows_kept = varied_group_rows(generated[-1][0], n)
        if len(rows_kept):
            kept.append(batch[rows_kept])
    batch = Batch.concat(align_prompts(kept, ctx.tokenizer.pad_token_id))
    batch = batch[np.arange(need * n)]
    m["train/num_gen_batches"] = len(generated)
    m.update(group_metrics(torch.cat([s for s, _ in generated]),
                           np.concatenate([u for _, u in generated])))
    return batch, {k: v / rows for k, v in weighted.items()}


class DynamicSampling(Plugin):
    """Rounds of ``data.gen_batch_size`` prompts (the loader draws that many) until
    ``train_batch_size`` prompts whose samples differ are kept."""
    name = "dynamic_sampling"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.algorithm.filter_groups.enable

    @classmethod
    def check_config(cls, cfg) -> None:
        d = cfg.data
        if d.gen_batch_size is not None and not cfg.algorithm.filter_groups.enable:
            raise ValueError(f"data.gen_batch_size={d.gen_batch_size} sets the prompts per generation "
                             "round of dynamic sampling; drop it, or set algorithm.filter_groups."
                             "enable=true")
        if cfg.algorithm.filter_groups.enable and cfg.actor_rollout_ref.rollout.n < 2:
            raise ValueError("algorithm.filter_groups needs groups: set actor_rollout_ref.rollout.n >= 2")

    def hooks(self):
        return [replace("rollout", Phase("rollout", self.rollout, timed=False))]

    @staticmethod
    def rollout(ctx: StepContext, _batch: Batch, m: dict) -> Batch:
        batch, metrics = dynamic_rollout(ctx, m)
        m.update(metrics)
        return batch


class OverlongPenalty(Plugin):
    """The length penalty on training scores (validation reports the task's score):
    ``reward/overlong_penalty/mean``, ``reward/overlong_frac``."""
    name = "overlong_penalty"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.reward_model.overlong_buffer.enable

    @classmethod
    def check_config(cls, cfg) -> None:
        o, limit = cfg.reward_model.overlong_buffer, cfg.data.max_response_length
        if o.enable and o.len > limit:
            raise ValueError(f"reward_model.overlong_buffer.len={o.len} exceeds data.max_response_length={limit}")

    def hooks(self):
        return [wrap("reward", self.penalise)]

    @staticmethod
    def penalise(ctx: StepContext, batch: Batch, m: dict, inner) -> None:
        inner(ctx, batch, m)
        o = ctx.cfg.reward_model.overlong_buffer
        # the response's length as the cap counts it: a multi-turn response's observation
        # tokens too (verl's, from the attention mask); response_mask holds the model's only
        length = batch["attention_mask"][:, -batch["responses"].shape[1]:].sum(-1)
        penalty = overlong_penalty(length, ctx.cfg.data.max_response_length, o.len, o.penalty_factor)
        batch.tensors["token_level_scores"] = (batch["token_level_scores"]
                                               + at_last_token(penalty, batch["response_mask"]))
        m["reward/overlong_penalty/mean"] = penalty.mean().item()
        m["reward/overlong_frac"] = (penalty < 0).float().mean().item()
