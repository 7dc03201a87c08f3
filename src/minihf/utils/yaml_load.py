"""Reading the YAML users write (recipes, ``key=value`` overrides, planner profiles): one loader.

``load_yaml`` is PyYAML's safe loader (plain data: no Python objects, no code) with these
changes, and every YAML minihf reads from a user goes through it:

* ``1e-6`` / ``3E5`` read as floats, as YAML 1.2 reads them (PyYAML's YAML 1.1 reads
  strings);
* the document may not stand for more than ``MAX_NODES`` values once its aliases are
  expanded. An alias (``*name``) is a reference, so PyYAML builds a 12-line "billion
  laughs" file (each line's list holding the previous one nine times) in a millisecond,
  but minihf copies a recipe's values (merging layers, making file paths absolute,
  validating), which expands every reference: such a file took minutes and gigabytes.
  The count is made on the parsed nodes, each shared node counted once per reference
  (memoized, so counting is linear in the file), before anything is built, and a file
  over the bound is refused in milliseconds. Aliases themselves stay allowed: a recipe may
  share a section (``safe_rlhf``'s ``cost_critic: *critic``). A merge key (``<<: *base``)
  is counted the same way. A node that contains itself (``&a [*a]``) is refused too: a
  config is a tree.
* the text may not be longer than ``MAX_BYTES``. PyYAML parses in pure Python (~15 us a
  byte here), so the node count above comes only after the whole parse: a 4.5 MB recipe
  took over a minute to refuse. A file's size is known before it is read, and one over
  the bound is refused at once; minihf's recipes and profiles are a few KB;
* a key may appear once in a mapping (PyYAML keeps the last of two silently);
* a plain number written with ``_`` (``0.5_2``, ``1_000``) is text, as in YAML 1.2: YAML
  1.1 reads ``0.5_2`` as 0.52. A config key whose type is a number reads the text as one
  (``minihf.config``), so ``total_training_steps: 1_000`` is still 1000.

Errors are ``YAMLInputError`` (a ``ValueError``), one line naming the file (or the value)
and what to change, never PyYAML's multi-line report.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

# Values a document may stand for, aliases expanded. minihf's largest recipe is a few
# hundred; a bound far above any real config and far below what takes time to copy.
MAX_NODES = 100_000
# Bytes of YAML text. minihf's largest recipe is ~3 KB; this bound parses in a couple of
# seconds at most, where a file 20x over it would take a minute.
MAX_BYTES = 128 * 1024


class YAMLInputError(ValueError):
    """YAML that cannot be read as a config; ``problem`` is the reason without the file name,
    ``syntax`` whether the text is not YAML at all (rather than YAML minihf refuses)."""

    def __init__(self, message: str, problem: str, syntax: bool = False):
        super().__init__(message)
        self.problem, self.syntax = problem, syntax


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loader that also reads ``1e-6`` / ``3E5`` as floats (YAML 1.2 does),
    and a plain number written with ``_`` as the text it is (YAML 1.2 has no digit
    separators): YAML 1.1 read rollout correction's ``0.5_2`` (lower_upper) as the number
    0.52, a truncation cap. A key whose type is a number still takes ``1_000`` (Python's
    int() and float() read it)."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and "_" in value and tag in _NUMBER_TAGS:
            return "tag:yaml.org,2002:str"
        return tag


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


class _SelfReference(Exception):
    pass


def expanded_size(root: yaml.Node, cap: int = MAX_NODES) -> int:
    """Values ``root`` stands for with every alias expanded (each key and value one), at most
    ``cap + 1``: a shared node is counted once per reference, its size computed once."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _SelfReference
        total = 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            open_nodes.add(key)
            children = (node.value if isinstance(node, yaml.SequenceNode)
                        else [item for pair in node.value for item in pair])
            for child in children:
                total = min(total + size(child), cap + 1)  # small ints: no 9**9 sums
            open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def duplicate_key(root: yaml.Node) -> tuple[str, int, int] | None:
    """The first key that appears twice in one mapping of ``root`` (PyYAML keeps the last and
    drops the first without a word: a second ``data:`` section appended to a recipe replaced
    the first), with the lines of both; None when there is none. A merge key (``<<``) is not a
    duplicate of the keys it brings in: overriding those is what it is for."""
    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes or not isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
            continue
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            stack.append(value)
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if (key.tag, key.value) in first:
                return key.value, first[(key.tag, key.value)], line
            first[(key.tag, key.value)] = line
    return None


def load_yaml(text: str, where: str) -> Any:
    """The data of YAML ``text``; ``where`` names it in errors (e.g. ``recipe /path/x.yaml``)."""
    if len(text) > MAX_BYTES:
        raise _too_large(where, len(text))
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = expanded_size(node)
        except _SelfReference:
            raise YAMLInputError(f"{where}: an alias refers to the node that contains it (a loop, "
                                 "e.g. `a: &x [*x]`); a config is a tree, so remove that alias",
                                 "a recursive alias") from None
        if size > MAX_NODES:
            raise YAMLInputError(
                f"{where}: its aliases (*name) expand to more than {MAX_NODES:,} values (a config has a few "
                "hundred; aliases nested in aliases multiply, the \"billion laughs\" pattern); write the "
                "values out, or use each alias once", "aliases expand to too many values")
        twice = duplicate_key(node)
        if twice:
            key, a, b = twice
            raise YAMLInputError(f"{where}: the key {key!r} appears twice in one mapping (lines {a} and {b}); "
                                 "YAML would keep only the second, so merge the two", f"duplicate key {key!r}")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise YAMLInputError(f"cannot parse {where} as YAML: {problem}{at}", problem, syntax=True) from None
    except RecursionError:
        raise YAMLInputError(f"{where}: nested too deeply to read (thousands of levels); a config "
                             "has a few", "nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path, what: str = "") -> Any:
    """``load_yaml`` of the file at ``path``; ``what`` names its kind in errors (``recipe``)."""
    path = Path(path)
    where = f"{what} {path}".strip()
    with open(path, "rb") as f:  # at most the bound and a byte: a huge file (or /dev/zero) is not read
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        size = path.stat().st_size
        raise _too_large(where, size if size > MAX_BYTES else None)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise YAMLInputError(f"{where} is not UTF-8 text (a binary or damaged file); it must be "
                             "YAML", "not UTF-8") from None
    return load_yaml(text, where)


def _too_large(where: str, size: int | None) -> YAMLInputError:
    shown = f"{size:,} bytes" if size is not None else "a stream"
    return YAMLInputError(
        f"{where} is {shown}, over the {MAX_BYTES // 1024} KiB minihf reads as YAML (a recipe or profile "
        "is a few KB; parsing one this large would take minutes); is it the right file? Keep data "
        "in data files (data.train_files) and a recipe to its keys", "too large")
