"""Rows dropped before the update (a plug-in that filters samples, as rejection sampling does):
the update takes the optimizer steps its rows make, its LR schedule moves past the steps not
taken (so the schedule follows the run and ends with it), the metrics say how many rows were
trained, and the run says once, in one line, what it did."""

import dataclasses

import pytest

from minihf.testing import spawn_ranks
from minihf.trainer.watch import RunWatch
from minihf.workers.optim import lr_factor
from test_ppo import STEPS, _runs, job_config

KEEP_BEST = '''
import torch

from minihf.trainer.phases import Phase, Plugin, before


class KeepBest(Plugin):
    """Rejection sampling's filter: keep the better-scored half of a step's rows."""

    def hooks(self):
        return [before("old_log_prob", Phase("keep_best", self.keep, timed=False))]

    def keep(self, ctx, batch, m):
        score = batch["token_level_scores"].sum(-1)
        best = torch.argsort(-score, stable=True)[: len(batch) // 2]
        return batch[sorted(best.tolist())]
'''


def test_dropped_rows_move_the_schedule_on(tiny_job, tmp_path):
    model, data = tiny_job
    (tmp_path / "keep.py").write_text(KEEP_BEST)
    extra = {"algorithm.plugins": f"[{tmp_path}/keep.py:KeepBest]"}
    hist = spawn_ranks(_runs, 1, model, data, str(tmp_path), [("keep", "grpo", None, "keep", extra)],
                       timeout_s=300)[0]["keep"]
    steps = [h for h in hist if h["step"] > 0]
    assert len(steps) == STEPS
    # 4 prompts x 2 samples = 8 rows planned; mini-batches of 4 and 2 epochs: 4 optimizer steps a
    # step planned, 2 taken on the 4 kept rows
    assert all(h["actor/trained_rows"] == 4 and h["actor/schedule_skipped_steps"] == 2 for h in steps)
    # the schedule is the planned run's (3 steps x 4 = 12 optimizer steps, cosine): step s takes
    # positions 4(s-1) and 4(s-1)+1, then moves to 4s. actor/lr is the mean of the lrs used.
    cfg = job_config(model, data, tmp_path / "keep", "grpo", **extra)
    optim = dataclasses.replace(cfg.actor_rollout_ref.actor.optim, total_training_steps=STEPS * 4)
    assert optim.lr_scheduler == "cosine"
    for s, h in enumerate(steps, start=1):
        want = optim.lr * (lr_factor(4 * (s - 1), optim) + lr_factor(4 * (s - 1) + 1, optim)) / 2
        assert h["actor/lr"] == pytest.approx(want, rel=1e-6)  # float32 lr vs Python float: 6e-8
    assert steps[-1]["actor/lr"] < 0.5 * steps[0]["actor/lr"]  # it decays over the run, not over a third


def test_the_run_says_once_what_it_did():
    watch = RunWatch(max_response_length=8)
    said = watch.check({"step": 1, "actor/trained_rows": 4.0, "actor/schedule_skipped_steps": 2.0})
    assert len(said) == 1 and "the actor update trained 4 rows" in said[0]
    assert "moved past the 2 optimizer steps not taken" in said[0]
    assert watch.check({"step": 2, "actor/trained_rows": 4.0, "actor/schedule_skipped_steps": 2.0}) == []
    more = watch.check({"step": 3, "critic/trained_rows": 12.0, "critic/schedule_skipped_steps": -1.0})
    assert len(more) == 1 and "1 optimizer steps more than planned" in more[0]
    assert RunWatch(8).check({"step": 1, "actor/lr": 1e-3}) == []  # the planned rows: nothing said
