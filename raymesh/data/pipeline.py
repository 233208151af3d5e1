"""`Pipeline`: a job's preprocessing, as a keyword-only config, and how one batch is made.

A batch is a pure function of (pipeline, seed, step, indices): the source's samples at
`indices`, each passed through `transform` with every random generator (torch, Python's
`random`, NumPy's global one) seeded by (seed, step, sample index), then collated. So a batch
made by a preprocessing proc, by another one after that proc died, or by the trainer itself is
the same batch, bit for bit, and the caller's own random state is left as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch.utils.data import default_collate

from raymesh._common import Range, bad, check_int, from_table, resolve
from raymesh.data.sources import Source, as_source

__all__ = ["DataError", "Pipeline", "make_batch", "sample_seed"]

logger = logging.getLogger("raymesh")


class DataError(RuntimeError):
    """A sample could not be made: the source, the sample index and the error are in the
    message. Not retried: the same sample fails the same way wherever it is made."""


def _bad(name: str, value: Any, fix: str) -> ValueError:
    return bad(f"data.{name}", value, fix)  # a Pipeline is TrainConfig's `data`


def _function(name: str, value: Any) -> Callable | None:
    """A callable, or "module:function" (a job file's way of naming one)."""
    if value is None:
        return None
    return resolve(value, f"data.{name}")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Preprocessing on a mesh of CPU procs of its own, ahead of the trainers
    (`TrainConfig(data=...)`, `[data]` in a job file).

        Pipeline(
            source=data.from_files("shards/*.parquet"),
            transform=decode_and_augment,  # sample -> sample, seeded by (seed, step, index)
            workers=(1, 8),  # preprocessing procs: start at 1, scale between 1 and 8
            prefetch=8,  # batches each rank has ready or in flight
        )

    Checked on construction; a bad field raises ValueError naming it (as `data.<field>`), the
    value and the fix. A source given as a glob, a Ray dataset or a map-style dataset becomes
    a `Source`; functions may be given as "module:function". Frozen.

    Bounds: each trainer rank holds at most `prefetch` batches made ahead (ready in Ray's
    object store or being made), so the pipeline's object-store use is at most
    ranks x prefetch x (bytes of one rank's batch).
    """

    source: Any  # a Source (data.from_files, from_dataset, from_ray), a glob, or a dataset
    transform: Callable[[Any], Any] | str | None = None  # per sample; None: samples as read
    collate_fn: Callable[[list[Any]], Any] | str | None = None  # default: torch's collate
    # Preprocessing procs: a number, or (min, max) to scale between them from measured trainer
    # wait (starting at min). 0: none, each trainer makes its own batches (no prefetch).
    workers: int | tuple[int, int] = 1
    prefetch: int = 4  # batches each trainer rank has ready or in flight
    on_error: Literal["raise", "skip"] = "raise"  # a failing sample stops the job, or is left out
    cpus_per_worker: float = 1.0  # logical CPUs each preprocessing proc reserves
    scale_interval_s: float = 5.0  # elastic: the least time between two scaling decisions

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", as_source(self.source))
        object.__setattr__(self, "transform", _function("transform", self.transform))
        object.__setattr__(self, "collate_fn", _function("collate_fn", self.collate_fn))
        workers = Range.check("data.workers", self.workers, count_minimum=0)
        object.__setattr__(self, "workers", workers)
        check_int("data.prefetch", self.prefetch, 1)
        if self.on_error not in ("raise", "skip"):
            raise _bad("on_error", self.on_error, "give 'raise' or 'skip'")
        if not isinstance(self.cpus_per_worker, (int, float)) or not self.cpus_per_worker > 0:
            raise _bad("cpus_per_worker", self.cpus_per_worker, "give a number > 0")
        if not isinstance(self.scale_interval_s, (int, float)) or self.scale_interval_s <= 0:
            raise _bad("scale_interval_s", self.scale_interval_s, "give seconds > 0")

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) preprocessing procs."""
        bounds = Range.of(self.workers)
        return bounds.min, bounds.max

    def __len__(self) -> int:
        return len(self.source)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pipeline:
        """From a job file's `[data]` table: `source` a glob, functions as "module:function"."""
        return from_table(cls, data, "data")

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for a checkpoint's manifest (functions by name)."""
        return {
            "source": self.source.describe(),
            "transform": _name(self.transform),
            "collate_fn": _name(self.collate_fn),
            "workers": list(self.bounds),
            "prefetch": self.prefetch,
            "on_error": self.on_error,
        }


def _name(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of sample `index`'s transform at `step` (0-based): stable across processes."""
    digest = hashlib.blake2b(f"raymesh.data:{seed}:{step}:{index}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little")  # < 2**32, what NumPy's seed accepts


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Every global random generator seeded with `seed` inside, restored after."""
    np = sys.modules.get("numpy")
    saved = random.getstate(), np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(saved[0])
            if np is not None:
                np.random.set_state(saved[1])


_said: set[str] = set()  # skipped samples already logged (once each, per process)


def make_batch(pipe: Pipeline, seed: int, step: int, indices: Sequence[int]) -> Any:
    """The batch of `indices` at `step` (0-based), collated; see the module docstring.

    Raises DataError naming the source and the sample when reading or transforming fails
    (with `on_error="skip"`, a sample whose transform fails is left out of the batch, logged
    once; a batch left with no sample raises)."""
    source: Source = pipe.source
    try:
        samples = source.read(indices)
    except Exception as e:
        raise DataError(
            f"{source.describe()}: reading samples {_some(indices)} failed: {type(e).__name__}: {e}"
        ) from None
    transform = cast(Callable[[Any], Any] | None, pipe.transform)  # a function by now
    collate = cast(Callable[[list[Any]], Any], pipe.collate_fn or default_collate)
    out = []
    for index, sample in zip(indices, samples):
        if transform is not None:
            try:
                with _seeded(sample_seed(seed, step, index)):
                    sample = transform(sample)
            except Exception as e:
                what = (
                    f"{source.describe()}: sample {index}: transform raised {type(e).__name__}: {e}"
                )
                if pipe.on_error == "raise":
                    raise DataError(what) from None
                if what not in _said:
                    _said.add(what)
                    logger.warning("raymesh.data: %s (skipped: on_error='skip')", what)
                continue
        out.append(sample)
    if not out:
        raise DataError(f"{source.describe()}: every sample of {_some(indices)} was skipped")
    return collate(out)


def _some(indices: Sequence[int]) -> str:
    shown = ", ".join(map(str, indices[:5]))
    return f"[{shown}{', ...' if len(indices) > 5 else ''}]"
