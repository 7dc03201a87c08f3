"""``minihf recipe new`` and ``minihf recipe list``: a user's recipes live in the user's own
folder (``./recipes`` by default), minihf's shipped ones stay read-only examples."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import typer

recipe_app = typer.Typer(no_args_is_help=True, help="Start a recipe of your own; list the recipes found.",
                         context_settings={"help_option_names": ["-h", "--help"]})

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _inside(path: Path, root: Path) -> bool:
    return path.resolve() == root.resolve() or root.resolve() in path.resolve().parents


def _summary(config: Path) -> str:
    """The first comment line of a recipe's config.yaml (what it is), or ''."""
    for line in config.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            return ""
    return ""


BASE_LINE = re.compile(r"""^base:[ \t]*(['"]?)([^'"#\s]+)\1""", re.M)


def _base_from(folder: Path, ref: str) -> Path | None:
    """The recipe a ``base: ref`` in ``folder``'s config.yaml names (``config.recipe_layers``'
    rule: a relative path from the folder; a name in a folder beside it first, then as
    ``recipe=NAME`` is), resolved; None where none is found."""
    from minihf.config import ConfigError, find_recipe

    if "/" in ref or ref.endswith((".yaml", ".yml")):
        target = (folder / ref).resolve()
        return target if target.exists() else None
    sibling = folder.parent / ref / "config.yaml"
    try:
        return (sibling if sibling.is_file() else find_recipe(ref)).resolve().parent
    except ConfigError:
        return None


def _rebase_copy(config: Path, origin: Path) -> None:
    """A copied recipe's ``base:`` was read from the base's folder (``origin``) and is read
    from the copy's now: where it would name another recipe there (a relative path; a name
    found beside the original), it is rewritten as the path to the original's base, relative
    to the copy. An absolute path, or a name that finds the same recipe, stays."""
    text = config.read_text()
    m = BASE_LINE.search(text)
    if m is None or Path(m.group(2)).is_absolute():
        return
    was = _base_from(origin, m.group(2))
    if was is None or was == _base_from(config.parent, m.group(2)):
        return
    new = os.path.relpath(was, config.parent.resolve())
    config.write_text(text[:m.start(2)] + new + text[m.end(2):])


def new_recipe(name: str, base: str, out_dir: str | Path = "recipes", copy: bool = False) -> Path:
    """Write ``out_dir/name/``: a ``config.yaml`` that builds on ``base`` (``base: BASE``, so
    only what differs is stated), or with ``copy`` every file of the base recipe. Returns the
    folder. Raises ``ConfigError`` on a bad name, an unknown base, an existing folder or a
    folder inside minihf's own (shipped) recipes."""
    from minihf.config import DEFAULT_RECIPES_DIR, ConfigError, find_recipe, recipe_layers

    if not NAME.fullmatch(name):
        raise ConfigError(f"recipe name {name!r}: use letters, digits, '_', '-' or '.' (a folder name, "
                          f"e.g. my_exp)")
    target = Path(out_dir) / name
    if _inside(target, DEFAULT_RECIPES_DIR):
        raise ConfigError(f"{target} lies in minihf's shipped recipes ({DEFAULT_RECIPES_DIR}), which are "
                          f"read-only examples; write yours to a folder of your own (--dir recipes, the "
                          f"default, from your project's directory)")
    if target.exists():
        raise ConfigError(f"{target} already exists; choose another name or remove it")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"--dir {out_dir} is a file; pass the folder your recipes live in")
    by_name = "/" not in base and not Path(base).exists()
    if by_name and name == base:  # `base: NAME` is looked up beside the recipe first: itself
        raise ConfigError(f"a recipe named {name!r} building on the recipe {base!r} would shadow it (recipe="
                          f"{name} would find yours) and build on itself; choose another name")
    source = find_recipe(base)
    recipe_layers(source)  # a YAML that is not a recipe (or a broken base chain) fails here, named
    target.mkdir(parents=True)
    if copy:
        # a recipe folder: its config and its code; a recipe YAML file: that file alone
        files = sorted(source.parent.iterdir()) if source.name == "config.yaml" else [source]
        for f in files:
            if f.is_file() and not f.name.endswith(".pyc"):
                shutil.copy2(f, target / ("config.yaml" if f == source else f.name))
        _rebase_copy(target / "config.yaml", source.parent)
        return target
    # a path is read from the new recipe's folder: written relative to it (as typed, a
    # relative --base recipes/g2 became recipes/g3/recipes/g2); a YAML file as itself
    ref = base if by_name else os.path.relpath(source.parent if source.name == "config.yaml" else source, target)
    (target / "config.yaml").write_text(
        f"# {name}: builds on the `{base}` recipe ({source}); state here only what differs.\n"
        f"# `minihf config show {name}` prints every resolved value, its help and where it came from.\n"
        f"base: {ref}\n")
    return target


@recipe_app.command("new")
def recipe_new(
    name: str = typer.Argument(..., help="The new recipe's name (its folder)."),
    base: str = typer.Option("grpo", help="The recipe it builds on: a name (`minihf recipe list`) or a path."),
    dir: str = typer.Option("recipes", "--dir", help="Where your recipes live; `recipe=NAME` looks in "
                                                     "./recipes first, else pass the folder as recipe=PATH."),
    copy: bool = typer.Option(False, "--copy", help="Copy the base's files (config.yaml and its Python) "
                                                    "instead of writing `base: BASE` with nothing changed."),
) -> None:
    """Start a recipe of your own: `minihf recipe new my_exp --base grpo` writes
    recipes/my_exp/config.yaml (`base: grpo`); run it with recipe=my_exp."""
    from minihf.config import ConfigError

    try:
        target = new_recipe(name, base, dir, copy)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    files = ", ".join(sorted(p.name for p in target.iterdir()))
    typer.echo(f"wrote {target}/ ({files}); run it with recipe={name if dir == 'recipes' else target}")


@recipe_app.command("list")
def recipe_list() -> None:
    """The recipes `recipe=NAME` finds: yours under ./recipes first, then minihf's shipped ones."""
    from minihf.config import DEFAULT_RECIPES_DIR

    local = Path("recipes")
    for label, root in (("yours (./recipes)", local), (f"shipped ({DEFAULT_RECIPES_DIR})", DEFAULT_RECIPES_DIR)):
        found = sorted(p for p in root.glob("*/config.yaml")) if root.is_dir() else []
        if root is local and not found:
            continue
        typer.echo(f"# {label}")
        for config in found:
            typer.echo(f"{config.parent.name:<28} {_summary(config)}")
