"""Driver scaffolding shared by the SFT and RL trainers: resume lookup, atomic
``latest_checkpointed_iteration.txt`` (verl's name), the metrics log, the step line.

Writes that a kill could leave half done go to a temporary name first and are renamed
into place, so a rerun never sees a torn file: it resumes from the previous complete
checkpoint instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

from minihf.utils.files import CorruptFileError, read_int, read_json

LATEST = "latest_checkpointed_iteration.txt"
STATE_FILE = "driver_state.json"  # a checkpoint's last file: the driver's state
RESUME_FIX = ("start fresh with trainer.resume_mode=disable or a new trainer.default_local_dir, or "
              "resume an earlier checkpoint with trainer.resume_mode=resume_path "
              "trainer.resume_from_path=<run dir>/global_step_N")
CONFIG_FILE = "config.json"  # the run's config, saved with each checkpoint
# what may change between a run and its resumption: when/how long to train, log, save, and
# where ranks run; anything else (learning rate, batch sizes, model, data) would silently
# not apply to, or not match, the state being restored
RESUMABLE_CHANGES = ("trainer.", "controller.", "prepare.")


def run_dir(trainer) -> Path:
    """A trainer section's run dir: ``default_local_dir``, or
    ``outputs/<project_name>/<experiment_name>`` when it is null."""
    if trainer.default_local_dir:
        return Path(trainer.default_local_dir)
    return Path("outputs") / trainer.project_name / trainer.experiment_name


def check_run_dir(path: Path, key: str) -> None:
    """Fail at start-up, naming ``key``, if the run dir cannot be resolved (a symlink loop),
    created or written, before any lock is taken: the lock file (``minihf.utils.locks``) is
    made beside the resolved dir, so its parent must take new files too. Whether a dir
    takes new entries is tried, not asked (``minihf.utils.files.cannot_create_in``: root
    passes ``os.access`` under ``/proc`` too)."""
    from minihf.config import ConfigError
    from minihf.utils.files import cannot_create_in, nearest_existing, resolve_links

    path = Path(path)
    shown = f"{key}={str(path)!r}"
    try:
        resolved = resolve_links(path)
    except (RuntimeError, OSError) as exc:  # a symlink loop
        raise ConfigError(f"{shown}: {path} cannot be resolved ({exc}); fix the symlinks or "
                          "choose another run dir") from None
    if resolved == resolved.parent:
        raise ConfigError(f"{shown}: the filesystem root cannot be a run dir; choose a directory in it")
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{shown}: {parent} is a file, not a directory; choose "
                                  "another run dir")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"{shown}: {parent} is not writable; choose a run dir you "
                                  "can write to")
            break
    # the run dir's own files and, beside it, its lock file; else the dir that will hold it
    probes = [p for p in (resolved, resolved.parent) if p.is_dir()] or [nearest_existing(resolved)]
    for where in probes:
        why = cannot_create_in(where)
        if why is not None:
            raise ConfigError(f"{shown}: {resolved} cannot be created or written: making an entry in "
                              f"{where} fails ({why}); choose a run dir you can write to")


def check_token_ids(seqs, files, model_path, tokenizer) -> None:
    """Every token id of a dataset (``seqs``, read from ``files``) has a row in the model's
    embedding: a tokenizer with more tokens than config.json's ``vocab_size`` (another
    model's files) ends a step inside ``F.embedding`` (a device assert on CUDA) otherwise."""
    from minihf.models import load_args

    vocab = load_args(model_path).vocab_size
    top = max((max(s) for s in seqs if len(s)), default=-1)
    if top >= vocab:
        raise ValueError(f"data {files}: token id {top} ({tokenizer.convert_ids_to_tokens(top)!r}) is past the "
                         f"model's vocabulary of {vocab} (vocab_size in {model_path}/config.json); the "
                         f"tokenizer ({len(tokenizer)} tokens) is not this model's: use the model's own tokenizer files")


def run_dir_lock(path: Path, key: str = "trainer.default_local_dir") -> tuple[str, str]:
    """What a second job in run dir ``path`` is told: the dir, and the way out."""
    return (f"the run dir {key}={str(path)!r}", f"wait for that job to end, or pass another {key} "
            "(two jobs in one run dir would write every step twice and replace each other's "
            "checkpoints)")


def hold_run_dir(path: Path, key: str = "trainer.default_local_dir"):
    """This job's hold on its run dir for the block (``minihf.utils.locks``): a second job
    with the same dir is refused, naming the first."""
    from minihf.utils.locks import hold

    return hold(path, *run_dir_lock(path, key))


def hold_artefact(path: Path, what: str):
    """This job's hold on a prepared artefact while it builds it (``minihf.utils.locks``)."""
    from minihf.utils.locks import hold

    return hold(path, f"{what} {path}", "it is being built by that job; rerun once it has "
                "finished, and this job reuses it")


def check_run_length(total_epochs: int, total_training_steps: Optional[int]) -> None:
    """A trainer section's length: at least one epoch, and at least one step when capped."""
    if not isinstance(total_epochs, int) or total_epochs < 1:
        raise ValueError(f"trainer.total_epochs={total_epochs!r} must be an int >= 1")
    if total_training_steps is not None and (not isinstance(total_training_steps, int)
                                             or total_training_steps < 1):
        raise ValueError(f"trainer.total_training_steps={total_training_steps!r} must be an int >= 1 "
                         "(null: train total_epochs passes)")


def nothing_to_train(out: Path, step: int, total_steps: int) -> Optional[str]:
    """The message for a resumed run that has no step left (``step >= total_steps``), else
    None: rerunning a finished run's command trains nothing, and should say so."""
    if step < total_steps:
        return None
    return (f"the run in {out} has done {step} steps and this config trains {total_steps}: "
            "nothing to train. To train on, raise trainer.total_training_steps (or "
            "trainer.total_epochs); for a new run, pass another trainer.default_local_dir")


def find_resume_path(default_local_dir: str, resume_mode: str,
                     resume_from_path: Optional[str]) -> Optional[Path]:
    """The checkpoint to resume from, per ``resume_mode`` (None: start fresh)."""
    if resume_mode == "disable":
        return None
    if resume_mode == "resume_path":
        if not resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(resume_from_path)
        if not path.is_dir():
            raise FileNotFoundError(f"trainer.resume_from_path={resume_from_path!r} is not a "
                                    "checkpoint dir (global_step_N)")
        check_step_dir(path, "trainer.resume_from_path")
        return path
    latest = Path(default_local_dir) / LATEST
    if not latest.exists():
        return None
    path = Path(default_local_dir) / f"global_step_{read_int(latest, RESUME_FIX)}"
    if not path.is_dir():
        raise CorruptFileError(f"{latest} points at {path.name}, which does not exist; {RESUME_FIX}")
    return path


def check_resume_path(trainer) -> None:
    """``trainer.resume_from_path`` checked at start-up, before any model loads (it was found
    not to be a checkpoint after the models had loaded); a path that ``resume_mode`` ignores
    is said to be ignored."""
    from minihf.config import ConfigError

    if trainer.resume_mode != "resume_path":
        if trainer.resume_from_path:
            warnings.warn(f"trainer.resume_from_path={trainer.resume_from_path!r} is ignored with "
                          f"trainer.resume_mode={trainer.resume_mode}; set trainer.resume_mode=resume_path to "
                          "resume from it", stacklevel=2)
        return
    try:
        find_resume_path(str(run_dir(trainer)), trainer.resume_mode, trainer.resume_from_path)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def check_step_dir(path: Path, key: str) -> None:
    """A ValueError when ``path`` is a run dir or one role's part of a checkpoint, where a
    whole ``global_step_N`` is wanted (they used to load partly, then fail on a missing key
    or be called a layout this version does not read)."""
    if (path / LATEST).is_file():
        latest = (path / LATEST).read_text(errors="replace").strip()
        raise ValueError(f"{key}={str(path)!r} is a run dir, not one of its checkpoints; pass "
                         f"{path / ('global_step_' + latest if latest.isdigit() else 'global_step_N')}")
    parent = path.parent
    if (parent / STATE_FILE).is_file() or (parent.name.startswith("global_step_") and not
                                           path.name.startswith("global_step_")):
        raise ValueError(f"{key}={str(path)!r} is the {path.name!r} part of checkpoint {parent}; pass "
                         f"{parent} (the whole step: every role and the driver state)")
    if not (path / STATE_FILE).is_file() and not any(p.is_dir() for p in path.iterdir()):
        what = "a model dir" if (path / "config.json").is_file() else "not a checkpoint"
        raise ValueError(f"{key}={str(path)!r} is {what}: it has no {STATE_FILE} and no roles' parts; "
                         "pass one of a run's checkpoints, <run dir>/global_step_N (to start from a "
                         "model's weights, name it as the model's path instead)")


def flatten(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_json(cfg) -> dict:
    """The config as plain JSON data (what ``save_config`` writes)."""
    from minihf.config import to_dict

    return json.loads(json.dumps(to_dict(cfg)))


def save_config(ckpt_dir: Path, cfg) -> None:
    write_atomic(Path(ckpt_dir) / CONFIG_FILE, json.dumps(config_json(cfg), indent=1))


def resume_config_changes(ckpt_dir: Path, cfg) -> list[str]:
    """``check_resume_config`` against the config saved in ``ckpt_dir`` (none saved: [])."""
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.exists():
        return []
    return check_resume_config(read_json(path, RESUME_FIX), config_json(cfg), Path(ckpt_dir))


def check_resume_config(saved: dict, current: dict, checkpoint: Path) -> list[str]:
    """Refuse to resume under a config that differs from the checkpoint's in a key outside
    ``RESUMABLE_CHANGES`` (naming each key and both values); returns the keys that changed
    and may (say so to the user)."""
    from minihf.config import ConfigError

    a, b = flatten(saved), flatten(current)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    bad = [k for k in changed if not k.startswith(RESUMABLE_CHANGES)]
    if bad:
        lines = "; ".join(f"{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} now" for k in bad)
        raise ConfigError(f"resuming from {checkpoint} under a different config: {lines}. The "
                          "restored state was trained with the saved values, so the change would "
                          "not apply; rerun with them, or start a new run "
                          "(trainer.default_local_dir=NEW_DIR or trainer.resume_mode=disable)")
    return changed


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_keep(keep) -> None:
    """``trainer.max_ckpt_to_keep``: null (keep every checkpoint) or at least 1."""
    if keep is not None and keep < 1:
        raise ValueError(f"trainer.max_ckpt_to_keep={keep} must be >= 1 (the newest checkpoints kept), or null "
                         "to keep every one")


def prune_checkpoints(out_dir: Path, keep: int, step: int) -> list[Path]:
    """Delete this run's checkpoints older than its newest ``keep`` up to ``step`` (the one
    just written and named by ``LATEST``); step dirs past ``step`` (an earlier history,
    rewritten as the run gets there) are left. Returns what was deleted."""
    mine = sorted((int(p.name.removeprefix("global_step_")), p) for p in Path(out_dir).glob("global_step_*")
                  if p.is_dir() and p.name.removeprefix("global_step_").isdigit()
                  and int(p.name.removeprefix("global_step_")) <= step)
    old = [p for _, p in mine[:-keep]]
    for p in old:
        shutil.rmtree(p)
    return old


def mark_latest(out_dir: Path, step: int) -> None:
    """Point ``LATEST`` at ``global_step_<step>`` (after every part of it is written)."""
    write_atomic(out_dir / LATEST, f"{step}\n")


class MetricsLog:
    """``metrics.jsonl`` (or ``name``) in the run dir: rows with a ``step``. On resume at
    step s, rows after s (written by the run that died) are cut, so the file reads as one
    uninterrupted run; a fresh start (:meth:`start_fresh`) cuts every row of an earlier,
    interrupted attempt. A last line torn by a kill or a full disk is dropped with a
    warning; a broken line before it is an error naming the file and line."""

    def __init__(self, out_dir: Path, enabled: bool = True, name: str = "metrics.jsonl"):
        self.path = Path(out_dir) / name
        self.enabled = enabled

    def resume_at(self, step: int) -> None:
        if not (self.enabled and self.path.exists()):
            return
        lines = [(i, line) for i, line in enumerate(self.path.read_text().splitlines(), 1)
                 if line.strip()]
        kept = []
        for n, (i, line) in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if n == len(lines) - 1:  # the row being written when the job died
                    warnings.warn(f"{self.path}: cut a torn last line {i} ({e.msg}); it was being "
                                  "written when the run stopped")
                    continue
                raise CorruptFileError(f"{self.path} line {i} is not JSON ({e.msg}): {line[:80]!r}; "
                                       "fix or delete that line, or start a new run dir") from None
            if row.get("step", 0) <= step:
                kept.append(line)
        write_atomic(self.path, "".join(r + "\n" for r in kept))

    def start_fresh(self) -> None:
        """A run starting at step 0: rows an interrupted attempt wrote (step 0 included,
        it is validated again) are cut."""
        self.resume_at(-1)

    def append(self, *rows: dict) -> None:
        if not (self.enabled and rows):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")


def format_line(metrics: dict, labels: dict[str, str]) -> str:
    """A compact ``label=value`` line of the metrics ``labels`` (key -> label) names."""
    parts = []
    for k, label in labels.items():
        v = metrics.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{label}={v:.4g}" if isinstance(v, float) else f"{label}={v}")
    return " ".join(parts)


def every(freq: int, step: int, last: int) -> bool:
    """verl's schedule: with ``freq > 0``, every ``freq`` steps and at the last step."""
    return freq > 0 and (step % freq == 0 or step == last)


Log = Callable[[str], None]
