"""Run warnings by hand: each kind fires once, at the step it first applies; the group
metric; samples.jsonl cut back on resume."""

import json
import math

import torch

from minihf.trainer.metrics import group_metrics, rollout_probs_diff
from minihf.trainer.common import MetricsLog
from minihf.trainer.watch import STALL_WINDOW, RunWatch


def test_each_warning_once():
    w = RunWatch(max_response_length=20)
    assert w.check({"step": 1, "actor/entropy": 2.0, "response_length/clip_ratio": 0.5,
                    "critic/score/frac_equal_groups": 0.8, "actor/kl_loss": 1.0}) == []  # at the limits
    out = w.check({"step": 2, "actor/entropy": 0.19, "response_length/clip_ratio": 0.75,
                   "critic/score/frac_equal_groups": 0.9, "actor/ppo_kl": -1.5,
                   "actor/pg_loss": math.nan})
    assert len(out) == 5, out
    joined = "\n".join(out)
    for text in ("step 2: non-finite metrics ['actor/pg_loss']", "75% of responses hit "
                 "data.max_response_length=20", "entropy fell from 2 to 0.19",
                 "in 90% of the prompts every sample scored the same", "actor/ppo_kl=-1.5 > 1.0"):
        assert text in joined, text
    assert w.check({"step": 3, "actor/entropy": 0.01, "response_length/clip_ratio": 1.0,
                    "actor/pg_loss": math.inf, "actor/kl_loss": 9.0}) == []  # said already
    rollout = RunWatch(5, "actor_rollout_ref.rollout.response_length")  # set apart from the data's
    assert "hit actor_rollout_ref.rollout.response_length=5;" in rollout.check(
        {"step": 1, "response_length/clip_ratio": 0.9})[0]


def test_entropy_collapse_needs_a_stalled_score():
    """Low entropy with a rising score is a policy learning the task: no warning. With a
    flat score it fires once two STALL_WINDOWs of scores are seen (equal window means)."""
    W = STALL_WINDOW

    def run(scores):
        w = RunWatch(max_response_length=20)
        return [w.check({"step": step, "actor/entropy": 1.0 if step == 1 else 0.05,
                         "critic/score/mean": sc})
                for step, sc in enumerate(scores, start=1)]

    assert not any(run([0.01 * step for step in range(1, 4 * W + 1)]))  # rising throughout
    outs = run([0.5] * (3 * W))                                            # flat from the start
    assert [i + 1 for i, o in enumerate(outs) if o] == [2 * W]             # said once, at step 2W
    msg = outs[2 * W - 1][0]
    assert msg.startswith(f"step {2 * W}: entropy fell from 1 to 0.05 and the score stopped "
                          f"rising (mean 0.5 over the last {W} steps, 0.5 over the {W} before)"), msg
    assert "entropy_coeff" in msg
    # rising for 2W steps, then flat at the last value: the last window's mean climbs above
    # the one before until the flat part fills more than half of it
    rise = [0.01 * step for step in range(1, 2 * W + 1)]
    outs = run(rise + [rise[-1]] * (2 * W))
    fired = [i + 1 for i, o in enumerate(outs) if o]
    assert len(fired) == 1 and 2 * W < fired[0] <= 4 * W, fired


def test_rollout_trainer_mismatch_is_said_once():
    w = RunWatch(max_response_length=20)
    assert w.check({"step": 1, "training/rollout_probs_diff_mean": 7e-5}) == []  # bf16 rounding
    out = w.check({"step": 2, "training/rollout_probs_diff_mean": 0.04})
    assert len(out) == 1 and "step 2: the rollout engine's token probabilities differ" in out[0]
    assert "0.04 on average" in out[0] and "rollout.dtype" in out[0]
    assert w.check({"step": 3, "training/rollout_probs_diff_mean": 0.5}) == []       # said already
    stale = {"step": 2, "training/rollout_probs_diff_mean": 0.04, "async/staleness/max": 1}
    assert RunWatch(16).check(stale) == []  # async_training: older weights by design
    assert len(RunWatch(16).check({**stale, "async/staleness/max": 0})) == 1


def test_group_metrics_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    uids = ["a", "a", "b", "b", "c", "c", "d"]  # a, c equal; b differs; d alone (not counted)
    assert group_metrics(scores, uids) == {"critic/score/frac_equal_groups": 2 / 3}
    assert group_metrics(torch.tensor([1.0, 2.0]), ["a", "b"]) == {}


def test_rollout_probs_diff_by_hand():
    p_rollout = torch.tensor([[0.5, 0.25, 0.9], [0.1, 1.0, 1.0]])
    p_trainer = torch.tensor([[0.4, 0.25, 0.3], [0.4, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the 0.6 gap at [0, 2] is padding
    got = rollout_probs_diff(p_rollout.log(), p_trainer.log(), mask)   # diffs 0.1, 0, 0.3
    want = {"max": 0.3, "mean": 0.4 / 3, "std": (((0.1 - 0.4 / 3) ** 2 + (0.4 / 3) ** 2
                                               + (0.3 - 0.4 / 3) ** 2) / 3) ** 0.5}
    assert got.keys() == {f"training/rollout_probs_diff_{k}" for k in want}
    for k, v in want.items():
        assert math.isclose(got[f"training/rollout_probs_diff_{k}"], v, rel_tol=1e-6), k
    assert rollout_probs_diff(p_rollout.log(), p_trainer.log(), torch.zeros(2, 3)) == {}


def test_sample_log_resume(tmp_path):
    log = MetricsLog(tmp_path, name="samples.jsonl")
    log.append(*[{"step": s, "kind": "train", "response": f"r{s}"} for s in (1, 2, 3)])
    log.resume_at(2)
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2]
    off = MetricsLog(tmp_path / "off", enabled=False, name="samples.jsonl")
    off.append({"step": 1})
    assert not (tmp_path / "off").exists()
