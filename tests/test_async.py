"""Asynchronous RL on a fixed schedule (``async_training.staleness`` k, docs/async.md).

On the driver alone (a scripted actor that counts its updates): the batch trained at step
s was generated when the actor had seen max(0, s - k - 1) updates, from the loader's s-th
prompts and with step s's seeds, so k changes only which weights sampled it; the queue of
batches generated ahead survives a checkpoint, so a run stopped and resumed trains on what
the uninterrupted one did. On 2 processes with the tiny model: k = 1 reproduces itself
bitwise, a resumed run equals the uninterrupted one (parameters bitwise, metrics exactly),
and the engine-vs-trainer probability gap is rounding at step 1 (same weights) and far
from it later (older weights)."""

import json
from pathlib import Path

import pytest
import torch

from minihf.config import ConfigError
from minihf.testing import spawn_ranks
from test_ppo import ScriptedActor, _runs, final_params, job_config


class VersionedActor(ScriptedActor):
    """``ScriptedActor`` whose rollout log-probs say how many updates the weights had seen
    (-1 - version/10) and whose "checkpoint" is that count."""

    def __init__(self):
        self.version, self.generated, self.trained = 0, [], []

    def generate_sequences(self, batch):
        out = super().generate_sequences(batch)
        out.tensors["rollout_log_probs"] = torch.full_like(out["rollout_log_probs"], -1.0 - self.version / 10)
        self.generated.append((batch.meta["global_step"], self.version))
        return out

    def update_actor(self, batch):
        self.trained.append(batch)
        self.version += 1
        return {}

    def init_model(self, *args):
        pass

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "version").write_text(str(self.version))

    def load_checkpoint(self, path):
        self.version = int((Path(path) / "version").read_text())


def driver_run(model, data, out, k, steps=5, stop_after=None, actor=None, **extra):
    from minihf.trainer.ppo import PPOTrainer

    cfg = job_config(model, data, out, "grpo", **{
        "async_training.staleness": k, "trainer.total_training_steps": steps,
        "trainer.save_freq": 1, "trainer.test_freq": -1, "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]", **extra})
    actor = actor or VersionedActor()
    hist = PPOTrainer(cfg, {"actor": actor}, log=lambda *a: None).fit(stop_after=stop_after)
    return actor, hist


@pytest.mark.parametrize("k", [1, 2])
def test_schedule_on_the_driver(tiny_job, tmp_path, k):  # noqa: F811
    model, data = tiny_job
    sync, _ = driver_run(model, data, tmp_path / "sync", 0)
    actor, hist = driver_run(model, data, tmp_path / "async", k)
    steps = range(1, 6)
    # each batch generated once, with its own step's seeds, k steps ahead (the first k + 1 at once)
    made_at = {s: max(1, s - k) for s in steps}
    assert sorted(actor.generated) == [(s, made_at[s] - 1) for s in steps]
    assert [g for g, _ in actor.generated] == list(steps)  # in step order
    for s, trained, same in zip(steps, actor.trained, sync.trained):
        version = made_at[s] - 1
        assert torch.equal(trained["policy_version"], torch.full((len(trained),), version))
        assert torch.all(trained["rollout_log_probs"] == -1.0 - version / 10)
        assert torch.equal(trained["input_ids"], same["input_ids"])  # the s-th prompts, as sync
        assert trained.meta["global_step"] == s
    assert [h["async/staleness/max"] for h in hist] == [min(s - 1, k) for s in steps]
    assert [h["async/staleness/mean"] for h in hist] == [min(s - 1, k) for s in steps]
    assert [h["async/queued_batches"] for h in hist] == [min(k, 5 - s) for s in steps]
    # the ratio is decoupled: the old log-probs are the trainer's recompute, the engine's the behaviour
    assert all(t["old_log_probs"].eq(-1.0).all() for t in actor.trained)
    assert "training/rollout_probs_diff_max" in hist[-1]
    assert all("policy_version" not in t for t in sync.trained)  # k = 0: the synchronous loop


def test_rollout_correction_weighs_stale_samples(tiny_job, tmp_path):  # noqa: F811
    """Token-level TIS, unchanged: the weight is pi_old / pi_behaviour = exp(-1 - (-1 - v/10))
    = exp(v/10) for a batch of version v (the trainer's old log-probs are -1), capped at 1.2."""
    import math

    model, data = tiny_job
    actor, _ = driver_run(model, data, tmp_path, 1, steps=5, **{
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": 1.2})
    for s, trained in zip(range(1, 6), actor.trained):
        version = max(1, s - 1) - 1  # 0, 0, 1, 2, 3: weights 1, 1, e^0.1, then the cap
        want = min(math.exp(version / 10), 1.2)
        assert torch.allclose(trained["rollout_is_weights"], torch.full_like(trained["rollout_is_weights"], want)), s


def test_resume_keeps_the_batches_generated_ahead(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    full, full_hist = driver_run(model, data, tmp_path / "full", 2)
    first, first_hist = driver_run(model, data, tmp_path / "resumed", 2, stop_after=2)
    saved = torch.load(tmp_path / "resumed" / "global_step_2" / "pending.pt", weights_only=True)  # data only
    assert [(r["step"], r["version"]) for r in saved["batches"]] == [(3, 0), (4, 1)]
    rest, rest_hist = driver_run(model, data, tmp_path / "resumed", 2)
    assert rest.version == 5
    assert sorted(first.generated + rest.generated) == sorted(full.generated)  # none made twice
    for a, b in zip(full.trained, first.trained + rest.trained):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a.tensors)
        assert a.non_tensors.keys() == b.non_tensors.keys() and a.meta == b.meta
        assert all(list(a.non_tensors[k]) == list(b.non_tensors[k]) for k in a.non_tensors)

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    assert [strip(h) for h in full_hist] == [strip(h) for h in first_hist + rest_hist]


def test_bad_staleness_and_the_log_prob_check(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    for bad, says in (("-1", "async_training: staleness=-1 must be an integer >= 0"),
                      ("1.5", "async_training.staleness: expected int, got 1.5")):
        with pytest.raises(ConfigError, match=says):
            job_config(model, data, tmp_path, "grpo", **{"async_training.staleness": bad})
    with pytest.raises(ConfigError, match=r"check_log_probs=warn .* async_training.staleness=1 .*"
                                          r"set check_log_probs=off"):
        job_config(model, data, tmp_path, "grpo", **{"async_training.staleness": 1,
                                                    "actor_rollout_ref.rollout.check_log_probs": "warn"})
    # one on-policy optimizer step would take its own log-probs as the old ones: recomputed instead
    one_step = {"actor_rollout_ref.actor.ppo_epochs": 1, "actor_rollout_ref.actor.ppo_mini_batch_size": 8}
    assert job_config(model, data, tmp_path, "grpo", **one_step).old_log_prob_source == "update"
    cfg = job_config(model, data, tmp_path, "grpo", **one_step, **{"async_training.staleness": 1})
    assert cfg.old_log_prob_source == "recompute"
    cfg = job_config(model, data, tmp_path, "grpo", **one_step, **{
        "async_training.staleness": 1, "actor_rollout_ref.actor.recompute_log_prob": "false"})
    assert cfg.old_log_prob_source == "rollout"  # asked for: the ratio against the behaviour policy


def test_two_processes_reproducible_and_resumable(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    extra = {"async_training.staleness": 1, "trainer.total_training_steps": 4, "trainer.save_freq": 2}
    cases = [("full", "grpo", None, "full", extra), ("again", "grpo", None, "again", extra),
             ("first", "grpo", 2, "resumed", extra), ("rest", "grpo", None, "resumed", extra)]
    res = spawn_ranks(_runs, 2, model, data, str(tmp_path), cases, timeout_s=600)[0]

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/throughput"))}
    full = [strip(h) for h in res["full"]]
    assert full == [strip(h) for h in res["again"]]
    assert full == [strip(h) for h in res["first"] + res["rest"]]
    a = final_params(tmp_path / "full", 4)
    for other in ("again", "resumed"):
        b = final_params(tmp_path / other, 4)
        assert all(torch.equal(a[k], b[k]) for k in a), other
    steps = [h for h in res["full"] if h["step"] > 0]
    assert [h["async/staleness/max"] for h in steps] == [0, 1, 1, 1]
    # fp32 on CPU, same weights: rounding (test_ppo's bound for the main job is ~1e-5 when
    # sharp; this tiny model's probabilities move by ~1e-2 per update at lr 1e-3)
    gap = [h["training/rollout_probs_diff_max"] for h in steps]
    assert gap[0] < 1e-5 and min(gap[1:]) > 1e-3, gap
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_queue_gives_a_standalone_rollout_the_colocated_schedule(k):
    """The policy version of each step's batch: the first k + 1 from the initial weights,
    then one update behind per step past them, whether the next batch is made while the
    step trains (a standalone rollout) or before it. With overlap, step 1 made its own batch
    and started the next in the background, but never the ones past it, so k >= 2 ran as
    k = 1 there."""
    from minihf.protocol import Batch
    from minihf.trainer.staleness import RolloutQueue

    def versions(overlap, total=8):
        queue = RolloutQueue(k, total, lambda t: (Batch({"x": torch.zeros(2)}), {}, {}), overlap=overlap)
        out = []
        for step in range(1, total + 1):
            m = {}
            out.append(int(queue.next_batch(step, m)["policy_version"][0]))
            assert m["async/staleness/max"] == step - 1 - out[-1]
        return out

    want = [0] * (k + 1) + list(range(1, 8 - k))
    assert versions(False) == want and versions(True) == want


def test_a_crafted_pending_file_runs_no_code(tmp_path):
    """pending.pt was read with weights_only=False: a checkpoint from a stranger ran its
    pickle's code on resume (every other checkpoint file is read as data only)."""
    import os

    from minihf.trainer.staleness import RolloutQueue
    from minihf.utils.files import CorruptFileError
    from minihf.utils.safe_load import UnsafeCheckpointError

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save([{"step": 3, "payload": Payload()}], tmp_path / "pending.pt")
    queue = RolloutQueue(1, 8, lambda t: None)
    with pytest.raises(UnsafeCheckpointError):
        queue.load(tmp_path / "pending.pt")
    assert not marker.exists()
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(CorruptFileError, match="not a pending-batch file"):
        queue.load(tmp_path / "other.pt")


def test_a_rewritten_step_dir_is_never_named_half_written(tiny_job, tmp_path):  # noqa: F811
    """Resumed from step 4 of a run that reached step 5, the fit writes step 5 again. It was
    written into in place while latest_checkpointed_iteration.txt named it: killed in the
    middle of that save, the next start resumed from a step dir mixing two runs' files (and
    kept an earlier run's stale ones). Now the pointer names this fit's own last checkpoint
    before a step dir of another history is cleared and written."""
    model, data = tiny_job
    out = tmp_path / "run"
    driver_run(model, data, out, 0)
    (out / "global_step_5" / "actor" / "stale.pt").write_text("an earlier run's file")

    class KilledAtStep5(VersionedActor):
        def save_checkpoint(self, path):
            super().save_checkpoint(path)
            if "global_step_5" in str(path):
                raise RuntimeError("killed while saving")

    with pytest.raises(RuntimeError, match="killed while saving"):
        driver_run(model, data, out, 0, actor=KilledAtStep5(), **{
            "trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(out / "global_step_4")})
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    assert not (out / "global_step_5" / "actor" / "stale.pt").exists()
    actor, _ = driver_run(model, data, out, 0)           # resumes from step 4, not the torn 5
    assert actor.version == 5 and len(actor.trained) == 1


def test_resume_from_path_names_what_it_was_given(tiny_job, tmp_path):  # noqa: F811
    """A run dir, one role's part of a checkpoint, or a step whose save was interrupted:
    each was called 'written in a layout this version does not read' (or, for SFT's role
    dir, half loaded and then a KeyError)."""
    model, data = tiny_job
    out = tmp_path / "run"
    driver_run(model, data, out, 0)
    (out / "global_step_3" / "driver_state.json").unlink()
    (tmp_path / "empty").mkdir()
    for given, says in ((out, r"is a run dir, not one of its checkpoints; pass .*global_step_5"),
                        (model, r"is a model dir: it has no driver_state.json and no roles' parts; pass one "
                                r"of a run's checkpoints"),  # its config.json was read as the run's
                        (tmp_path / "empty", r"empty' is not a checkpoint: it has no driver_state.json"),
                        (out / "global_step_2" / "actor", r"is the 'actor' part of checkpoint .*global_step_2; pass"),
                        (out / "global_step_3", r"global_step_3 is incomplete: .* not driver_state.json")):
        with pytest.raises(ValueError, match=says):
            driver_run(model, data, out, 0, **{"trainer.resume_mode": "resume_path",
                                               "trainer.resume_from_path": str(given)})


def test_resume_from_path_is_checked_before_any_model_loads(tmp_path):
    """At start-up (``check_paths``), as a config error; and a path that ``resume_mode=auto``
    ignores is said to be ignored (it was silently, and the run started afresh)."""
    from types import SimpleNamespace

    from minihf.config import ConfigError
    from minihf.trainer.common import check_resume_path

    def trainer(mode, path):
        return SimpleNamespace(resume_mode=mode, resume_from_path=path, default_local_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="trainer.resume_from_path='/nope' is not a checkpoint dir"):
        check_resume_path(trainer("resume_path", "/nope"))
    with pytest.warns(UserWarning, match="trainer.resume_from_path='/nope' is ignored with trainer.resume_mode=auto"):
        check_resume_path(trainer("auto", "/nope"))
    check_resume_path(trainer("disable", None))


def test_max_ckpt_to_keep_deletes_the_oldest(tiny_job, tmp_path):  # noqa: F811
    """trainer.max_ckpt_to_keep (verl's max_actor_ckpt_to_keep): the newest N step dirs
    stay, older ones go once the newest is named; a resumed run keeps pruning, and a step
    dir past the resume point (an earlier history) is left until the run rewrites it."""
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    model, data = tiny_job
    out = tmp_path / "run"

    def steps():
        return sorted(int(p.name.removeprefix("global_step_")) for p in out.glob("global_step_*"))
    driver_run(model, data, out, 0, stop_after=3, **{"trainer.max_ckpt_to_keep": 2})
    assert steps() == [2, 3]
    driver_run(model, data, out, 0, **{"trainer.max_ckpt_to_keep": 2})
    assert steps() == [4, 5] and (out / "latest_checkpointed_iteration.txt").read_text() == "5\n"
    driver_run(model, data, out, 0, steps=7, **{"trainer.max_ckpt_to_keep": 1, "trainer.resume_mode": "resume_path",
                                                "trainer.resume_from_path": str(out / "global_step_4")})
    assert steps() == [7]
    with pytest.raises(ConfigError, match="max_ckpt_to_keep=0 must be >= 1"):
        load_config(PPOJobConfig, "grpo", ["trainer.max_ckpt_to_keep=0"])
