"""The two ends of a pipeline: `Preprocessor`, the actor on each preprocessing proc that makes
batches, and `Feed`, the consumer's side (a trainer rank, or a script iterating batches).

A feed asks for batches by (step, indices) before it needs them, up to `Pipeline.prefetch`
ahead, each from the worker with the fewest of its requests in flight. Finished batches travel
through Ray's object store (tensors zero-copy). A worker that dies takes only its unfinished
batches with it: the feed asks another worker for each, or makes it itself when none is left,
and because a batch is a pure function of (seed, step, indices) the redone batch is the same.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raymesh.actor import Actor, ActorError, endpoint
from raymesh.data.pipeline import DataError, Pipeline, make_batch

__all__ = ["Feed", "Preprocessor", "WorkerStats"]

logger = logging.getLogger("raymesh")

# The longest a feed waits for one batch from a worker before it makes the batch itself (a
# worker that hangs must not hang training; a slow transform is far below this).
BATCH_TIMEOUT_S = 300.0

Key = tuple[int, tuple[int, ...]]  # (step, indices)


@dataclass(frozen=True)
class WorkerStats:
    """A preprocessing proc's work since it started."""

    batches: int
    samples: int
    busy_s: float  # seconds spent making batches
    up_s: float  # seconds since it started


class Preprocessor(Actor):
    """Makes batches on a preprocessing proc (one per proc).

    nice: the consumer's niceness, when the consumer is not a Ray worker (a script iterating
    `data.batches`). Ray starts its workers at niceness 15, below such a consumer, which then
    takes the CPU that the batches it waits for need; the proc moves to the consumer's
    niceness where the OS lets it (lowering niceness needs CAP_SYS_NICE), else says so once."""

    def __init__(self, pipe: Pipeline, seed: int, nice: int | None = None) -> None:
        self.pipe, self.seed = pipe, seed
        if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) > nice:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            except OSError:
                logger.warning(
                    "raymesh.data: preprocessing procs run at niceness %d, below their "
                    "consumer's %d, and may not catch up with it; start Ray with "
                    "RAY_worker_niceness=%d to give them the same share",
                    os.getpriority(os.PRIO_PROCESS, 0),
                    nice,
                    nice,
                )
        self.started = time.monotonic()
        self.batches = self.samples = 0
        self.busy_s = 0.0

    @endpoint
    def batch(self, step: int, indices: list[int]) -> Any:
        t0 = time.perf_counter()
        out = make_batch(self.pipe, self.seed, step, indices)
        self.busy_s += time.perf_counter() - t0
        self.batches += 1
        self.samples += len(indices)
        return out

    @endpoint
    def stats(self) -> WorkerStats:
        return WorkerStats(self.batches, self.samples, self.busy_s, time.monotonic() - self.started)


@dataclass
class _Request:
    future: Any
    worker: Any  # the one-actor mesh making it


class Feed:
    """Batches by (step, indices), made ahead by the preprocessing workers.

    Guarantees: `get(step, indices)` returns `make_batch(pipe, seed, step, indices)`, whoever
    made it; at most `pipe.prefetch` batches are requested ahead and not yet taken; it never
    waits more than BATCH_TIMEOUT_S on a worker. DataError (a sample that fails) is raised,
    not retried. Not thread-safe: one consumer thread.
    """

    def __init__(self, pipe: Pipeline, seed: int) -> None:
        self.pipe, self.seed = pipe, seed
        self.workers: list[Any] = []  # one-actor meshes of Preprocessor
        self.generation = -1
        self.gone: set[int] = set()  # id() of workers whose calls failed (dead, or stopped)
        self.pending: OrderedDict[Key, _Request] = OrderedDict()
        self.wait_s = 0.0  # seconds get() blocked, since the last take_wait()

    def use(self, generation: int, workers: Sequence[Any]) -> None:
        """Switch to this set of workers (requests in flight on the old ones still count: a
        worker that was stopped fails them, and they are made again)."""
        if generation != self.generation:
            self.generation, self.workers, self.gone = generation, list(workers), set()

    def ahead(self, keys: Iterable[Key]) -> None:
        """Request the batches of `keys` (the next ones the consumer will take, in order) that
        are not requested yet, up to `prefetch` in all; forget requests not among them."""
        keys = list(keys)[: self.pipe.prefetch]
        wanted = set(keys)
        for stale in [k for k in self.pending if k not in wanted]:
            del self.pending[stale]
        for key in keys:
            if key not in self.pending and not self._submit(key):
                break

    def get(self, step: int, indices: Sequence[int]) -> Any:
        key: Key = (step, tuple(indices))
        t0 = time.perf_counter()
        request = self.pending.pop(key, None)
        if request is None and self._submit(key):
            request = self.pending.pop(key)
        try:
            return self._result(key, request)
        finally:
            self.wait_s += time.perf_counter() - t0

    def take_wait(self) -> float:
        """Seconds spent waiting for batches since the last call."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def _submit(self, key: Key) -> bool:
        alive = [w for w in self.workers if id(w) not in self.gone]
        if not alive:
            return False
        load = {id(w): 0 for w in alive}
        for r in self.pending.values():
            if id(r.worker) in load and not r.future.done():
                load[id(r.worker)] += 1
        worker = min(alive, key=lambda w: load[id(w)])
        step, indices = key
        self.pending[key] = _Request(worker.batch.call_one(step, list(indices)), worker)
        return True

    def _result(self, key: Key, request: _Request | None) -> Any:
        while request is not None:
            try:
                return request.future.get(timeout=BATCH_TIMEOUT_S)
            except ActorError as e:  # the transform or the source raised there
                raise DataError(e.remote_message) from None
            except Exception as e:  # SupervisionError (it died, or was stopped), TimeoutError
                self.gone.add(id(request.worker))
                logger.info(  # the pool logs the death itself, once
                    "raymesh.data: a preprocessing worker is lost (%s); its batch of step %d "
                    "is made again elsewhere",
                    str(e).splitlines()[0][:200],
                    key[0] + 1,
                )
            request = self.pending.pop(key) if self._submit(key) else None
        return make_batch(self.pipe, self.seed, *key)  # no worker left: make it here
