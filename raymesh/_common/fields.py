"""Field checks for configs: every user mistake is a ValueError that reads
`field=value: fix`, naming the field, the value given and what to give instead.

    raise bad("port", 70000, "give a TCP port 0..65535")
    # ValueError: port=70000: give a TCP port 0..65535

`check_int` and `check_seconds` are the checks most fields need; bools are refused where a
number is asked for (True is an int to Python, never a count to a user).
"""

from __future__ import annotations

from typing import Any

__all__ = ["bad", "brief", "check_int", "check_seconds", "is_int"]


def bad(field: str, value: Any, fix: str) -> ValueError:
    """`ValueError("field=value: fix")`, to raise."""
    return ValueError(f"{field}={value!r}: {fix}")


def brief(value: Any, limit: int = 60) -> Any:
    """`value`, or a description of it when its repr is long (a value that goes into `bad`'s
    message: a list of 500 prompts, a hostile manifest's table)."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 16 else ""
    if text and len(text) <= limit:
        return value
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}: {text[:limit]}...>"


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(field: str, value: Any, minimum: int | None = None) -> None:
    """ValueError unless `value` is an integer (not a bool) >= `minimum` (when given)."""
    if not is_int(value) or (minimum is not None and value < minimum):
        raise bad(field, value, "give an integer" + ("" if minimum is None else f" >= {minimum}"))


def check_seconds(field: str, value: Any, *, zero: bool = False) -> None:
    """ValueError unless `value` is a number of seconds > 0 (>= 0 with `zero`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (value >= 0 if zero else value > 0):
        raise bad(field, value, f"give a number of seconds {'>= 0' if zero else '> 0'}")
