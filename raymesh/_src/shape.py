"""Named-axis shapes: extents, points, and the slicing algebra of meshes.

Pure Python, no Ray. A `Shape` is a view of a set of global ranks laid out row-major over named
axes (`{"hosts": 2, "procs": 4}`). Slicing, flattening and renaming make new views of the same
ranks; they never copy or reorder the underlying processes.

Conventions (the same as Monarch's and numpy's):
- an integer index removes its axis (`slice(procs=2)` of `{hosts: 2, procs: 4}` has axes `hosts`);
- a Python `slice` keeps the axis, with its size reduced (steps allowed, negative indices count
  from the end);
- a slice that selects nothing is an error, since an empty mesh cannot receive messages.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Extent", "MeshTrait", "Point", "Shape"]


def _check_labels(labels: tuple[str, ...]) -> None:
    for label in labels:
        if not isinstance(label, str) or not label.isidentifier():
            raise ValueError(f"axis name {label!r} is not a Python identifier; use e.g. 'procs'")
    if len(set(labels)) != len(labels):
        raise ValueError(f"axis names {labels} repeat a name; each axis needs its own name")


@dataclass(frozen=True)
class Extent(Mapping[str, int]):
    """Ordered axis sizes, e.g. `Extent(("hosts", "gpus"), (2, 8))`. A Mapping of axis -> size."""

    labels: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.sizes):
            raise ValueError(f"{len(self.labels)} axis names for {len(self.sizes)} sizes")
        _check_labels(self.labels)
        for label, size in zip(self.labels, self.sizes):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"axis {label!r} has size {size!r}; sizes must be ints >= 1")

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> Extent:
        return cls(tuple(sizes), tuple(sizes.values()))

    @property
    def nelem(self) -> int:
        return math.prod(self.sizes)

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    def point(self, rank: int) -> Point:
        """The point at row-major `rank` of this extent."""
        if not 0 <= rank < self.nelem:
            raise IndexError(f"rank {rank} is outside an extent of {self.nelem} elements")
        coords = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            coords.append(c)
        return Point(tuple(reversed(coords)), self)

    def points(self) -> Iterator[Point]:
        for coords in itertools.product(*(range(s) for s in self.sizes)):
            yield Point(coords, self)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in zip(self.labels, self.sizes))
        return f"Extent({inner})"


@dataclass(frozen=True)
class Point(Mapping[str, int]):
    """Coordinates in an extent. A Mapping of axis -> coordinate, so `mesh.slice(**point)` works.

    `rank` is the row-major index of the point within its extent.
    """

    coords: tuple[int, ...]
    extent: Extent

    @property
    def rank(self) -> int:
        rank = 0
        for c, size in zip(self.coords, self.extent.sizes):
            rank = rank * size + c
        return rank

    def __getitem__(self, label: str) -> int:
        try:
            return self.coords[self.extent.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.extent.labels)

    def __len__(self) -> int:
        return len(self.coords)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in zip(self.extent.labels, self.coords))
        return f"Point({inner})"

    def __str__(self) -> str:
        """Monarch's form: each axis's coordinate over its size, `{'hosts': 0/1, 'gpus': 1/2}`."""
        parts = zip(self.extent.labels, self.coords, self.extent.sizes)
        return "{" + ", ".join(f"{k!r}: {v}/{n}" for k, v, n in parts) + "}"


@dataclass(frozen=True)
class Shape:
    """A row-major layout of global `ranks` over the axes of `extent`.

    `ranks[i]` is the global rank (index into the owning proc mesh) of the i-th element.
    """

    extent: Extent
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.extent.nelem:
            raise ValueError(f"{len(self.ranks)} ranks for {self.extent} ({self.extent.nelem})")

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> Shape:
        extent = Extent.of(sizes)
        return cls(extent, tuple(range(extent.nelem)))

    @property
    def labels(self) -> tuple[str, ...]:
        return self.extent.labels

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.extent.labels, self.extent.sizes))

    def size(self, axis: str | None = None) -> int:
        """The size of `axis`, or the number of elements when no axis is given."""
        if axis is None:
            return len(self.ranks)
        self._check_axis(axis)
        return self.extent[axis]

    def __len__(self) -> int:
        return len(self.ranks)

    def _check_axis(self, axis: str) -> None:
        if axis not in self.extent.labels:
            raise ValueError(
                f"unknown axis {axis!r}; this mesh's axes are {list(self.extent.labels)}"
            )

    def slice(self, **axes: int | slice) -> Shape:
        """Select along named axes: an int removes the axis, a slice keeps it."""
        for axis in axes:
            self._check_axis(axis)
        per_axis: list[range] = []
        labels: list[str] = []
        for label, size in zip(self.extent.labels, self.extent.sizes):
            sel = axes.get(label)
            if sel is None:
                per_axis.append(range(size))
                labels.append(label)
            elif isinstance(sel, slice):
                picked = range(size)[sel]
                if len(picked) == 0:
                    raise ValueError(
                        f"slice {label}={_fmt_slice(sel)} selects nothing from axis {label!r} "
                        f"of size {size}; pick indices in 0..{size - 1}"
                    )
                per_axis.append(picked)
                labels.append(label)
            elif isinstance(sel, int) and not isinstance(sel, bool):
                if not -size <= sel < size:
                    raise ValueError(
                        f"index {label}={sel} is out of range for axis {label!r} of size {size}; "
                        f"use 0..{size - 1}"
                    )
                per_axis.append(range(sel % size, sel % size + 1))
            else:
                raise TypeError(
                    f"{label}={sel!r}: slice axes with an int or a slice (e.g. {label}=0 or "
                    f"{label}=slice(0, 2)), not {type(sel).__name__}"
                )
        strides = _strides(self.extent.sizes)
        ranks = tuple(
            self.ranks[sum(c * s for c, s in zip(coords, strides))]
            for coords in itertools.product(*per_axis)
        )
        kept_sizes = tuple(
            len(r)
            for label, r in zip(self.extent.labels, per_axis)
            if not (isinstance(axes.get(label), int) and not isinstance(axes.get(label), bool))
        )
        return Shape(Extent(tuple(labels), kept_sizes), ranks)

    def flatten(self, name: str) -> Shape:
        """One axis called `name` over all elements, in row-major order."""
        return Shape(Extent((name,), (len(self.ranks),)), self.ranks)

    def rename(self, **names: str) -> Shape:
        """Rename axes: `rename(procs="gpus")`."""
        for old in names:
            self._check_axis(old)
        labels = tuple(names.get(label, label) for label in self.extent.labels)
        return Shape(Extent(labels, self.extent.sizes), self.ranks)

    def points(self) -> Iterator[tuple[Point, int]]:
        """(point within this shape, global rank) for every element, row-major."""
        return zip(self.extent.points(), self.ranks)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in zip(self.extent.labels, self.extent.sizes))
        return f"Shape({inner})"


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def _fmt_slice(s: slice) -> str:
    parts = ["" if s.start is None else str(s.start), "" if s.stop is None else str(s.stop)]
    if s.step is not None:
        parts.append(str(s.step))
    return ":".join(parts)


class MeshTrait:
    """Shape operations shared by every mesh (hosts, procs, actors, values): a subclass has a
    `_shape` and makes a view of itself over another shape with `_new_with_shape`."""

    _shape: Shape

    def _new_with_shape(self, shape: Shape) -> Self:
        raise NotImplementedError

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size."""
        return self._shape.sizes

    @property
    def extent(self) -> Extent:
        """The axes and their sizes (Monarch's `mesh.extent`: `{'hosts': 2, 'gpus': 8}`)."""
        return self._shape.extent

    @property
    def _labels(self) -> tuple[str, ...]:
        """The axis names, in order. Monarch's own docs examples read this private name
        (`dict.fromkeys(mesh._labels, 0)` in its SPMD example), so raymesh answers to it."""
        return self._shape.extent.labels

    def size(self, axis: str | None = None) -> int:
        """The size of `axis`, or the number of elements when no axis is given."""
        return self._shape.size(axis)

    def __len__(self) -> int:
        return len(self._shape)

    def slice(self, **axes: int | slice) -> Self:
        """A view of part of the mesh: an int removes its axis, a slice keeps it."""
        return self._new_with_shape(self._shape.slice(**axes))

    def flatten(self, name: str) -> Self:
        """A view with one axis called `name` over all elements, row-major."""
        return self._new_with_shape(self._shape.flatten(name))

    def rename(self, **names: str) -> Self:
        """A view with axes renamed: `rename(procs="gpus")`."""
        return self._new_with_shape(self._shape.rename(**names))
