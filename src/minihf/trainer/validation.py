"""The RL run's validation pass: the validation prompts through the actor's generation
(``rollout.val_kwargs``), scored by the training reward, figures per data source.

Prompts go in ``data.val_batch_size`` batches (all at once by default), each prompt with
the uid ``val<index>``; the responses are scored by the path ``minihf eval`` takes
(``minihf.trainer.scoring``); plug-ins add figures of their own (Safe-RLHF's ``cost``).
Metrics: ``val-core/<source>/<figure>/mean@<n>``, ``val-core/mean`` (the reward over every
prompt), ``val-core/<figure>`` for the plug-ins', ``val/response_length/mean``, the
multi-turn figures as ``val/multi_turn/...`` and ``timing_s/testing``. The first batch's
first rows go to ``samples.jsonl`` when samples are logged.
"""

from __future__ import annotations

import time

import numpy as np

from minihf.multi_turn.loop import multi_turn_metrics, weighted_mean
from minihf.trainer.metrics import sample_rows
from minihf.trainer.phases import plugin_figures
from minihf.trainer.scoring import mean_by_source, score_responses


def validate(trainer, step: int) -> dict:
    """The validation metrics of ``trainer`` (a ``PPOTrainer``) at ``step``; {} without
    validation files."""
    val, cfg = trainer.val, trainer.cfg
    if val is None:
        return {}
    t0 = time.perf_counter()
    size = cfg.data.val_batch_size or len(val)
    figures: dict[str, list] = {"reward": []}  # + the plug-ins' (Safe-RLHF: "cost")
    rows: list = []
    mt_parts: list = []
    for start in range(0, len(val), size):
        batch = val.collate(list(range(start, min(len(val), start + size))))
        batch.non_tensors["uid"] = np.array([f"val{i}" for i in batch.non_tensors["index"]], dtype=object)
        out, _ = trainer.ctx.generate(batch, {"validate": True, "global_step": step})
        scored = score_responses(trainer.ctx.reward, out, trainer.env_only)
        if start == 0 and cfg.trainer.log_samples_freq > 0:
            trainer.log_samples(step, sample_rows(out, step, "val", trainer.ctx.reward, trainer.ctx.tokenizer,
                                                  cfg.trainer.log_samples_n, scores=[r.score for r in scored]))
        rows += scored
        figures["reward"] += [r.score for r in scored]
        if "multi_turn_turns" in out.tensors:  # per batch, weighted by its size below
            mt_parts.append((len(out), multi_turn_metrics(out)))
        for plugin in trainer.plugins:
            for name, values in plugin_figures(plugin, out).items():
                figures.setdefault(name, []).extend(values)
    k = cfg.actor_rollout_ref.rollout.val_kwargs.n
    sources = [r.source for r in rows]
    m = {f"val-core/{src}/{name}/mean@{k}": v for name, values in figures.items()
         for src, v in mean_by_source(values, sources).items()}
    m["val-core/mean"] = sum(figures["reward"]) / len(figures["reward"])
    for name, values in figures.items():
        if name != "reward":
            m[f"val-core/{name}"] = sum(values) / len(values)
    m["val/response_length/mean"] = sum(r.length for r in rows) / len(rows)
    m.update({f"val/{k}": v for k, v in weighted_mean(mt_parts).items()})
    m["timing_s/testing"] = time.perf_counter() - t0
    return m
