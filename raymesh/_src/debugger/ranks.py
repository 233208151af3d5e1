"""`ranks(...)`: which ranks of an actor mesh a debugger command goes to, in Monarch's syntax.

    ranks(3)                     one rank
    ranks(1,4,6)                 a list
    ranks(2:7:2), ranks(:4)      a range, as Python slices (an open stop runs to the mesh's end)
    ranks(hosts=0, gpus=1:3)     by coordinates: each axis a coordinate, a range or a tuple
                                 `(0,2)`; the ranks whose point matches every axis given

Every rank (or coordinate) the selection names must exist in the mesh: `ranks(7)` on a mesh of
2 is a `ValueError` saying so, not an empty selection (Monarch's skips it silently).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["RankSelection", "parse_ranks", "select"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class RankSelection:
    """A parsed `ranks(...)`: `ranks` (ints or one range) or `axes` (axis -> ints or range).
    `text` is what the user wrote, for messages."""

    text: str
    ranks: tuple[int, ...] | range | None = None
    axes: tuple[tuple[str, tuple[int, ...] | range], ...] = ()


def parse_ranks(spec: str | int | Iterable[int] | range) -> RankSelection:
    """Parse `ranks(...)` (or what goes inside it: `0:2`, `1,3`, `2`), or take an int, a range
    or an iterable of ints as they are. ValueError naming the text and the forms it takes."""
    if isinstance(spec, bool):
        raise ValueError(f"ranks={spec!r}: give a rank, a list of ranks or ranks(...)")
    if isinstance(spec, int):
        return RankSelection(f"ranks({spec})", (spec,))
    if isinstance(spec, range):
        return RankSelection(f"ranks({spec.start}:{spec.stop}:{spec.step})", spec)
    if not isinstance(spec, str):
        values = tuple(spec)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"ranks={values!r}: every rank must be an int")
        return RankSelection(f"ranks({','.join(map(str, values))})", values)
    text = spec.strip()
    inner = text[len("ranks(") : -1] if text.startswith("ranks(") and text.endswith(")") else text
    shown = f"ranks({inner})"
    try:
        if "=" in inner:
            return RankSelection(shown, axes=_parse_axes(inner))
        return RankSelection(shown, _parse_values(inner))
    except ValueError as e:
        raise ValueError(
            f"{shown}: {e}; write ranks(3), ranks(1,4,6), ranks(start:stop:step) or "
            "ranks(axis=0, other=1:3)"
        ) from None


def _parse_values(text: str) -> tuple[int, ...] | range:
    text = text.strip()
    if not text:
        raise ValueError("no ranks given")
    if ":" in text:
        parts = [p.strip() for p in text.split(":")]
        if len(parts) > 3:
            raise ValueError(f"{text!r} has more than start:stop:step")
        start = _int(parts[0]) if parts[0] else 0
        stop = _int(parts[1]) if parts[1] else sys.maxsize  # open: to the mesh's end
        step = _int(parts[2]) if len(parts) == 3 and parts[2] else 1
        if start < 0 or stop < 0 or step < 1:
            raise ValueError(f"{text!r}: start and stop must be >= 0 and step >= 1")
        return range(start, stop, step)
    text = text.removeprefix("(").removesuffix(")")
    values = tuple(_int(p) for p in text.split(","))
    if any(v < 0 for v in values):
        raise ValueError("ranks are >= 0")
    return values


def _parse_axes(text: str) -> tuple[tuple[str, tuple[int, ...] | range], ...]:
    # Split on the commas outside parentheses: `hosts=(0,2), gpus=1`.
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    out = []
    for item in items:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not _NAME.match(name):
            raise ValueError(f"{item.strip()!r} is not axis=coordinates")
        out.append((name, _parse_values(value)))
    return tuple(out)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def select(selection: RankSelection, extent: Mapping[str, int]) -> list[int]:
    """The ranks of a mesh of `extent` (axis -> size, row-major) that `selection` names, in
    order. ValueError when it names a rank, an axis or a coordinate the mesh does not have."""
    size = math.prod(extent.values())
    if selection.axes:
        return _select_axes(selection, extent)
    ranks = selection.ranks
    if isinstance(ranks, range) and ranks.stop == sys.maxsize:
        ranks = range(ranks.start, max(size, ranks.start + 1), ranks.step)
    assert ranks is not None
    missing = [r for r in ranks if r >= size]
    if missing:
        raise ValueError(
            f"{selection.text}: rank {missing[0]} does not exist; the mesh has {size} "
            f"rank{'s' if size != 1 else ''} (0..{size - 1})"
        )
    return sorted(set(ranks))


def _select_axes(selection: RankSelection, extent: Mapping[str, int]) -> list[int]:
    labels = list(extent)
    wanted: dict[str, set[int]] = {}
    for axis, values in selection.axes:
        if axis not in extent:
            raise ValueError(f"{selection.text}: the mesh has no axis {axis!r} (axes: {labels})")
        n = extent[axis]
        if isinstance(values, range) and values.stop == sys.maxsize:
            values = range(values.start, max(n, values.start + 1), values.step)
        bad = [v for v in values if v >= n]
        if bad:
            raise ValueError(
                f"{selection.text}: {axis}={bad[0]} does not exist; axis {axis!r} has size {n}"
            )
        wanted[axis] = set(values)
    out = []
    for rank in range(math.prod(extent.values())):
        coords, rest = {}, rank
        for label in reversed(labels):
            rest, coords[label] = divmod(rest, extent[label])
        if all(coords[a] in vs for a, vs in wanted.items()):
            out.append(rank)
    return out
