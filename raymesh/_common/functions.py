"""Functions named in files as "module:function" (a job's build function, a client_fn, a
data transform)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["resolve"]


def resolve(value: Callable[..., Any] | str, what: str = "build") -> Callable[..., Any]:
    """The function itself, from a callable or a "module:function" name; ValueError naming
    `what` (the argument's name), the value and the fix when it cannot be found."""
    if callable(value):
        return value
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"{what}={value!r}: pass a function, or name it as 'module:function'")
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what}={value!r}: cannot import module {module_name!r} ({e}); check the name and "
            "that it is on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what}={value!r}: module {module_name!r} has no function {attr!r}")
    return fn
