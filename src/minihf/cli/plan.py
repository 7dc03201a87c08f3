"""``minihf plan``: rank the placements of an RL job on a cluster (``minihf.planner``).

A search with more placements than the planner enumerates is refused in one line naming the
``--unit`` that fits; a long one says how far it is every 10 s (on stderr); ``--measure``
starts at most the ranks this machine can hold (``minihf.launcher.max_local_ranks``).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
import yaml

PHASES = ("gen", "reshard", "reward", "old_log_prob", "ref", "values", "update_actor", "update_critic")


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


PLAN_HEADER = "# written by `minihf plan`"


def check_plan_out(path: Path) -> None:
    """``--out``: a file that can be written, and, when it exists, a plan written before
    (replaced); any other file (a recipe, a data file) is refused: it would be lost."""
    from minihf.utils.files import check_writable_file

    try:
        check_writable_file(path, "--out")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if path.exists():
        try:
            with open(path, "rb") as f:
                first = f.read(len(PLAN_HEADER))
        except OSError as exc:
            raise typer.BadParameter(f"--out {path}: cannot be read ({exc.strerror}); choose another path") from exc
        if first != PLAN_HEADER.encode():
            raise typer.BadParameter(f"--out {path} exists and is not a plan `minihf plan` wrote (it does not "
                                     f"start with {PLAN_HEADER!r}); choose another path, or delete it first")


def write_plan(path: Path, recipe: str, overrides: list[str], plan_keys: dict) -> Path:
    """A recipe file: ``base:`` the planned recipe, the command line's overrides, the plan's
    keys; ``train_ppo.py recipe=PATH`` runs it as it is."""
    from minihf.config import find_recipe, parse_value

    found = find_recipe(recipe)
    base = recipe if "/" not in recipe and not Path(recipe).exists() else str(found.resolve())
    deletions = [o for o in overrides if "=" not in o]
    if deletions:  # a recipe file has no way to delete a key its base sets
        raise typer.BadParameter(f"--out cannot carry {deletions[0]!r} (a deletion); pass it to train_ppo.py "
                                 "with the written recipe instead")
    given = {k: parse_value(v) for k, v in (o.split("=", 1) for o in overrides)}  # as train_ppo.py reads them
    body = {"base": base, **_nested({**given, **plan_keys})}
    path.write_text(f"{PLAN_HEADER}; run with: torchrun ... scripts/train_ppo.py recipe="
                    f"{path}\n" + yaml.safe_dump(body, sort_keys=False))
    return path


def _figures(p) -> str:
    return (f"{p.flops / 1e9:.1f} GFLOP/s, {p.memory_bandwidth / 1e9:.1f} GB/s memory, "
            f"{p.intra_node_bandwidth / 1e9:.2f} GB/s and {p.collective_latency * 1e6:.0f} us a collective")


class _Progress:
    """``search``'s progress callback: a line every ``every_s`` seconds of a long search."""

    def __init__(self, every_s: float = 10.0):
        self.start = self.last = time.monotonic()
        self.every_s = every_s

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            typer.echo(f"searching: {done:,} of {total:,} placements after {now - self.start:.0f} s", err=True)


def plan(
    args: list[str] = typer.Argument(None, help="[RECIPE] key=value ... as train_ppo.py takes them"),
    devices: int = typer.Option(None, "--devices", help="devices (ranks) in all"),
    nodes: int = typer.Option(1, "--nodes", help="nodes; the devices are split evenly over them"),
    profile: str = typer.Option(None, "--profile", help="A100-80GB | H100 | H200, or a file from --measure"),
    model: list[str] = typer.Option([], "--model", help="ROLE=DIR|NAME (e.g. all=llama-7b): a role's model "
                                    "instead of its model.path"),
    top: int = typer.Option(10, "--top", help="plans to show (>= 1)"),
    unit: int = typer.Option(1, "--unit", help="give groups multiples of UNIT devices (e.g. 8, the node "
                             "size, on a large cluster: far fewer candidates)"),
    out: Path = typer.Option(None, "--out", help="write the best plan as a recipe file train_ppo.py runs "
                             "(an existing file is replaced only if it is a plan written before)"),
    measure: bool = typer.Option(False, "--measure", help="measure this machine (matmuls at the recipe's "
                                 "shapes when one is given), write --profile-out and plan with it"),
    profile_out: Path = typer.Option(Path("profile.yaml"), "--profile-out", help="where --measure writes"),
) -> None:
    """Rank the placements of an RL job on a cluster by predicted seconds per step."""
    from minihf.config import ConfigError
    from minihf.launcher import recipe_and_overrides
    from minihf.planner import describe, load_profile, measure as measure_machine, plan_overrides, search, workload
    from minihf.planner.profiles import save_profile

    if devices is None or (profile is None and not measure):
        raise typer.BadParameter("give --devices N and --profile NAME|FILE (or --measure)")
    if devices < 1 or nodes < 1 or devices % nodes:
        raise typer.BadParameter(f"--devices {devices} must be >= 1 and split evenly over --nodes {nodes}")
    if unit < 1 or devices % unit:
        raise typer.BadParameter(f"--unit {unit} must be >= 1 and divide --devices {devices}")
    if top < 1:
        raise typer.BadParameter(f"--top {top} must be >= 1 (the number of plans to show)")
    if out is not None:  # before the search, not after its table
        check_plan_out(out)
    if measure:
        from minihf.utils.files import check_writable_file

        try:
            check_writable_file(profile_out, "--profile-out")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    bad = [m for m in model if "=" not in m]
    if bad:
        raise typer.BadParameter(f"--model {bad[0]!r}: give ROLE=DIR|NAME, e.g. all=llama-7b")
    if model and out is not None:  # the written recipe would train its own models with budgets sized for these
        raise typer.BadParameter(f"--out writes a recipe that trains the recipe's models, and --model {model[0]} "
                                 "plans for another; give the models as overrides instead "
                                 "(actor_rollout_ref.model.path=DIR, critic.model.path=DIR), which --out carries")
    if measure:  # --devices ranks of this machine measure it: as many as it can start
        from minihf.launcher import max_local_ranks

        most, why = max_local_ranks(cpu=True)
        if devices > most:
            raise typer.BadParameter(f"--measure --devices {devices} starts {devices} ranks on this machine, more "
                                     f"than it can: {why}; measure with --devices {most} or fewer, and plan a "
                                     "larger cluster with --profile FILE")
    if measure and not args:  # this machine alone: matmuls at a square size
        prof = measure_machine(world=devices)
        typer.echo(f"wrote {save_profile(prof, profile_out)}: {_figures(prof)}")
        return
    from dataclasses import replace

    from minihf.trainer.ppo_job import DEFAULT_RECIPE, PPOJobConfig

    recipe, overrides = recipe_and_overrides(list(args or []))
    recipe = recipe or DEFAULT_RECIPE
    try:
        from minihf.config import load_config

        cfg = load_config(PPOJobConfig, recipe, overrides)
        w = workload(cfg, dict(m.split("=", 1) for m in model))
        if measure:  # this machine, its matmuls at the actor's MLP shape
            actor = w.role("actor").model
            prof = measure_machine(world=devices, linear=(4096, actor.hidden, actor.ffn))
            typer.echo(f"wrote {save_profile(prof, profile_out)}: {_figures(prof)}")
        else:
            prof = load_profile(profile)
        prof = replace(prof, devices_per_node=devices // nodes)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        result = search(w, devices, prof, unit, progress=_Progress())
    except ValueError as exc:  # more placements than the planner enumerates
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"job: {recipe}; {w.prompts} prompts x {w.sequences // w.prompts} samples, "
               f"{w.prompt_len}+{w.response_len} tokens; roles: "
               + ", ".join(f"{r.name} {_param_count(r.model)}" for r in w.roles))
    typer.echo(f"cluster: {devices} x {prof.name} on {nodes} node(s)  ({prof.source})")
    typer.echo(f"candidates: {result.considered} considered, {result.refused} refused by the batch sizes, "
               f"{result.infeasible} over memory, {len(result.ranked)} feasible")
    if not result.ranked:
        typer.echo(_no_plan_advice(w, devices, unit, result), err=True)
        raise typer.Exit(1)
    typer.echo("| # | plan | s/step | " + " | ".join(PHASES) + " | peak GB/device |")
    typer.echo("|---|---|---|" + "---|" * len(PHASES) + "---|")
    for i, e in enumerate(result.ranked[:top], 1):
        peaks = ", ".join(f"{p / 1e9:.1f}" for p in e.peak_bytes.values())
        typer.echo(f"| {i} | {describe(e.plan)} | {e.step_seconds:.3g} | "
                   + " | ".join(f"{e.phases[p]:.3g}" for p in PHASES) + f" | {peaks} |")
    if out is not None:
        keys = plan_overrides(result.ranked[0].plan, devices, w)
        typer.echo(f"wrote {write_plan(out, recipe, overrides, keys)}")


def _no_plan_advice(w, devices: int, unit: int, result) -> str:
    """Why no plan fits, and the fix: batch sizes that split over no group's devices, or memory."""
    if result.infeasible:
        return "no plan fits: use more devices, smaller micro-batches or activation checkpointing"
    minis = sorted({r.mini_batch for r in w.roles if r.trains})
    fits = [n for n in range(unit, 2 * devices + 1, unit) if n != devices and all(m % n == 0 for m in minis)]
    near = sorted(fits, key=lambda n: abs(n - devices))[:2]
    return (f"no plan fits: ppo_mini_batch_size ({' and '.join(map(str, minis))} sequences) splits evenly "
            f"over no group these {devices} devices allow; use --devices "
            f"{' or '.join(map(str, sorted(near))) or unit}, or a ppo_mini_batch_size that is a multiple of {devices}")


def _param_count(model) -> str:
    """``12.3M``, or for a mixture-of-experts model ``30.5M (3.3M active)``: memory counts
    every expert, compute the routed ones."""
    text = f"{model.params / 1e6:.1f}M"
    return text if model.active == model.params else f"{text} ({model.active / 1e6:.1f}M active)"
