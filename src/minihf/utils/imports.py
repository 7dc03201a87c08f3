"""Recipe code named in config: ``path/to/file.py:name`` (a function in a Python file).

Rewards, advantage estimators and policy losses a recipe brings are never pickled into
messages: the config carries the reference, and each process that needs the function
imports the file itself (the driver for rewards and estimators, every actor rank for a
loss). A file is executed once per process, whatever the number of references to it, so
``@register_adv_est`` / ``@register_policy_loss`` decorators inside it run once.

Relative paths in a recipe's YAML are made absolute from the recipe's folder by
``minihf.config.load_config``; relative paths given on the command line are from the
working directory (the same on every rank under ``torchrun``). Loading or showing a
config runs no recipe code: :func:`check_ref` reads the file's syntax tree for the name.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_REF = re.compile(r"(?P<path>.+\.py):(?P<name>[A-Za-z_]\w*)")


def is_code_ref(value) -> bool:
    """Whether ``value`` is a ``file.py:name`` reference."""
    return isinstance(value, str) and _REF.fullmatch(value) is not None


def split_ref(ref: str) -> tuple[str, str]:
    """``"dir/algo.py:my_fn"`` -> ``("dir/algo.py", "my_fn")``."""
    m = _REF.fullmatch(ref)
    if m is None:
        raise ValueError(f"{ref!r} is not a code reference; write it as path/to/file.py:function")
    return m["path"], m["name"]


def import_file(path: str | Path) -> ModuleType:
    """Execute the Python file at ``path`` as a module, once per process (cached by its
    resolved path); errors in the file propagate with its own traceback, except a syntax
    error: a ``ValueError`` naming the file, the line and the text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (relative paths are from {Path.cwd()}, "
                                "or from the recipe folder in a recipe's config.yaml)")
    if path.suffix != ".py":
        raise ImportError(f"cannot import {path}: recipe code must be a .py file")
    resolved = path.resolve()
    key = f"minihf_recipe_{resolved.stem}_{hashlib.blake2b(str(resolved).encode(), digest_size=6).hexdigest()}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before exec: dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # the file cannot run at all: where and what, in one line
        del sys.modules[key]
        line = f": {e.text.strip()}" if e.text else ""
        raise ValueError(f"{path}, line {e.lineno}: {e.msg}{line}; fix the file") from e
    except SystemExit as e:  # would end the job (or an in-process caller) without a word
        del sys.modules[key]
        raise RuntimeError(f"{path} called sys.exit({e.code!r}) while it was imported; recipe code "
                           "must not exit the process (raise an exception instead)") from e
    except BaseException:
        del sys.modules[key]
        raise
    return module


def load_object(path: str | Path, name: str, what: str = "function"):
    """The callable ``name`` defined in the file at ``path``; errors list what the file has."""
    module = import_file(path)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise AttributeError(f"{path} has no {what} {name!r}; callables defined there: {found}")
    obj = getattr(module, name)
    if not callable(obj):
        raise TypeError(f"{name!r} in {path} is a {type(obj).__name__}, not a {what}")
    return obj


def load_ref(ref: str, what: str = "function"):
    """The callable a ``file.py:name`` reference names."""
    path, name = split_ref(ref)
    return load_object(path, name, what)


def _bound_names(body: list[ast.stmt]) -> set[str] | None:
    """Names a module binds at top level: defs, classes, assignments and imports, also inside
    top-level ``if``/``try``/``with`` blocks (an optional import with a fallback); None where a
    star import makes the set unknowable."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                inner = _bound_names(block)
                if inner is None:
                    return None
                names |= inner
    return names


def check_name_or_ref(value: str, lookup: Callable[[str], object], what: str) -> None:
    """``value`` a name ``lookup`` knows (it raises a ValueError listing the registered ones) or
    a ``file.py:name`` reference, checked without running the file (a ValueError too)."""
    if not is_code_ref(value):
        lookup(value)
        return
    try:
        check_ref(value, what)
    except (FileNotFoundError, AttributeError) as e:
        raise ValueError(str(e)) from None


def check_ref(ref: str, what: str = "function") -> None:
    """Check a ``file.py:name`` reference without running the file: it exists, parses, and
    binds ``name`` at top level. Raises what :func:`load_ref` would (FileNotFoundError,
    ValueError for a syntax error, AttributeError for a missing name)."""
    path, name = split_ref(ref)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (relative paths are from {Path.cwd()}, "
                                "or from the recipe folder in a recipe's config.yaml)")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        line = f": {e.text.strip()}" if e.text else ""
        raise ValueError(f"{path}, line {e.lineno}: {e.msg}{line}; fix the file") from None
    names = _bound_names(tree.body)
    if names is not None and name not in names:
        found = sorted(n for n in names if not n.startswith("_"))
        raise AttributeError(f"{path} has no {what} {name!r}; names defined there: {found}")


def ref_required_params(ref: str) -> set[str]:
    """The parameters without a default of the function a ``file.py:name`` reference names,
    read from the file's syntax tree (nothing runs; a name bound otherwise than by ``def``
    gives the empty set: nothing is known of its signature)."""
    check_ref(ref)
    path, name = split_ref(ref)
    tree = ast.parse(Path(path).read_text(), filename=path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            positional = a.posonlyargs + a.args
            required = positional[:len(positional) - len(a.defaults)]
            required += [k for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
            return {arg.arg for arg in required}
    return set()
