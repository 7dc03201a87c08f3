"""``minihf config show`` and ``minihf config doc``: a recipe's resolved config with each
value's help and where it came from, and the generated configuration reference."""

from __future__ import annotations

import typer

config_app = typer.Typer(no_args_is_help=True, help="Inspect configs: resolved values, defaults, help.",
                         context_settings={"help_option_names": ["-h", "--help"]})


@config_app.command("show", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def config_show(
    ctx: typer.Context,
    kind: str = typer.Option("auto", help="rl | sft | rm: whose config (defaults differ: an RM "
                                          "recipe loads as SFT too); auto: RL, else SFT."),
) -> None:
    """Print a recipe's resolved config as YAML, each value with its default and help.

    `minihf config show grpo actor_rollout_ref.rollout.n=4`; `--kind rm` for a reward-model
    recipe (`minihf config show rm_sort --kind rm`)."""
    from minihf.config import ConfigError, load_config_sources
    from minihf.cli.config_help import show
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import SFTConfig

    kinds = {"rl": (PPOJobConfig, "minihf train"), "sft": (SFTConfig, "minihf sft"),
             "rm": (RMConfig, "minihf rm")}
    if kind != "auto" and kind not in kinds:
        raise typer.BadParameter(f"--kind {kind!r}: use auto, rl, sft or rm")
    order = ["rl", "sft"] if kind == "auto" else [kind]
    try:
        from minihf.launcher import recipe_and_overrides
        from minihf.trainer.ppo_job import DEFAULT_RECIPE

        recipe, overrides = recipe_and_overrides(ctx.args)
        recipe = recipe or DEFAULT_RECIPE
        # the kind is the first the recipe itself loads as; the overrides' errors are then
        # that kind's (a typo in an SFT override was reported as the RL loader's complaint
        # about the whole recipe)
        errors = []
        for k in order:
            try:
                load_config_sources(kinds[k][0], recipe, [])
                break
            except ConfigError as exc:
                errors.append(exc)
        else:
            raise errors[0]
        cfg, sources = load_config_sources(kinds[k][0], recipe, overrides)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    others = ", ".join(f"--kind {o}" for o in kinds if o != k)
    typer.echo(f"# the {k.upper()} config of `{kinds[k][1]}` ({others} for another trainer's)")
    typer.echo(show(cfg, sources), nl=False)


@config_app.command("doc")
def config_doc(
    out: str = typer.Option("docs/config.md", help="Where to write the reference."),
    check: bool = typer.Option(False, help="Only check that OUT is up to date (exit 1 if not)."),
) -> None:
    """Write the configuration reference (every key, type, default, help) as Markdown."""
    from pathlib import Path

    from minihf.cli.config_help import doc_roots, markdown

    text = markdown(doc_roots())
    path = Path(out)
    if check:
        if not path.is_file() or path.read_text() != text:
            typer.echo(f"{path} is out of date; run `minihf config doc`", err=True)
            raise typer.Exit(1)
        typer.echo(f"{path} is up to date")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    typer.echo(f"wrote {path}")

