"""Asynchronous RL on a fixed schedule: ``async_training.staleness`` k (docs/async.md).

The samples trained at step n are generated with the actor's weights as step n - k starts
(after n - k - 1 updates); the first k + 1 batches, with the initial weights. Step n
generates the batch of step n + k, then trains on the batch of step n, so the lag is a
schedule and not a race: a run repeats exactly, and a checkpoint holds the batches
already generated for later steps (``pending.pt``), so a resumed run trains on what the
uninterrupted one would have. With k = 0 this is the synchronous loop.

With a standalone rollout (``controller.placement.rollout``), step n first syncs the
weights to the rollout's ranks, then generates the batch of step n + k in a driver thread
while the actor trains on the batch of step n, and waits for it at the end of the step:
generation and training overlap, and the result is the colocated run's (the same
schedule; only the timing differs).

The batch of step t is generated as step t (its sampling seeds and the plug-ins' view of
it are those of step t, whatever k is), and its rows carry ``policy_version``: the
updates its weights had seen. Its data metrics (scores, groups, multi-turn figures) are
reported at the step that trains it; the time it took, at the step that made it. The PPO
ratio is then decoupled (AReaL): the old log-probs are the trainer's recompute under the
current weights (the proximal policy) and the engine's log-probs of the weights that
generated each sample are the behaviour policy, which ``algorithm.rollout_correction``
weighs (``rollout_is``) or rejects (``rollout_rs``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from minihf.protocol import Batch
from minihf.trainer.phases import Phase, StepContext
from minihf.utils.files import CorruptFileError
from minihf.utils.safe_load import load_data
from minihf.utils.state_json import dumps, loads

PENDING_FORMAT = "minihf-pending/1"

# produce(target step) -> (batch, its data metrics, the time metrics of making it)
Produce = Callable[[int], tuple[Batch, dict, dict]]


class RolloutQueue:
    """The batches generated ahead of the step that trains them: ``(step, policy
    version, batch, its data metrics)`` in step order, and the one being generated in the
    background (``overlap``)."""

    def __init__(self, staleness: int, total_steps: int, produce: Produce,
                 sync: Callable[[dict], None] = lambda m: None, overlap: bool = False):
        self.k, self.total_steps = staleness, total_steps
        self.produce, self.sync, self.overlap = produce, sync, overlap
        self.pending: list[tuple[int, int, Batch, dict]] = []
        self._thread: threading.Thread | None = None
        self._result: dict = {}

    def staged(self, rollout: Phase) -> Phase:
        """The step's rollout phase, taking its batch from the queue."""
        def run(ctx: StepContext, batch: Batch, m: dict) -> Batch:
            return self.next_batch(ctx.step, m)
        return Phase(rollout.name, run, rollout.timed)

    def next_batch(self, step: int, m: dict) -> Batch:
        self.join(m)
        last = self.pending[-1][0] if self.pending else step - 1
        targets = list(range(last + 1, min(step + self.k, self.total_steps) + 1))
        if targets:
            self.sync(m)  # a standalone rollout gets the weights of step - 1
        for i, target in enumerate(targets):
            if self.overlap and target > step and i == len(targets) - 1:
                # the last one, trained later: made while this step trains (the ones before
                # it, at step 1's k + 1 or after a resume with a larger k, are made now, with
                # the same weights as the colocated schedule gives them)
                self._start(target, step - 1)
                break
            batch, made, timing = self.produce(target)
            add(m, timing)
            self.pending.append((target, step - 1, batch, made))
        target, version, batch, made = self.pending.pop(0)
        if target != step:  # the schedule itself is wrong: never from user input
            raise RuntimeError(f"async_training: step {step} found the batch of step {target} "
                               "first in the queue")
        m.update(made)
        batch.tensors["policy_version"] = torch.full((len(batch),), version, dtype=torch.long)
        stale = (step - 1) - batch["policy_version"]
        m["async/staleness/mean"] = stale.double().mean().item()
        m["async/staleness/max"] = int(stale.max())
        m["async/queued_batches"] = len(self.pending) + (self._thread is not None)
        return batch

    def _start(self, target: int, version: int) -> None:
        def work():
            try:
                self._result["out"] = (target, version) + self.produce(target)
            except BaseException as e:  # noqa: BLE001 - raised on the driver's thread at join
                self._result["error"] = e
        self._result = {}
        self._thread = threading.Thread(target=work, name=f"minihf-rollout-{target}", daemon=True)
        self._thread.start()

    def join(self, m: dict) -> None:
        """Wait for the batch generating in the background (if any) and queue it; its time
        metrics go to ``m`` (the step that made it)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if "error" in self._result:
            raise self._result["error"]
        target, version, batch, made, timing = self._result.pop("out")
        add(m, timing)
        self.pending.append((target, version, batch, made))

    # -- checkpoints (RunLoop.driver_files) -------------------------------------------------
    # The file holds data only, so a resume runs no code from it (a checkpoint may come from
    # a stranger: minihf.utils.safe_load): per batch its tensors, and its non-tensor columns
    # (object arrays), meta and metrics as state_json text.
    def save(self, path: Path) -> None:
        rows = [{"step": t, "version": v, "tensors": dict(b.tensors),
                 "rest": dumps({"non_tensors": {k: list(a) for k, a in b.non_tensors.items()},
                                "meta": b.meta, "metrics": made}, f"pending batch of step {t}")}
                for t, v, b, made in self.pending]
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"format": PENDING_FORMAT, "batches": rows}, tmp)
        tmp.replace(path)

    def load(self, path: Path | None) -> None:
        """The queue a checkpoint saved (none: empty, e.g. a run resumed from a synchronous
        checkpoint fills it with the current weights)."""
        self.pending = []
        if path is None or not path.exists():
            return
        saved = load_data(path)
        fix = "resume an earlier global_step_N or start fresh (trainer.resume_mode=disable)"
        if not (isinstance(saved, dict) and saved.get("format") == PENDING_FORMAT):
            raise CorruptFileError(f"{path} is not a pending-batch file of this minihf version; {fix}")
        for row in saved["batches"]:
            rest = loads(json.loads(row["rest"]), path, fix)
            batch = Batch(row["tensors"], rest["non_tensors"], rest["meta"])
            self.pending.append((row["step"], row["version"], batch, rest["metrics"]))


def add(m: dict, timing: dict) -> None:
    """The step-level figures of making a batch (seconds, bytes, evictions) into ``m``;
    they add up when a step makes two."""
    for key, value in timing.items():
        m[key] = m.get(key, 0) + value


class WeightSync:
    """A standalone rollout's weights: when the actor's changed (``stale``), the actor's
    ranks send each rollout rank its TP slice while it receives (``minihf.hybrid.transfer``);
    a LoRA actor's base weights go with the first sync, its adapters with every one.
    Called with the step's metrics: ``timing_s/weight_sync``, ``perf/weight_sync_bytes``
    (what one rollout rank received: its TP slice of every weight, in the rollout dtype)
    and ``perf/weight_sync_bytes_sent`` (the most one actor rank sent)."""

    def __init__(self, actor, rollout, totals: dict, lora: bool = False):
        self.actor, self.rollout, self.totals = actor, rollout, totals
        self.stale = True
        self.lora = lora            # a LoRA actor: the frozen base weights go once
        self.base_sent = False

    def __call__(self, m: dict) -> None:
        if self.rollout is None or not self.stale:
            return
        t0 = time.perf_counter()
        adapters = self.lora and self.base_sent
        sent = self.actor.send_weights.future(self.rollout.layouts["rollout"].tp_ranks(), adapters)
        received = self.rollout.receive_weights.future(list(self.actor.ranks), adapters)
        sent, received = sent.result(), received.result()
        dt = time.perf_counter() - t0
        m["timing_s/weight_sync"] = m.get("timing_s/weight_sync", 0.0) + dt
        self.totals["weight_sync"] = self.totals.get("weight_sync", 0.0) + dt
        m["perf/weight_sync_bytes"] = max(r["bytes"] for r in received)
        m["perf/weight_sync_bytes_sent"] = max(x["bytes"] for x in sent)
        self.stale, self.base_sent = False, True


ROLLOUT_PHASES = ("weight_sync", "gen", "gen_max")
ACTOR_PHASES = ("weight_sync", "old_log_prob", "ref", "update_actor")


def busy_metrics(m: dict) -> dict:
    """With a standalone rollout: per group, the seconds of the step it worked
    (``timing_s/busy/<group>``: the driver's waits for its calls, the batch made in the
    background included) and the rest (``timing_s/idle/<group>``)."""
    out = {}
    for group, phases in (("rollout", ROLLOUT_PHASES), ("actor", ACTOR_PHASES)):
        busy = sum(m.get(f"timing_s/{p}", 0.0) for p in phases)
        out[f"timing_s/busy/{group}"] = busy
        out[f"timing_s/idle/{group}"] = max(0.0, m["timing_s/step"] - busy)
    return out
