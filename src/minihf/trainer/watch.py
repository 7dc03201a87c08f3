"""Watching an RL run: the warnings that matter, each said once.

:class:`RunWatch` reads each step's metrics (plain Python, no torch) and returns a warning
the first time one of these shows up:

* non-finite metrics (NaN/Inf in a loss, a gradient norm, a score);
* most responses hit the length limit (``response_length/clip_ratio`` > 0.5): the answer
  is being cut; raise ``data.max_response_length`` or shape the reward;
* entropy collapse: ``actor/entropy`` below a tenth of its first value *and* the score
  stalled (``critic/score/mean`` over the last ``STALL_WINDOW`` steps no higher than over
  the ``STALL_WINDOW`` before). Low entropy alone is a policy that has learnt the task (the
  main job reaches it while its score still climbs); with a stalled score it stops
  exploring at that score: if the task allows more, raise ``entropy_coeff`` or lower the
  learning rate. A run that logs no score is warned on the entropy alone;
* no group signal (``critic/score/frac_equal_groups`` > 0.8): most prompts' samples all
  scored the same, so group estimators (GRPO, RLOO) see zero advantages;
* KL exploding (``actor/kl_loss``, ``actor/ppo_kl`` or the in-reward KL above 1.0): the
  policy runs away from the reference or from its own rollout;
* rollout and trainer disagree (``training/rollout_probs_diff_mean`` above 0.01; bf16 on both
  sides gives ~1e-4 at most): the samples are off-policy for the update, from a precision
  mismatch or an engine that did not get the step's weights (not checked on a step whose
  samples are stale by design, ``async/staleness/max`` > 0);
* an update trained other rows than the run planned (``<role>/trained_rows``: a plug-in
  dropped rows before it, as rejection sampling does): it took fewer optimizer steps and its
  LR schedule moved past the ones not taken (``TrainState.update``), said once in one line.

:class:`SkipCounter` counts the steps whose update skipped an optimizer step for a
NaN/Inf gradient (``training/skipped_steps``) and stops the run after
``trainer.max_skipped_steps`` of them in a row.

Sample generations go to ``samples.jsonl`` in the run dir (a ``MetricsLog`` of that name,
cut back on resume like ``metrics.jsonl``): a few prompt / response / score rows every
``trainer.log_samples_freq`` steps and the first rows of each validation.
"""

from __future__ import annotations

import math
from collections import deque

CLIP_RATIO = 0.5
ENTROPY_FRACTION = 0.1
EQUAL_GROUPS = 0.8
KL_LIMIT = 1.0
KL_KEYS = ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty")
ROLLOUT_DIFF = 0.01
STALL_WINDOW = 10  # steps per score window of the entropy-collapse check


class SkipCounter:
    """RL steps whose update skipped an optimizer step for a non-finite gradient (a role's
    ``<role>/skipped_updates``): ``training/skipped_steps`` counts them; ``limit`` of them in
    a row stop the run, naming the phase and the last finite metrics."""
    KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/entropy")

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row = limit, 0, 0
        self.last_good: dict = {}

    def state_dict(self) -> int:
        return self.total  # the run's count; a resumed run starts a new streak

    def load_state_dict(self, total: int) -> None:
        self.total = int(total)

    def check(self, metrics: dict) -> None:
        phases = sorted(k.split("/")[0] for k, v in metrics.items() if k.endswith("/skipped_updates") and v)
        if phases:
            self.total, self.in_a_row = self.total + 1, self.in_a_row + 1
        else:
            self.in_a_row = 0
            self.last_good = {"step": metrics.get("step"),
                              **{k: metrics[k] for k in self.KEYS if k in metrics}}
        metrics["training/skipped_steps"] = self.total
        if phases and self.limit and self.in_a_row >= self.limit:
            last = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in self.last_good.items()) or "none (no step was finite)"
            raise RuntimeError(
                f"{self.in_a_row} steps in a row had a NaN/Inf loss or gradient in "
                f"{', '.join(f'update_{p}' for p in phases)} (their optimizer steps were skipped); last "
                f"finite step: {last}. Lower the learning rate, check the reward/score scale, or raise "
                "trainer.max_skipped_steps")


class RunWatch:
    def __init__(self, max_response_length: int, key: str = "data.max_response_length"):
        self.max_response_length, self.key = max_response_length, key
        self.said: set[str] = set()
        self.first_entropy: float | None = None
        self.scores: deque[float] = deque(maxlen=2 * STALL_WINDOW)  # recent critic/score/mean

    def _stall(self) -> tuple[float, float] | None:
        """(mean score of the window before, of the last window) when the score has not
        risen between the two; None while it rises or before two windows are seen."""
        if len(self.scores) < 2 * STALL_WINDOW:
            return None
        scores = list(self.scores)
        before = sum(scores[:STALL_WINDOW]) / STALL_WINDOW
        last = sum(scores[STALL_WINDOW:]) / STALL_WINDOW
        return (before, last) if last <= before else None

    def _once(self, key: str, message: str, out: list[str]) -> None:
        if key not in self.said:
            self.said.add(key)
            out.append(message)

    def check(self, m: dict) -> list[str]:
        """Warnings due at this step's metrics ``m`` (each kind at most once per run)."""
        out: list[str] = []
        step = m.get("step")
        bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:
            self._once("nonfinite", f"step {step}: non-finite metrics {bad[:6]}; a loss or "
                       "gradient overflowed (lower the learning rate, check the reward)", out)
        clip = m.get("response_length/clip_ratio")
        if clip is not None and clip > CLIP_RATIO:
            self._once("clip", f"step {step}: {clip:.0%} of responses hit {self.key}="
                       f"{self.max_response_length}; answers are cut off (raise it or "
                       "penalise length)", out)
        score = m.get("critic/score/mean")
        if score is not None and math.isfinite(score):
            self.scores.append(score)
        ent = m.get("actor/entropy")
        if ent is not None and math.isfinite(ent):
            if self.first_entropy is None:
                self.first_entropy = ent
            elif self.first_entropy > 0 and ent < ENTROPY_FRACTION * self.first_entropy:
                fell = f"step {step}: entropy fell from {self.first_entropy:.3g} to {ent:.3g}"
                fix = "(raise actor_rollout_ref.actor.entropy_coeff or lower the lr)"
                stall = self._stall()
                if stall is not None:
                    self._once("entropy", f"{fell} and the score stopped rising (mean "
                               f"{stall[1]:.3g} over the last {STALL_WINDOW} steps, "
                               f"{stall[0]:.3g} over the {STALL_WINDOW} before): the policy "
                               f"stopped exploring at this score; if the task allows more "
                               f"{fix}", out)
                elif score is None and not self.scores:
                    self._once("entropy", f"{fell}; the policy is nearly deterministic: if "
                               f"the score has stopped rising it has collapsed {fix}", out)
        equal = m.get("critic/score/frac_equal_groups")
        if equal is not None and equal > EQUAL_GROUPS:
            self._once("groups", f"step {step}: in {equal:.0%} of the prompts every sample "
                       "scored the same; group advantages are zero there (no learning signal: "
                       "the task is too easy or too hard, or raise rollout.n)", out)
        for key in KL_KEYS:
            v = m.get(key)
            if v is not None and math.isfinite(v) and abs(v) > KL_LIMIT:
                self._once("kl", f"step {step}: {key}={v:.3g} > {KL_LIMIT}; the KL is "
                           "exploding (lower the lr, raise the KL coefficient)", out)
        diff = m.get("training/rollout_probs_diff_mean")
        stale = m.get("async/staleness/max", 0) > 0  # async_training: older weights by design
        if diff is not None and diff > ROLLOUT_DIFF and not stale:
            self._once("rollout", f"step {step}: the rollout engine's token probabilities differ "
                       f"from the trainer's by {diff:.3g} on average (training/rollout_probs_diff_"
                       f"mean > {ROLLOUT_DIFF}); the samples are off-policy for the update: check "
                       "actor_rollout_ref.rollout.dtype against the trainer's precision", out)
        for key in sorted(k for k in m if k.endswith("/trained_rows")):
            role, skipped = key.split("/")[0], m.get(key.replace("trained_rows", "schedule_skipped_steps"), 0)
            what = (f"its LR schedule moved past the {skipped:.0f} optimizer steps not taken, so it still ends "
                    f"with the run" if skipped >= 0 else
                    f"it took {-skipped:.0f} optimizer steps more than planned, so its LR schedule runs ahead")
            self._once(key, f"step {step}: the {role} update trained {m[key]:.0f} rows, not the "
                       f"data.train_batch_size x rollout.n a step plans (a plug-in changed the rows before "
                       f"it): {what}; {key} logs it each step", out)
        return out
