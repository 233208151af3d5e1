"""Sources: where a pipeline's samples come from, each read by index.

A source is map-style: `len(source)` samples, and `source.read(indices)` returns the samples at
those indices, in that order. Indexed reading is what keeps the training data order exact: the
sample order is a function of (seed, step) alone (`raymesh.data.order`), so any process can
read any step's samples, and a batch redone elsewhere is the same batch.

- `from_dataset(ds)`: a map-style dataset (`__len__`, `__getitem__`), torch's or any.
- `from_files(pattern)`: Parquet files (one sample per row, a dict of column values, read with
  pyarrow) or image files (an `(image, label)` pair, decoded with Pillow; the label is the index
  of the file's folder among the sorted folders, as in torchvision's ImageFolder).
- `from_ray(ds)`: a `ray.data.Dataset`. Ray Data's streaming engine runs its transforms once
  (`materialize`), and its blocks stay in Ray's object store; a sample is a row, a dict.

Every source is checked where it is made, in the controller: a glob that matches nothing, a
file that does not open or a dataset without a length is a ValueError before any proc starts.
Sources are pickled to the preprocessing procs, so they carry paths and sizes, not open files
(each process opens what it reads, and keeps a few decoded row groups or blocks: `_CACHE`).
"""

from __future__ import annotations

import bisect
import glob
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Source", "batch_reader", "from_dataset", "from_files", "from_ray"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_CACHE = 8  # decoded row groups (Parquet) or blocks (Ray Data) each process keeps


@runtime_checkable
class Source(Protocol):
    """What a pipeline reads: `len(source)` samples, read by index."""

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> list[Any]:
        """The samples at `indices`, in that order."""
        ...

    def describe(self) -> str:
        """A short name for messages, e.g. "parquet files shards/*.parquet (3 files)"."""
        ...


class _Lru:
    """A few decoded pieces (row groups, blocks), the least recently used dropped first."""

    def __init__(self, size: int = _CACHE) -> None:
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = load()
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


class _Pieces:
    """Samples stored in consecutive pieces (files' row groups, blocks): the piece of a global
    index and its offset there, and reading indices piece by piece."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.starts: list[int] = []
        total = 0
        for n in sizes:
            self.starts.append(total)
            total += n
        self.total = total

    def locate(self, index: int) -> tuple[int, int]:
        piece = bisect.bisect_right(self.starts, index) - 1
        return piece, index - self.starts[piece]

    def read(self, indices: Sequence[int], take: Callable[[int, list[int]], list[Any]]) -> list:
        """`take(piece, offsets)` once per piece that the indices touch; samples in order."""
        wanted: dict[int, list[tuple[int, int]]] = {}
        for position, index in enumerate(indices):
            if not 0 <= index < self.total:
                raise IndexError(f"sample index {index} out of range [0, {self.total})")
            piece, offset = self.locate(index)
            wanted.setdefault(piece, []).append((position, offset))
        out: list[Any] = [None] * len(indices)
        for piece, pairs in wanted.items():
            for (position, _), sample in zip(pairs, take(piece, [o for _, o in pairs])):
                out[position] = sample
        return out


class MapSource:
    """A map-style dataset (`__len__`, `__getitem__`)."""

    def __init__(self, dataset: Any) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"source={type(dataset).__name__}: not a map-style dataset (it needs __len__ "
                "and __getitem__); wrap an iterable in a list, or use data.from_files"
            )
        if len(dataset) < 1:
            raise ValueError(f"source={type(dataset).__name__}: the dataset is empty")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: Sequence[int]) -> list[Any]:
        return _items(self.dataset, indices)

    def describe(self) -> str:
        return f"dataset {type(self.dataset).__name__} ({len(self)} samples)"


def _items(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """`[dataset[i] for i in indices]`, through the dataset's own `__getitems__` when it has
    one (torch's batched-fetch protocol, which its DataLoader uses too)."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(list(indices)))
    return [dataset[i] for i in indices]


def batch_reader(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> Callable:
    """How a trainer reads a batch of a map-style `dataset`: `reader(indices)` is
    `collate_fn([dataset[i] for i in indices])` (torch's `default_collate` when None), through
    `__getitems__` when the dataset has it. A `TensorDataset` under the default collate is read
    with one indexing of each tensor: the same batch (a list of stacked tensors) in one step
    instead of one `__getitem__` per sample."""
    import torch
    from torch.utils.data import TensorDataset, default_collate

    if collate_fn is None and type(dataset) is TensorDataset:
        tensors = dataset.tensors

        def by_index(indices: Sequence[int]) -> Any:
            index = torch.as_tensor(indices, dtype=torch.long)
            return [t[index] for t in tensors]

        return by_index
    collate = collate_fn or default_collate
    return lambda indices: collate(_items(dataset, indices))


class ParquetSource:
    """Rows of Parquet files, in file order, each a dict of its column values (pyarrow)."""

    def __init__(self, paths: Sequence[str], pattern: str, columns: Sequence[str] | None) -> None:
        import pyarrow.parquet as pq

        self.paths = list(paths)
        self.pattern = pattern
        self.columns = list(columns) if columns is not None else None
        groups: list[tuple[int, int]] = []  # (file, row group) of each piece
        sizes: list[int] = []
        for f, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:
                raise ValueError(
                    f"source={pattern!r}: {path} is not a readable Parquet file "
                    f"({type(e).__name__}: {e}); remove it or fix the pattern"
                ) from None
            for g in range(meta.num_row_groups):
                groups.append((f, g))
                sizes.append(meta.row_group(g).num_rows)
        self.groups = groups
        self.pieces = _Pieces(sizes)
        if self.pieces.total < 1:
            raise ValueError(f"source={pattern!r}: the {len(paths)} Parquet file(s) have no rows")
        self._cache: _Lru | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}  # each process decodes its own

    def __len__(self) -> int:
        return self.pieces.total

    def read(self, indices: Sequence[int]) -> list[Any]:
        import pyarrow.parquet as pq

        cache = self._cache = self._cache or _Lru()

        def take(piece: int, offsets: list[int]) -> list[Any]:
            f, g = self.groups[piece]
            table = cache.get(
                piece, lambda: pq.ParquetFile(self.paths[f]).read_row_group(g, self.columns)
            )
            return table.take(offsets).to_pylist()

        return self.pieces.read(indices, take)

    def describe(self) -> str:
        return f"parquet files {self.pattern} ({len(self.paths)} files, {len(self)} rows)"


class ImageSource:
    """Image files, each an `(image, label)` pair: a Pillow image in RGB, and the index of its
    folder among the sorted folders (torchvision's ImageFolder convention)."""

    def __init__(self, paths: Sequence[str], pattern: str) -> None:
        from PIL import Image

        self.paths = list(paths)
        self.pattern = pattern
        for path in self.paths:  # the header only: a broken file fails here, not mid-run
            try:
                with Image.open(path) as im:
                    im.verify()
            except Exception as e:
                raise ValueError(
                    f"source={pattern!r}: {path} is not a readable image "
                    f"({type(e).__name__}: {e}); remove it or fix the pattern"
                ) from None
        self.classes = sorted({os.path.basename(os.path.dirname(p)) for p in self.paths})
        index = {c: i for i, c in enumerate(self.classes)}
        self.labels = [index[os.path.basename(os.path.dirname(p))] for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, indices: Sequence[int]) -> list[Any]:
        from PIL import Image

        out = []
        for i in indices:
            with Image.open(self.paths[i]) as im:
                out.append((im.convert("RGB"), self.labels[i]))
        return out

    def describe(self) -> str:
        return f"images {self.pattern} ({len(self)} files, {len(self.classes)} classes)"


class RaySource:
    """The rows of a materialized `ray.data.Dataset`, as dicts, in the dataset's order."""

    def __init__(self, dataset: Any) -> None:
        from raymesh.data import _ray_data  # imports Ray Data: only for a Ray dataset

        self.name = type(dataset).__name__
        self.blocks, sizes = _ray_data.materialize(dataset)
        self.pieces = _Pieces(sizes)
        if self.pieces.total < 1:
            raise ValueError(f"source={self.name}: the Ray dataset has no rows")
        self._cache: _Lru | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}

    def __len__(self) -> int:
        return self.pieces.total

    def read(self, indices: Sequence[int]) -> list[Any]:
        from raymesh.data import _ray_data

        cache = self._cache = self._cache or _Lru()

        def take(piece: int, offsets: list[int]) -> list[Any]:
            table = cache.get(piece, lambda: _ray_data.block(self.blocks[piece]))
            return table.take(offsets).to_pylist()

        return self.pieces.read(indices, take)

    def describe(self) -> str:
        return f"ray dataset ({len(self.blocks)} blocks, {len(self)} rows)"


def from_dataset(dataset: Any) -> Source:
    """A map-style dataset as a source: sample i is `dataset[i]`."""
    return MapSource(dataset)


def from_files(pattern: str, *, columns: Sequence[str] | None = None) -> Source:
    """The files matching `pattern` (a glob, `**` for any depth, or a folder: every file under
    it), sorted by path: all Parquet (`columns`: read only these) or all images.

    Raises ValueError, before anything runs, for a pattern that matches no file, a mix of
    kinds, a kind that is neither, or a file that does not open."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"source={pattern!r}: give a glob such as 'shards/*.parquet'")
    where = os.path.join(pattern, "**", "*") if os.path.isdir(pattern) else pattern
    paths = sorted(p for p in glob.glob(where, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ValueError(
            f"source={pattern!r}: no file matches (looked from {os.getcwd()}); check the path, "
            "or use '**' to match files in subfolders"
        )
    kinds = {_kind(p) for p in paths}
    if kinds == {"parquet"}:
        return ParquetSource(paths, pattern, columns)
    if kinds == {"image"}:
        if columns is not None:
            raise ValueError(f"columns={columns!r}: only Parquet sources have columns")
        return ImageSource(paths, pattern)
    others = sorted({os.path.splitext(p)[1] or p for p in paths if _kind(p) == "other"})
    raise ValueError(
        f"source={pattern!r}: matches {len(paths)} files of kinds {sorted(kinds)}"
        + (f" (unknown suffixes {others[:5]})" if others else "")
        + "; a source is all Parquet (.parquet) or all images "
        f"({', '.join(IMAGE_SUFFIXES)}): narrow the pattern"
    )


def _kind(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        return "parquet"
    return "image" if suffix in IMAGE_SUFFIXES else "other"


def from_ray(dataset: Any) -> Source:
    """A `ray.data.Dataset` as a source. Its transforms run now, on Ray Data's engine, and its
    rows stay in Ray's object store for as long as the source lives (the controller holds it)."""
    return RaySource(dataset)


def as_source(value: Any) -> Source:
    """A source from what `Pipeline(source=...)` accepts: a source, a glob, a Ray dataset or a
    map-style dataset."""
    if isinstance(value, str):
        return from_files(value)
    if type(value).__module__.startswith("ray.data"):
        return from_ray(value)
    if isinstance(value, Source):
        return value
    return from_dataset(value)
