"""`ValueMesh`: the replies of a `call`, one value per actor, laid out like the called mesh."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from raymesh._src.shape import MeshTrait, Point, Shape

R = TypeVar("R")

__all__ = ["ValueMesh"]


class ValueMesh(MeshTrait, Generic[R]):
    """Values indexed by points of the mesh that was called. Iterating yields (point, value)."""

    def __init__(self, shape: Shape, values: list[R]) -> None:
        if len(values) != len(shape):
            raise ValueError(f"{len(values)} values for a mesh of {len(shape)}")
        self._shape = shape
        self._values = values

    @property
    def shape(self) -> Shape:
        return self._shape

    def values(self) -> list[R]:
        """The values in row-major order of the mesh."""
        return list(self._values)

    def items(self) -> Iterator[tuple[Point, R]]:
        """(point, value) pairs in row-major order."""
        return zip(self._shape.extent.points(), self._values)

    def item(self, **coords: int) -> R:
        """The value at `coords`, which must name every axis (none for a mesh of one)."""
        labels = self._shape.labels
        if set(coords) != set(labels):
            missing = [a for a in labels if a not in coords]
            extra = [a for a in coords if a not in labels]
            raise KeyError(
                f"item() needs a coordinate for each axis {list(labels)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {extra}" if extra else "")
            )
        sub = self._shape.slice(**coords)
        return self._values[self._shape.ranks.index(sub.ranks[0])]

    def _new_with_shape(self, shape: Shape) -> ValueMesh[R]:
        pos = {r: i for i, r in enumerate(self._shape.ranks)}
        return ValueMesh(shape, [self._values[pos[r]] for r in shape.ranks])

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __repr__(self) -> str:
        return f"ValueMesh({self._shape}, {self._values!r})"
