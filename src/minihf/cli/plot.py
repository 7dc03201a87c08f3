"""``minihf plot RUN_DIR [RUN_DIR ...]``: PNG figures from runs' ``metrics.jsonl``.

``overview.png``: a grid of the curves a researcher reads first (training score and
validation score, KL, entropy, response length and its clip ratio, PPO clip fraction), every
run overlaid under its name; ``timing.png``: each run's mean seconds per step, stacked by
phase (``timing_s/*``). Needs matplotlib (``pip install -e ".[plot]"``); rendered off-screen.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import typer

PANELS = [  # (title, [(metric, label)], y label)
    ("score", [("critic/score/mean", "train"), ("val-core/mean", "validation")], "mean score"),
    ("KL to the reference", [("actor/kl_loss", "kl_loss"), ("actor/reward_kl_penalty", "in-reward")], "KL"),
    ("entropy", [("actor/entropy", "")], "nats / token"),
    ("response length", [("response_length/mean", "mean"), ("response_length/max", "max")], "tokens"),
    ("responses cut at the limit", [("response_length/clip_ratio", "")], "fraction"),
    ("PPO clip fraction", [("actor/pg_clipfrac", ""), ("critic/vf_clipfrac", "critic")], "fraction"),
]
PHASES = ("gen", "gen_max", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor", "testing")


def read_run(run_dir: str | Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (the last row per step wins)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run dir (trainer.default_local_dir "
                                "of a run with trainer.logger including jsonl)")
    rows: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not JSON ({e}); the file is damaged") from None
            rows[int(row.get("step", n))] = row
    return [rows[s] for s in sorted(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ``overview.png`` and ``timing.png`` for ``run_dirs`` into ``out_dir``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("minihf plot needs matplotlib: pip install -e \".[plot]\"") from None
    runs = {_name(d, run_dirs): read_run(d) for d in run_dirs}
    empty = [str(Path(d) / "metrics.jsonl") for d, rows in zip(run_dirs, runs.values()) if not rows]
    if len(empty) == len(runs):  # (blank figures before)
        raise ValueError(f"{', '.join(empty)} {'has' if len(empty) == 1 else 'have'} no rows yet (a run "
                         "logs one per step); plot a run after its first step")
    for path in empty:
        warnings.warn(f"{path} has no rows yet; that run is left out of the figures", stacklevel=2)
    runs = {name: rows for name, rows in runs.items() if rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, metrics, ylabel) in zip(axes.flat, PANELS):
        drawn = False
        for i, (name, rows) in enumerate(runs.items()):
            for j, (key, label) in enumerate(metrics):
                x, y = _series(rows, key)
                if not x:
                    continue
                style = dict(color=colors[i % len(colors)], linestyle=("-", "--", ":")[j % 3],
                             marker="o" if len(x) < 30 or key.startswith("val") else None,
                             markersize=3)
                ax.plot(x, y, label=" ".join(p for p in (name, label) if p), **style)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    fig.suptitle(", ".join(runs), fontsize=11)
    fig.tight_layout()
    overview = out / "overview.png"
    fig.savefig(overview, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs) + 3), 5))
    names = list(runs)
    bottom = [0.0] * len(names)
    steps = {name: [r for r in rows if r.get("step", 0) > 0 and "timing_s/step" in r]
             for name, rows in runs.items()}
    for k, phase in enumerate(PHASES):
        means = [sum(r.get(f"timing_s/{phase}", 0.0) for r in s) / len(s) if s else 0.0
                 for s in steps.values()]
        if any(means):
            ax.bar(names, means, bottom=bottom, label=phase, color=colors[k % len(colors)])
            bottom = [b + m for b, m in zip(bottom, means)]
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("where a step's time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    timing = out / "timing.png"
    fig.savefig(timing, dpi=110)
    plt.close(fig)
    return [overview, timing]


def _name(run_dir, all_dirs) -> str:
    """A run's label: its folder name (with the parent when two runs share a name)."""
    p = Path(run_dir).resolve()
    names = [Path(d).resolve().name for d in all_dirs]
    return f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name


def plot(
    run_dirs: list[str] = typer.Argument(..., help="Run dirs holding metrics.jsonl (trainer.default_local_dir)."),
    out: str = typer.Option("plots", help="Directory for overview.png and timing.png."),
) -> None:
    """PNG figures of one or more runs, overlaid.

    Score, validation, KL, entropy, lengths, clip fractions, and a per-phase timing bar."""
    try:
        paths = plot_runs(run_dirs, out)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    for p in paths:
        typer.echo(f"wrote {p}")
