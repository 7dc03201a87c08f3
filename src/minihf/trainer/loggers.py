"""Where an RL run's metrics go (``trainer.logger``): ``console`` (``Console``: a live
progress bar on a terminal, one line per step otherwise),
``jsonl`` (``metrics.jsonl`` in the run dir, ``MetricsLog``), and the optional trackers
here: ``wandb`` (online, or offline with ``WANDB_MODE=offline``; ``pip install -e
.[wandb]``) and ``tensorboard`` (event files under ``<run dir>/tensorboard``; ``pip install
-e .[tensorboard]``). Only the driver (rank 0) logs. Sample rows (samples.jsonl) also go to
wandb as a Table per logged step.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

LOGGERS = ("console", "jsonl", "wandb", "tensorboard")
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}  # logger: (module, extra)


def check_loggers(names: list[str]) -> None:
    """Unknown names and trackers whose package is missing are errors naming the fix."""
    bad = [x for x in names if x not in LOGGERS]
    if bad:
        raise ValueError(f"trainer.logger: unknown {bad}; choose from {list(LOGGERS)}")
    for name in names:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            raise ValueError(f"trainer.logger includes {name!r} but the {PACKAGES[name][0]} package is not "
                             f"installed: pip install -e '.[{PACKAGES[name][1]}]', or drop it from trainer.logger")


class Trackers:
    """The wandb run and the tensorboard writer a run's ``trainer.logger`` asks for."""

    def __init__(self, names: list[str], out_dir: Path, project: str, experiment: str, config: dict):
        self.wandb = self.tensorboard = None
        if "wandb" in names:
            import wandb

            try:
                self.wandb = wandb.init(project=project, name=experiment, dir=str(out_dir), config=config)
            except wandb.errors.Error as e:  # no API key, no network, a bad entity: say what to do
                raise ValueError(
                    f"trainer.logger includes 'wandb' but wandb.init failed: {e} Log in (`wandb "
                    "login`, or set WANDB_API_KEY), log offline with WANDB_MODE=offline (`wandb "
                    "sync` uploads it later), or drop wandb from trainer.logger") from e
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.tensorboard is not None:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()

    def samples(self, rows: list[dict], step: int) -> None:
        """samples.jsonl rows as a wandb Table (``samples/<kind>``)."""
        if self.wandb is None or not rows:
            return
        import wandb

        columns = list(rows[0])
        for kind in sorted({r["kind"] for r in rows}):
            table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows if r["kind"] == kind])
            self.wandb.log({f"samples/{kind}": table}, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


BAR_KEYS = {"critic/score/mean": "score", "val-core/mean": "val", "response_length/mean": "len"}
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")  # the first present is shown


class Console:
    """Console output of the loop. On a terminal (``stream.isatty()``) each step redraws one
    status line -- ``[step/total pct] ETA, score, KL, response length, s/step`` -- and
    validations, warnings and other messages print above it; elsewhere (a log file, CI)
    each step is one compact ``label=value`` line (``log(line)``)."""

    def __init__(self, total: int, log, labels: dict[str, str], stream=None):
        self.total, self.log, self.labels = total, log, labels
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0, self.first, self.drawn = time.perf_counter(), None, False

    def message(self, text: str) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False
        self.log(text)

    def step(self, metrics: dict, line: str) -> None:
        step = metrics["step"]
        if not self.tty:
            self.log(line)
            return
        if "val-core/mean" in metrics:  # validations stay on screen
            self.message(line)
        if self.first is None:
            self.first, self.t0 = step, time.perf_counter()
            per_step = metrics.get("timing_s/step", 0.0)
        else:
            per_step = (time.perf_counter() - self.t0) / max(step - self.first, 1)
        self.stream.write("\r" + self.bar(metrics, step, per_step) + "\x1b[K")
        self.stream.flush()
        self.drawn = True

    def bar(self, metrics: dict, step: int, per_step: float) -> str:
        done = step / max(self.total, 1)
        filled = int(20 * done)
        eta = max(self.total - step, 0) * per_step
        parts = [f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{self.total} {100 * done:3.0f}%",
                 f"ETA {int(eta // 60)}m{int(eta % 60):02d}s"]
        parts += [f"{label}={metrics[k]:.4g}" for k, label in BAR_KEYS.items() if isinstance(metrics.get(k), float)]
        kl = next((metrics[k] for k in KL_KEYS if isinstance(metrics.get(k), float)), None)
        if kl is not None:
            parts.append(f"kl={kl:.3g}")
        parts.append(f"{per_step:.2f} s/step")
        return " ".join(parts)

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
