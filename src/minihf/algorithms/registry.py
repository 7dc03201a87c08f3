"""Name -> function tables (verl's ``register_adv_est`` / ``register_policy_loss`` pattern).

A registry is a plain dict owned by the module that fills it (``ADV_ESTIMATORS``,
``POLICY_LOSSES``); these two helpers only add the checks and the error messages, so a
recipe can name its estimator or loss in config and a user can register their own. A name
may also be a code reference, ``path/to/file.py:function`` (``minihf.utils.imports``): the
file is imported in this process and the function returned, registered or not.
"""

from __future__ import annotations

from typing import Callable

from minihf.config import suggest


def register_in(table: dict[str, Callable], name: str, what: str) -> Callable[[Callable], Callable]:
    """A decorator that adds a function to ``table`` under ``name``.

    Registering a second, different function under a taken name is an error (it would
    silently change what a recipe runs); registering the same function again is a no-op.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        old = table.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"{what} {name!r} is already registered "
                             f"({getattr(old, '__qualname__', old)!s}); pick another name")
        table[name] = fn
        return fn
    return decorator


def lookup(table: dict[str, Callable], name: str, what: str, register_name: str) -> Callable:
    """``table[name]`` (or the function a ``file.py:name`` reference names), else a
    ValueError naming the known entries and the closest one."""
    from minihf.utils.imports import is_code_ref, load_ref

    if is_code_ref(name):
        try:
            return load_ref(name, what)
        except (FileNotFoundError, AttributeError, TypeError) as e:  # a bad value, said as one
            raise ValueError(str(e)) from None
    fn = table.get(name)
    if fn is None:
        raise ValueError(f"unknown {what} {name!r}; {suggest(str(name), list(table))}"
                         f"choose one of {sorted(table)}, add yours with @{register_name}(name), or "
                         "name a function in a file: path/to/file.py:function")
    return fn
