"""What a request's input may be, checked before any tensor is made: its shape and kinds
(`check_input`) and its range in the model's dtype (`check_range`: a float32 model turns
3.5e38 into inf). Pure Python over parsed JSON; the front answers 400 naming the place."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LARGEST", "check_input", "check_range"]

# The largest magnitude each input dtype holds: a JSON number past it would become inf (a
# float32 model turns 3.5e38 into inf) or fail to convert (an int64 past 2**63).
LARGEST = {
    "float32": float(torch.finfo(torch.float32).max),
    "float64": float(torch.finfo(torch.float64).max),
    "int64": 2**63 - 1,
}


def check_input(x: Any, shape: tuple[int, ...] | None, integer: bool) -> str | None:
    """Why `x` (parsed JSON) is not one input of `shape`, naming the place (None: it is).
    Pure Python over the parsed lists: no tensor is made for a request the model would reject."""
    if shape is None:
        return None if isinstance(x, (list, int, float)) else "x: give a number or a list"
    return _check(x, shape, "x", integer, shape)


def _check(
    x: Any, shape: tuple[int, ...], where: str, integer: bool, full: tuple[int, ...]
) -> str | None:
    if not shape:
        ok = isinstance(x, int) if integer else isinstance(x, (int, float))
        if not ok or isinstance(x, bool):
            return f"{where}: expected {'an integer' if integer else 'a number'}, got {x!r:.40}"
        return None
    if not isinstance(x, list):
        return f"{where}: expected a list of {shape[0]}, got {type(x).__name__}"
    if len(x) != shape[0]:
        return f"{where}: expected {shape[0]} items (input shape {list(full)}), got {len(x)}"
    rest = shape[1:]
    if not rest:  # the innermost list: checked in one pass
        kinds = (int,) if integer else (int, float)
        for i, v in enumerate(x):
            if type(v) not in kinds:
                return _check(v, (), f"{where}[{i}]", integer, full)
        return None
    for i, item in enumerate(x):
        why = _check(item, rest, f"{where}[{i}]", integer, full)
        if why is not None:
            return why
    return None


def check_range(x: Any, dtype: str, where: str = "x") -> str | None:
    """Why a number in `x` (parsed JSON, already of the right shape and kinds) does not fit
    `dtype` ("float32", "float64" or "int64"), naming its place (None: every number fits).
    Each list of numbers is checked by its max and min, at C speed."""
    top = LARGEST[dtype]
    low = -top - 1 if dtype == "int64" else -top
    stack: list[tuple[Any, str]] = [(x, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, list):
            if not v:
                continue
            if not isinstance(v[0], list):
                try:
                    if low <= min(v) and max(v) <= top:
                        continue
                except TypeError:  # numbers and lists mixed: item by item
                    pass
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
        elif isinstance(v, (int, float)) and not low <= v <= top:
            shown = f"{v:.3g}" if isinstance(v, float) else f"an integer of {len(str(v))} digits"
            return (
                f"{at}: {shown} is out of range for the model's {dtype} inputs (largest "
                f"magnitude {top:.4g}; a number past it would become infinity or fail to convert)"
            )
    return None
