"""Scoring generated responses on prompt files: the one path behind RL validation
(``PPOTrainer.validate``) and ``minihf eval`` (``minihf.trainer.evaluate``).

Whatever generated them (the hybrid actor, or an offline ``LLM``), a batch of responses is
decoded and scored by the run's rule reward (``RuleReward``: special tokens skipped, the
reward function's errors and timeouts named), row by row, with its ``data_source`` and its
length; figures are then averaged per data source in sorted order.
"""

from __future__ import annotations

from dataclasses import dataclass

from minihf.protocol import Batch


@dataclass(frozen=True)
class Scored:
    source: str
    score: float
    length: int


def score_responses(reward, batch: Batch, env_only: bool = False) -> list[Scored]:
    """One ``Scored`` per row of ``batch`` (``responses``, ``response_mask`` and the prompt
    columns, ``data_source`` among them). A multi-turn batch's environment rewards
    (``env_rewards``) are added to the rule's score, or are the score with ``env_only``."""
    env = batch["env_rewards"].sum(-1).tolist() if "env_rewards" in batch.tensors else None
    if env_only:
        scores = env
    else:
        _, _, scores = reward(batch)
        if env is not None:
            scores = [s + e for s, e in zip(scores, env)]
    lengths = batch["response_mask"].sum(-1).tolist()
    return [Scored(src, s, n) for src, s, n in zip(batch.non_tensors["data_source"], scores, lengths)]


def mean_by_source(values: list[float], sources: list[str]) -> dict[str, float]:
    """The mean of ``values`` per data source (sorted by source), rows paired by position."""
    out = {}
    for src in sorted(set(sources)):
        vals = [v for v, s in zip(values, sources) if s == src]
        out[src] = sum(vals) / len(vals)
    return out
