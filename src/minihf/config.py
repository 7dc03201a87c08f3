"""Configuration: validated dataclasses, YAML recipes, dotted command-line overrides.

A config is a tree of dataclasses; each module declares its own section next to the code
that uses it (``ControllerConfig`` in ``controller/config.py``, the trainer's sections in
``trainer/``) and a job
composes them as fields of one root dataclass. ``load_config(Root, recipe, overrides)``
layers, in increasing precedence: the dataclass defaults, the recipe file
(``recipes/<name>/config.yaml``, over the recipes it names as ``base:``, see
``recipe_layers``), and ``key.sub.key=value`` overrides whose values are
parsed as YAML scalars (``1e-6``, ``true``, ``[1, 2]``, ``null``); ``~key.sub`` deletes an
entry of a dict-typed field. Dicts are merged key by key at every level; lists are replaced.
File references in a recipe's YAML (``reward.py``, ``algo.py:my_estimator``) that exist
relative to the recipe's folder are made absolute, so a forked recipe folder carries its
code; on the command line they are relative to the working directory. Recipe files and
override values are read by ``minihf.utils.yaml_load`` (safe YAML; aliases that expand past
a bound, the "billion laughs" file, are refused in one line naming the file).

Every value is type-checked against the annotations (Optional, Union, Literal, list,
tuple, dict, nested dataclasses); an unknown key is an error that lists the valid keys at
that level and suggests the closest one. Range checks live in each dataclass's
``__post_init__``; their messages are prefixed with the dotted path of the section.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from minihf.utils.yaml_load import YAMLInputError, load_yaml, load_yaml_file

T = TypeVar("T")
# minihf's own recipes: package data (``src/minihf/recipes``), so an installed wheel has them
# too; read-only examples (a user's own live in their ``./recipes``: ``minihf recipe new``)
DEFAULT_RECIPES_DIR = Path(str(resources.files("minihf") / "recipes"))


class ConfigError(ValueError):
    """A configuration value, key or file is invalid; the message says which and why."""


def parse_value(text: str) -> Any:
    """Parse one override value as a YAML scalar or flow collection (``load_yaml``)."""
    try:
        return load_yaml(text, f"value {text!r:.60}")
    except YAMLInputError as e:
        if not e.syntax:  # YAML, but refused (an alias bomb): quoting is not the fix
            raise ConfigError(str(e)) from None
        raise ConfigError(f"cannot parse value {text!r} as YAML ({e.problem}); quote it to pass a "
                          f"string: key='\"{text}\"'") from None


def suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_describe(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert it (dict -> dataclass, ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        names = [a for a in args if isinstance(a, str)]
        hint = suggest(value, names) if isinstance(value, str) else ""
        allowed = ", ".join(map(repr, args))
        raise ConfigError(f"{path}: {value!r} is not one of {allowed}; {hint}".rstrip("; "))
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1 and (dataclasses.is_dataclass(options[0])
                                  or typing.get_origin(options[0]) is not None):
            return _coerce(value, options[0], path)  # the section's own error is more precise
        if float in options and isinstance(value, float) and not math.isfinite(value):
            return _coerce(value, float, path)  # the float's own error: not finite
        if str in options and isinstance(value, str):
            return value  # the text as written ('0.5_2' for Union[float, str] is 'lower_upper')
        for arg in options:
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r} "
                          f"({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, path)
        raise ConfigError(f"{path}: expected a section ({tp.__name__}: a mapping of "
                          f"{', '.join(_field_names(tp))}), got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            example = f"[{value}]" if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "[1, 2]"
            raise ConfigError(f"{path}: expected {_describe(tp)} (e.g. {example}), got {value!r}")
        if origin is list or not args or (len(args) == 2 and args[1] is Ellipsis):
            args = (args[0] if args else Any,) * len(value)
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items ({_describe(tp)}), "
                              f"got {value!r}")
        items = [_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping ({_describe(tp)}), got {value!r}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, f"{path}.{k}"): _coerce(v, vt, f"{path}.{k}")
                for k, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # every float key is finite; "no limit" is null
            raise ConfigError(f"{path}: expected a finite number, got {value!r} (a YAML .nan or .inf, or a "
                              "number too large for a float); where a key allows no limit, null means that")
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `run_name=2024` means the string
    if tp in (int, float) and isinstance(value, str) and _SEPARATED[tp].fullmatch(value):
        return tp(value)  # a number written with digit separators, 1_000 (YAML reads it as text)
    if tp is Path and isinstance(value, (str, Path)):
        return Path(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and type(value) is bool):
        return value
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r} "
                      f"({type(value).__name__})")


_SEPARATED = {int: re.compile(r"[-+]?[0-9][0-9_]*"),
              float: re.compile(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?")}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def from_dict(cls: type[T], data: dict, path: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict, type-checking every value.

    Keys absent from ``data`` keep their dataclass defaults. Errors name the dotted path.
    """
    hints = typing.get_type_hints(cls)
    valid = _field_names(cls)
    where = path or cls.__name__
    for key in data:
        if key not in valid:
            deeper = _nested_keys(cls, str(key))
            hint = (f"did you mean {' or '.join(repr(_join(path, d)) for d in deeper)}? " if deeper
                    else suggest(str(key), valid))
            raise ConfigError(f"unknown key {_join(path, str(key))!r}; {hint}"
                              f"valid keys in {where}: {', '.join(valid)}")
    kwargs = {k: _coerce(v, hints[k], _join(path, k)) for k, v in data.items()}
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing required keys {missing}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # __post_init__ checks: add where they apply
        raise ConfigError(f"{where}: {e}") from None


def _nested_keys(cls: type, name: str, depth: int = 3) -> list[str]:
    """Dotted paths below ``cls`` whose last key is ``name`` (e.g. ``timeout_s`` ->
    ``controller.timeout_s``), for the unknown-key hint."""
    found = []
    if depth == 0 or not dataclasses.is_dataclass(cls):
        return found
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if dataclasses.is_dataclass(tp):
            if name in _field_names(tp):
                found.append(f"{f.name}.{name}")
            found += [f"{f.name}.{k}" for k in _nested_keys(tp, name, depth - 1) if k.count(".")]
    return sorted(set(found))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_dict(cfg: Any) -> Any:
    """Plain, YAML-serialisable nested dict/list/scalar form of a config tree."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> Path:
    """Write ``to_dict(cfg)`` as YAML; ``load_config(type(cfg), path)`` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _defaults(cls: type) -> dict:
    """The defaults of ``cls`` as a nested dict (sections without a default are recursed)."""
    out: dict = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = to_dict(f.default_factory())
        elif dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _defaults(hints[f.name])
    return out


def _merge(base: Any, new: Any) -> Any:
    if isinstance(base, dict) and isinstance(new, dict):
        out = dict(base)
        for k, v in new.items():
            out[k] = _merge(base.get(k), v)
        return out
    return new


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b.c=value`` (or ``~a.b.c``) override to a nested dict in place."""
    delete = override.startswith("~")
    key, eq, text = override[delete:].partition("=")
    if (not eq and not delete) or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} must look like key.sub=value "
                          "(e.g. actor.optim.lr=1e-6) or ~key.sub to delete an entry")
    *parents, last = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parents[:i + 1])!r} is a value "
                              f"({child!r}), not a section")
        node = child
    if delete:
        if last not in node:
            raise ConfigError(f"override {override!r}: nothing to delete; "
                              f"{suggest(last, list(node))}keys there: "
                              f"{', '.join(map(str, node))}")
        del node[last]
    else:
        node[last] = _merge(node.get(last), parse_value(text))


def find_recipe(recipe: str | Path, recipes_dir: str | Path | None = None) -> Path:
    """A recipe directory or YAML file; else a name: ``recipes/<name>/config.yaml`` under the
    working directory (your own project's recipes, e.g. a fork), then minihf's own."""
    path = Path(recipe)
    if path.is_dir():
        path = path / "config.yaml"
    if path.is_file():
        return path
    local = Path("recipes") / str(recipe) / "config.yaml"
    if recipes_dir is None and local.is_file():
        return local
    root = Path(recipes_dir) if recipes_dir is not None else DEFAULT_RECIPES_DIR
    named = root / str(recipe) / "config.yaml"
    if named.is_file():
        return named
    names = sorted(p.parent.name for p in root.glob("*/config.yaml"))
    raise ConfigError(f"recipe {str(recipe)!r} not found (no such file, and no {named}); "
                      f"{suggest(str(recipe), names)}recipes in {root}: "
                      f"{', '.join(names) or 'none'}")


def recipe_layers(recipe: str | Path, recipes_dir: str | Path | None = None) -> list[tuple[str, dict]]:
    """``(label, values)`` of a recipe and of the recipes it builds on, the furthest base
    first. A recipe names its base with a top-level ``base: NAME``, found in a folder
    beside its own first (so minihf's zoo builds on minihf's grpo), then as ``recipe=NAME``
    is; or ``base: ../path/to/recipe``, from its own folder. File references are made
    absolute per layer, from that layer's folder."""
    layers, seen = [], []
    path = find_recipe(recipe, recipes_dir)
    while True:
        if path.resolve() in seen:
            chain = " -> ".join(str(p) for p in [*seen, path.resolve()])
            raise ConfigError(f"recipe bases loop: {chain}; one of them must not name a base")
        seen.append(path.resolve())
        try:
            loaded = load_yaml_file(path, "recipe") or {}
        except YAMLInputError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path} must be a mapping of keys, "
                              f"got {type(loaded).__name__}")
        base = loaded.pop("base", None)
        label = path.parent.name if path.name == "config.yaml" else str(path)
        layers.insert(0, (label, _recipe_relative(loaded, path.parent)))
        if base is None:
            return layers
        if not isinstance(base, str) or not base:
            raise ConfigError(f"recipe {path}: base={base!r} must name a recipe (e.g. base: grpo)")
        sibling = path.parent.parent / base / "config.yaml"
        try:
            if "/" in base or base.endswith((".yaml", ".yml")):  # a path, from this recipe's folder
                path = find_recipe(path.parent / base)
            else:
                path = sibling if sibling.is_file() else find_recipe(base, recipes_dir)
        except ConfigError as exc:
            raise ConfigError(f"recipe {path}: base {base!r}: {exc}") from None


def load_config_sources(cls: type[T], recipe: str | Path | None = None, overrides: list[str] = (),
                        recipes_dir: str | Path | None = None) -> tuple[T, dict[str, str]]:
    """``load_config`` and where each value set by a recipe or an override came from:
    dotted key -> the recipe's name (its base's, for a value it inherits) or ``command line``."""
    data, sources = _defaults(cls), {}
    layers = recipe_layers(recipe, recipes_dir) if recipe is not None else []
    for label, values in layers:
        data = _merge(data, values)
        sources.update(dict.fromkeys(_leaves(values), label))
    for override in overrides:
        apply_override(data, override)
        sources[override.lstrip("~").partition("=")[0]] = "command line"
    return from_dict(cls, data), sources


def _leaves(values: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in values.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def load_config(cls: type[T], recipe: str | Path | None = None, overrides: list[str] = (),
                recipes_dir: str | Path | None = None) -> T:
    """Defaults of ``cls`` <- the recipe's bases <- the recipe YAML <- dotted overrides,
    validated into ``cls``."""
    return load_config_sources(cls, recipe, overrides, recipes_dir)[0]


_CODE_FILE = re.compile(r"(?P<path>[^:]+\.py)(?P<name>:[A-Za-z_]\w*)?")


def _recipe_relative(value: Any, folder: Path) -> Any:
    """``value`` with each ``file.py`` / ``file.py:name`` string that names a file in
    ``folder`` made absolute."""
    if isinstance(value, dict):
        return {k: _recipe_relative(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_recipe_relative(v, folder) for v in value]
    if isinstance(value, str):
        m = _CODE_FILE.fullmatch(value)
        if m and not Path(m["path"]).is_absolute() and (folder / m["path"]).is_file():
            return str((folder / m["path"]).resolve()) + (m["name"] or "")
    return value


def section_of(cfg: Any, dotted: str) -> Any:
    """The config section at a dotted path (a mapping's entries indexed, e.g. ``roles.teacher``)."""
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def split_cli_args(args: list[str]) -> tuple[str | None, list[str]]:
    """Split script arguments into the ``recipe=NAME`` value and the other overrides."""
    recipes = [a.partition("=")[2] for a in args if a.startswith("recipe=")]
    if len(recipes) > 1:
        raise ConfigError(f"recipe given {len(recipes)} times: {recipes}")
    return (recipes[0] if recipes else None), [a for a in args if not a.startswith("recipe=")]
