"""``RunRecord``: what an RL run writes and says as it goes, owned apart from the driver.

``metrics.jsonl`` and ``samples.jsonl`` in the run dir (cut back on resume), the trackers
(wandb / tensorboard, opened when the fit starts), the console's progress line, the run's
watch (warnings said once, ``minihf.trainer.watch``) and its skipped-step counter, the
steps' history and the seconds spent per phase; at the end, the summary lines.
"""

from __future__ import annotations

from minihf.trainer.common import Log, MetricsLog, config_json, format_line
from minihf.trainer.loggers import Console, Trackers
from minihf.trainer.watch import RunWatch, SkipCounter

LINE_KEYS = {"step": "step", "critic/score/mean": "score", "val-core/mean": "val",
             "actor/pg_loss": "pg_loss", "actor/ppo_kl": "ppo_kl", "actor/entropy": "entropy",
             "actor/grad_norm": "grad_norm", "critic/vf_loss": "vf_loss",
             "response_length/mean": "resp_len", "timing_s/step": "step_s"}  # key -> label


class RunRecord:
    def __init__(self, cfg, out, total_steps: int, log: Log):
        t = cfg.trainer
        self.cfg, self.out, self.log = cfg, out, log
        self.metrics_log = MetricsLog(out, "jsonl" in t.logger)
        self.samples = MetricsLog(out, t.log_samples_freq > 0, "samples.jsonl")
        self.trackers = None  # wandb / tensorboard, opened by open()
        self.console = Console(total_steps, log, LINE_KEYS)
        self.watch = RunWatch(cfg.actor_rollout_ref.rollout.response_length, cfg.length_keys()[1])
        self.skips = SkipCounter(t.max_skipped_steps)
        self.history: list[dict] = []
        self.phase_totals: dict[str, float] = {}  # seconds per phase over the run (the summary's)

    def open(self) -> None:
        t = self.cfg.trainer
        self.trackers = Trackers(t.logger, self.out, t.project_name, t.experiment_name, config_json(self.cfg))

    def resumed_at(self, step: int) -> None:
        if step:
            self.samples.resume_at(step)
        else:
            self.samples.start_fresh()

    def add_time(self, name: str, seconds: float) -> None:
        self.phase_totals[name] = self.phase_totals.get(name, 0.0) + seconds

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.samples.append(*rows)
        if self.trackers is not None:
            self.trackers.samples(rows, step)

    def record(self, metrics: dict) -> None:
        metrics = numbers_only(metrics)
        self.history.append(metrics)
        self.metrics_log.append(metrics)
        if self.trackers is not None:
            self.trackers.log(metrics, metrics["step"])
        for warning in self.watch.check(metrics):
            self.console.message(f"warning: {warning}")
        if "console" in self.cfg.trainer.logger:
            self.console.step(metrics, format_line(metrics, LINE_KEYS))

    def close(self, wall_s: float, sent: dict[str, int]) -> None:
        """The console closed, the summary said (``sent``: bytes the driver sent per method),
        the trackers closed."""
        self.console.close()
        vals = [h["val-core/mean"] for h in self.history if "val-core/mean" in h]
        if len(vals) == 1:  # e.g. trainer.test_freq=-1: no "last" to compare with
            self.log(f"validation score: {vals[0]:.4f} (the only validation this run; "
                     "trainer.test_freq sets how often it runs)")
        elif vals:
            self.log(f"validation score: {vals[0]:.4f} (first) -> {vals[-1]:.4f} (last)")
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.phase_totals.items(),
                                                               key=lambda kv: -kv[1]))
        self.log(f"wall time {wall_s:.1f}s" + (f"; by phase: {phases}" if phases else ""))
        sent = sorted(sent.items(), key=lambda kv: -kv[1])
        if sent:
            self.log("sent by the driver: " + ", ".join(f"{k} {v / 1e3:.0f} kB" for k, v in sent))
        if self.trackers is not None:
            self.trackers.close()


def numbers_only(metrics: dict) -> dict:
    """``metrics`` with each value a Python number: a one-element tensor or numpy value (a
    plug-in's ``loss.detach()``) is read out; anything else (a string, a vector) raises
    naming the key, since the trackers and ``minihf plot`` read numbers only."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) and hasattr(value, "item"):
            size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
            value = value.item() if size == 1 else value
        if not isinstance(value, (int, float)):
            raise ValueError(f"metric {key!r} = {str(value)[:60]!r} is not a number; a step's metrics are "
                             "numbers (log a vector's mean or max under its own key, text with the samples)")
        out[key] = value
    return out
