"""`batches`: a pipeline's batches in a script of one's own (outside raymesh.train), in the
training data order, made ahead on the pipeline's preprocessing procs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from raymesh._common import is_int
from raymesh.data import order
from raymesh.data.feed import Feed
from raymesh.data.pipeline import Pipeline
from raymesh.data.workers import PipelineReport, Workers

__all__ = ["Batches", "batches"]


class Batches:
    """The batches of steps 0 .. steps-1 (see `batches`); `report()` says what the pipeline
    did so far (its workers, scaling decisions, the consumer's wait)."""

    def __init__(self, pipe: Pipeline, *, batch_size: int, steps: int, seed: int = 0) -> None:
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: give an integer >= 1")
        if not is_int(steps) or steps < 0:
            raise ValueError(f"steps={steps!r}: give an integer >= 0")
        self.pipe, self.batch_size, self.steps, self.seed = pipe, batch_size, steps, seed
        # The workers run at this process's niceness (a script's: Ray's workers run lower).
        self.workers = Workers(pipe, seed, nice=os.getpriority(os.PRIO_PROCESS, 0))

    def __iter__(self) -> Iterator[Any]:
        pipe, seed, steps = self.pipe, self.seed, self.steps
        n = len(pipe)
        feed = Feed(pipe, seed)

        def key(step: int) -> tuple[int, tuple[int, ...]]:
            return step, tuple(order.global_batch(seed, step, self.batch_size, n))

        try:
            self.workers.start()
            for step in range(steps):
                feed.use(self.workers.generation, self.workers.handles())
                feed.ahead(key(s) for s in range(step, min(step + pipe.prefetch, steps)))
                t0 = time.perf_counter()
                yield feed.get(*key(step))
                self.workers.observe(feed.take_wait(), time.perf_counter() - t0)
                self.workers.tick()
        finally:
            self.workers.stop()

    def report(self) -> PipelineReport:
        return self.workers.report()


def batches(pipe: Pipeline, *, batch_size: int, steps: int, seed: int = 0) -> Batches:
    """The batches of steps 0 .. steps-1: batch s is `make_batch(pipe, seed, s,
    order.global_batch(seed, s, batch_size, len(pipe)))`, the batches a one-rank `train.fit`
    with this pipeline trains on. The preprocessing procs start when iteration starts and stop
    when it ends (or the iterator is closed); until the first is up, batches are made here."""
    return Batches(pipe, batch_size=batch_size, steps=steps, seed=seed)
