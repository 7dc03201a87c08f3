"""The config reference: every field of a config tree with its type, default and one-line
help, read from the dataclasses themselves (the comment on or just above each field), so
the help cannot drift from the code.

``minihf config show RECIPE [overrides]`` prints a resolved config as YAML with each value's
default and help; ``minihf config doc`` writes ``docs/config.md`` from the same walk.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from minihf.config import _describe, to_dict

_FIELD = re.compile(r"^\s+(?P<name>[A-Za-z_]\w*)\s*:[^#]*?(#\s*(?P<help>.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(?P<text>.*)$")


@dataclass
class Entry:
    key: str       # dotted path
    type: str
    default: Any
    help: str


def field_help(cls: type) -> dict[str, str]:
    """Field name -> help text of a dataclass: its trailing ``# ...`` comment plus the
    comment lines right above it (inherited fields from the base classes too)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines[1:]:
            c = _COMMENT.match(line)
            if c:
                above.append(c["text"].strip())
                continue
            m = _FIELD.match(line)
            if m and m["name"] in {f.name for f in dataclasses.fields(klass)}:
                parts = above + ([m["help"].strip()] if m["help"] else [])
                if parts:
                    out[m["name"]] = " ".join(parts)
            above = []
    return out


def reference(cls: type, prefix: str = "", defaults: Any = None) -> list[Entry]:
    """Every leaf field of the config tree rooted at dataclass ``cls``, depth first; a
    mapping of sections (``roles: dict[str, RoleSection]``) also lists one entry's keys, as
    ``roles.<name>.worker``.

    A nested config's defaults are those of the instance its parent's field builds
    (``defaults``): a ``default_factory`` may set them apart from the class's own (the SFT,
    RM and critic learning rates are not ``OptimConfig``'s). The root is not instantiated:
    its ``__post_init__`` fills fields left ``None`` (resolved later), whose default is the
    ``None``."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    out: list[Entry] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if defaults is not None:
            value = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        if dataclasses.is_dataclass(tp):
            out += reference(tp, key + ".", None if value is dataclasses.MISSING else value)
            continue
        default = "(required)" if value is dataclasses.MISSING else to_dict(value)
        out.append(Entry(key, _describe(tp), default, helps.get(f.name, "")))
        args = typing.get_args(tp) if typing.get_origin(tp) is dict else ()
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # a mapping of sections: one entry's keys
            out += reference(args[1], key + ".<name>.")
    return out


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def show(cfg: Any, sources: dict[str, str] | None = None) -> str:
    """The resolved config ``cfg`` as YAML, each leaf followed by ``# default ...; help``,
    and where the value came from: ``(changed in grpo)``, ``(set in grpo)`` when it equals
    the default, ``(changed on the command line)``; ``sources``: dotted key -> recipe name or
    ``command line`` (``load_config_sources``)."""
    entries = {e.key: e for e in reference(type(cfg))}
    sources = sources or {}

    def origin(key: str) -> str | None:  # the last layer that set the key, or a key below it
        found = [src for k, src in sources.items() if k == key or k.startswith(key + ".")]
        return found[-1] if found else None
    lines: list[str] = []

    def walk(node: dict, prefix: str, depth: int) -> None:
        for k, v in node.items():
            key, pad = f"{prefix}{k}", "  " * depth
            if isinstance(v, dict) and key not in entries:
                lines.append(f"{pad}{k}:")
                walk(v, key + ".", depth + 1)
                continue
            e = entries.get(key)
            text = f"{pad}{k}: {_scalar(v)}"
            if e is not None:
                src = origin(key)
                where = "" if src is None else (" on the command line" if src == "command line"
                                                else f" in {src}")
                note = f"default {_scalar(e.default)}" + (f" (changed{where})" if v != e.default
                                                          else f" (set{where})" if src else "")
                text = f"{text:<48} # {note}" + (f"; {e.help}" if e.help else "")
            lines.append(text)
    walk(to_dict(cfg), "", 0)
    return "\n".join(lines) + "\n"


def markdown(roots: dict[str, type]) -> str:
    """``docs/config.md``: one table per root config (title -> dataclass)."""
    out = ["# Configuration reference", "",
           "Generated by `minihf config doc` from the config dataclasses (do not edit by hand). "
           "Set any key in a recipe's `config.yaml` or on the command line as "
           "`section.key=value`; `minihf config show RECIPE` (`--kind rm` for a reward-model "
           "recipe) prints a recipe's resolved values.", ""]
    for title, cls in roots.items():
        out += [f"## {title}", "", "| key | type | default | help |", "|---|---|---|---|"]
        for e in reference(cls):
            cells = [f"`{e.key}`", e.type.replace("|", "\\|"), f"`{_scalar(e.default)}`",
                     e.help.replace("|", "\\|")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def doc_roots() -> dict[str, type]:
    """The configs users write: RL (``minihf train``), SFT (``minihf sft``) and reward
    models (``minihf rm``)."""
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import SFTConfig

    return {"RL: `minihf train`, `scripts/train_ppo.py`": PPOJobConfig,
            "SFT: `minihf sft`, `scripts/train_sft.py`": SFTConfig,
            "Reward model: `minihf rm`, `scripts/train_rm.py`": RMConfig}
