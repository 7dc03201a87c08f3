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
from pathlib import Path
from typing import Callable, Optional

LATEST = "latest_checkpointed_iteration.txt"


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
        return path
    latest = Path(default_local_dir) / LATEST
    if not latest.exists():
        return None
    return Path(default_local_dir) / f"global_step_{int(latest.read_text().strip())}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mark_latest(out_dir: Path, step: int) -> None:
    """Point ``LATEST`` at ``global_step_<step>`` (after every part of it is written)."""
    write_atomic(out_dir / LATEST, f"{step}\n")


class MetricsLog:
    """``metrics.jsonl`` in the run dir: one row per step. On resume at step s, rows after s
    (written by the run that died) are cut, so the file reads as one uninterrupted run."""

    def __init__(self, out_dir: Path, enabled: bool = True):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled

    def resume_at(self, step: int) -> None:
        if not (self.enabled and self.path.exists()):
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
        write_atomic(self.path, "".join(r + "\n" for r in kept))

    def append(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


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
