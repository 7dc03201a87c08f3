"""The one fit loop of every trainer (RL, SFT, reward models), and its checkpoint format.

``RunLoop`` runs: the roles' ``init_model``, resume from the latest checkpoint (or the one
``trainer.resume_from_path`` names), the resolved config written, then steps until
``total_steps`` (or ``stop_after`` more, as if preempted), each validated and checkpointed
on the trainer's schedule, with the run dir held for the whole fit. A trainer subclass
supplies the steps, the validation, the schedule and two tables of stateful things, as
torchtitan's checkpoint manager takes them:

* ``checkpointed()``: role name -> worker group; each saves its shards under
  ``global_step_N/<role>`` (``save_checkpoint`` / ``load_checkpoint``);
* ``driver_state()``: name -> an object with ``state_dict`` / ``load_state_dict`` on the
  driver (data position, KL controller, plug-ins), saved together with the step in
  ``global_step_N/driver_state.json`` in ``minihf.utils.state_json``'s encoding (int keys,
  tuples and tensors come back as saved; files of plain JSON, from earlier versions, still
  load). It is encoded once after resume, before step 1, so state a checkpoint cannot hold
  stops the run before it trains, and at each save before any shard is written;
* ``driver_files()``: file name -> an object with ``save(path)`` / ``load(path or None)``,
  for driver state that is not JSON (the RL loop's batches generated ahead).

One format for every trainer: ``global_step_N/{<role>/, driver_state.json, config.json}``;
``latest_checkpointed_iteration.txt`` moves only once all of it is written. A checkpoint
of an older layout is read by the trainer's ``load_legacy`` (SFT and reward models once
kept their data position inside the worker's checkpoint at ``global_step_N`` itself), or
refused in one line.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from minihf.config import dump_yaml
from minihf.trainer.common import (LATEST, RESUME_FIX, STATE_FILE, find_resume_path, hold_run_dir,
                                   mark_latest, nothing_to_train, prune_checkpoints, resume_config_changes,
                                   save_config, write_atomic)
from minihf.utils.files import read_json
from minihf.utils.state_json import StateError, dumps, loads
from minihf.utils.profiling import check_steps
from minihf.utils.threads import with_threads


class RunLoop:
    """Base of the trainers' drivers. The subclass sets ``cfg`` (with a ``trainer``
    section), ``out`` (the run dir), ``total_steps``, ``metrics_log``, ``log`` and
    ``history``, and defines the methods below that raise."""

    last_checkpoint: Path | None = None  # written or resumed by this fit

    # -- what a trainer supplies ----------------------------------------------------------
    def init_models(self) -> None:
        raise NotImplementedError

    def train_step(self, step: int) -> dict:
        raise NotImplementedError

    def validate(self, step: int) -> dict:
        return {}

    def validate_at(self, step: int) -> bool:
        raise NotImplementedError

    def save_at(self, step: int) -> bool:
        raise NotImplementedError

    def checkpointed(self) -> dict:
        return {}

    def driver_state(self) -> dict:
        return {}

    def driver_files(self) -> dict:
        return {}

    def record(self, metrics: dict) -> None:
        self.history.append(metrics)
        self.metrics_log.append(metrics)

    def started(self, step: int) -> None:
        """After resume and the config dump, before the first step."""

    def finished(self, wall_s: float) -> None:
        """After the last step of this fit."""

    def resumed_at(self, step: int) -> None:
        """Logs that keep rows per step drop the rows past ``step`` (or start fresh at 0)."""
        if step:
            self.metrics_log.resume_at(step)
        else:
            self.metrics_log.start_fresh()

    def on_nothing_to_train(self, message: str) -> None:
        self.log(message)

    def load_legacy(self, path: Path) -> dict:
        """The driver state of a checkpoint without ``driver_state.json`` (its roles
        loaded): none is readable by default."""
        if any(p.is_dir() for p in path.iterdir()):  # roles' parts: a save that did not finish
            raise ValueError(f"{path} is incomplete: its roles' parts are there but not {STATE_FILE}, "
                             "the last file a save writes (the save was interrupted); resume from an "
                             "earlier global_step_N, or start afresh with trainer.resume_mode=disable")
        raise ValueError(f"{path} has no {STATE_FILE}: it was written in a layout this version does "
                         "not read; resume from a checkpoint of this version, or start afresh with "
                         "trainer.resume_mode=disable")

    # -- the loop -------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train to ``total_steps`` (or ``stop_after`` more steps, as if preempted),
        holding the run dir."""
        with hold_run_dir(self.out):
            return self._fit(stop_after)

    def _fit(self, stop_after: int | None) -> list[dict]:
        t0 = time.perf_counter()
        self.init_models()
        step = self.resume()
        done = nothing_to_train(self.out, step, self.total_steps)
        if done:
            self.on_nothing_to_train(done)
        # the resolved config of this start, with the threads each rank runs
        dump_yaml(with_threads(self.cfg), self.out / "config.yaml")
        self.driver_state_text(step)  # state a checkpoint cannot hold: stop before training on it
        self.started(step)
        end = self.total_steps if stop_after is None else min(self.total_steps, step + stop_after)
        profile = check_steps(getattr(self.cfg.trainer, "profile_steps", []), self.total_steps)
        while step < end:
            step += 1
            if step in profile:
                self.profile(step, start=True)
            metrics = self.train_step(step)
            if step in profile:
                self.profile(step, start=False)
            if self.validate_at(step):
                metrics.update(self.validate(step))
            self.record(metrics)  # before the checkpoint: a kill after it must not lose the row
            if self.save_at(step):
                self.save(step)
        self.finished(time.perf_counter() - t0)
        return self.history

    def profile(self, step: int, start: bool) -> None:
        """Start or stop the profile of ``step`` in every process of the job (every role's
        workers are asked; the first in a process does it: ``minihf.utils.profiling``)."""
        groups = list(getattr(self, "groups", {}).values()) or list(self.checkpointed().values())
        out = self.out / "profile" / f"step_{step}"
        for group in groups:
            group.start_profile(str(out)) if start else group.stop_profile()
        if not start:
            self.log(f"profiled step {step}: {out}/ (rank<R>.json: a Chrome trace; rank<R>.txt: "
                     "the ops by their own time)")

    # -- checkpoints ----------------------------------------------------------------------
    def driver_state_text(self, step: int) -> str:
        """The driver state file's text at ``step`` (``StateError`` naming the entry and the
        path of what a checkpoint cannot hold)."""
        state = {"step": step, **{k: v.state_dict() for k, v in self.driver_state().items()}}
        return dumps(state, "driver state")

    def save(self, step: int) -> Path:
        path = self.out / f"global_step_{step}"
        text = self.driver_state_text(step)  # first: a state that cannot be saved writes no shards
        self.own_history(path)
        for name, group in self.checkpointed().items():
            group.save_checkpoint(str(path / name))
        for name, obj in self.driver_files().items():
            obj.save(path / name)
        write_atomic(path / STATE_FILE, text)
        save_config(path, self.cfg)
        mark_latest(self.out, step)
        self.last_checkpoint = path
        keep = getattr(self.cfg.trainer, "max_ckpt_to_keep", None)
        if keep is not None:  # after LATEST names the new one: a kill leaves it named
            for old in prune_checkpoints(self.out, keep, step):
                self.log(f"deleted {old.name} (trainer.max_ckpt_to_keep={keep})")
        return path

    def own_history(self, path: Path) -> None:
        """Before writing checkpoint ``path``: ``LATEST`` names this fit's last checkpoint
        (or nothing), and an earlier history's ``path`` is gone.

        A fit resumed from an earlier step (``resume_path``) or started over
        (``resume_mode=disable``) in a run dir that holds later checkpoints writes over them.
        Written into in place, a step dir killed mid-save mixed new shards with old ones (and
        kept stale files, an ``extra/rank_3.pt`` of a wider run) and loaded without an error,
        while ``LATEST`` still named it."""
        latest, own = self.out / LATEST, self.last_checkpoint
        ours = own is not None and own.parent.resolve() == self.out.resolve()
        want = f"{own.name.removeprefix('global_step_')}\n" if ours else None
        have = latest.read_text(errors="replace") if latest.is_file() else None
        if have != want:
            if want is None:
                latest.unlink(missing_ok=True)
            else:
                write_atomic(latest, want)
        if path.exists():
            shutil.rmtree(path)

    def resume(self) -> int:
        """The step to go on from (0: a fresh start), every stateful thing restored."""
        t = self.cfg.trainer
        path = find_resume_path(str(self.out), t.resume_mode, t.resume_from_path)
        if path is None:  # an attempt interrupted before its first checkpoint wrote rows
            self.resumed_at(0)
            return 0
        changed = resume_config_changes(path, self.cfg)  # refuses changes that cannot apply
        if (path / STATE_FILE).is_file():
            state = loads(read_json(path / STATE_FILE, RESUME_FIX), path / STATE_FILE, RESUME_FIX)
            for name, group in self.checkpointed().items():
                group.load_checkpoint(str(path / name))
        else:
            state = self.load_legacy(path)
        try:
            self.load_driver_state(state)
        except StateError as e:  # a plug-in that cannot read its saved state: which, and where
            raise StateError(f"cannot resume from {path / STATE_FILE}: {e}; or {RESUME_FIX}") from e
        for name, obj in self.driver_files().items():
            obj.load(path / name if (path / name).exists() else None)
        step = int(state["step"])
        self.resumed_at(step)
        self.last_checkpoint = path
        self.log(f"resumed from {path} at step {step}"
                 + (f" (changed: {', '.join(changed)})" if changed else ""))
        return step

    def load_driver_state(self, state: dict) -> None:
        """Each ``driver_state()`` entry from its saved state (one the checkpoint lacks keeps
        its fresh state)."""
        for key, obj in self.driver_state().items():
            if key in state:
                obj.load_state_dict(state[key])
