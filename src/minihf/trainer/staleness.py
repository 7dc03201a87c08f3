"""Asynchronous RL on a fixed schedule: ``async_training.staleness`` k (docs/async.md).

The samples trained at step n are generated with the actor's weights as step n - k starts
(after n - k - 1 updates); the first k + 1 batches, with the initial weights. Step n
generates the batch of step n + k, then trains on the batch of step n, so the lag is a
schedule and not a race: a run repeats exactly, and a checkpoint holds the batches
already generated for later steps (``pending.pt``), so a resumed run trains on what the
uninterrupted one would have. With k = 0 this is the synchronous loop.

The batch of step t is generated with ``ctx.step = t`` (its sampling seeds and the
plug-ins' view of it are those of step t, whatever k is), and its rows carry
``policy_version``: the updates its weights had seen. Its data metrics (scores, groups,
multi-turn figures) are reported at the step that trains it; the time it took at the step
that made it. The PPO ratio is then decoupled (AReaL): the old log-probs are the trainer's
recompute under the current weights (the proximal policy) and the engine's log-probs of the
weights that generated each sample are the behaviour policy, which
``algorithm.rollout_correction`` weighs (``rollout_is``) or rejects (``rollout_rs``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minihf.protocol import Batch
from minihf.trainer.phases import Phase, StepContext


class RolloutQueue:
    """The batches generated ahead of the step that trains them: ``(step, policy
    version, batch, its data metrics)`` in step order."""

    def __init__(self, staleness: int, total_steps: int):
        self.k, self.total_steps = staleness, total_steps
        self.pending: list[tuple[int, int, Batch, dict]] = []

    def staged(self, rollout: Phase) -> Phase:
        """``rollout`` (the step's rollout phase, plug-ins applied) run ahead on the schedule."""
        def run(ctx: StepContext, batch: Batch, m: dict) -> Batch:
            return self.next_batch(ctx, rollout, m)
        return Phase(rollout.name, run, rollout.timed)

    def next_batch(self, ctx: StepContext, rollout: Phase, m: dict) -> Batch:
        step = ctx.step
        last = self.pending[-1][0] if self.pending else step - 1
        for target in range(last + 1, min(step + self.k, self.total_steps) + 1):
            made: dict = {}
            ctx.step = target  # the batch's seeds and plug-ins see the step that trains it
            try:
                out = Batch()
                result = rollout.run(ctx, out, made)
                out = out if result is None else result
            finally:
                ctx.step = step
            self.pending.append((target, step - 1, out, made))
        target, version, batch, made = self.pending.pop(0)
        if target != step:  # the schedule itself is wrong: never from user input
            raise RuntimeError(f"async_training: step {step} found the batch of step {target} "
                               "first in the queue")
        m.update(made)
        batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        stale = (step - 1) - batch["policy_version"]
        m["async/staleness/mean"] = stale.double().mean().item()
        m["async/staleness/max"] = int(stale.max())
        m["async/queued_batches"] = len(self.pending)
        return batch

    # -- checkpoints (RunLoop.driver_files) -------------------------------------------------
    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        torch.save([{"step": t, "version": v, "tensors": b.tensors, "non_tensors": b.non_tensors,
                     "meta": b.meta, "metrics": made} for t, v, b, made in self.pending], tmp)
        tmp.replace(path)

    def load(self, path: Path | None) -> None:
        """The queue a checkpoint saved (none: empty, e.g. a run resumed from a synchronous
        checkpoint fills it with the current weights)."""
        self.pending = []
        if path is None or not path.exists():
            return
        # our own file, written by save() above: batches hold numpy object arrays
        for row in torch.load(path, weights_only=False):
            batch = Batch(row["tensors"], row["non_tensors"], row["meta"])
            self.pending.append((row["step"], row["version"], batch, row["metrics"]))
