"""`WarmRanks`: trainer procs kept up between training jobs, for jobs that run one after another.

A job started with `fit(..., warm=ranks)` takes its ranks from here first, and when it ends
cleanly (it finished, or its progress callback stopped it) gives its live ranks back instead of
stopping them. The next job builds its model in a process that is already up, has torch and
raymesh imported and gloo loaded: starting a proc costs seconds, taking a warm one milliseconds.
raymesh.tune hands procs from trial to trial this way.

Guarantees:
- A rank is given back only at a step boundary, out of every collective: its process group is
  destroyed and its job's model, optimizer and data dropped (its trainer actor stopped). A job
  that failed (or whose ranks did not answer) stops its procs instead: a proc that may be stuck
  or half through a step never serves another job.
- A job takes only ranks of its own shape (CPUs per worker, and whether it wants a GPU); a rank
  that died while it waited is dropped, its resources released.
- Held ranks keep their resources (their placement groups): `close()` stops them all. Several
  jobs may share one `WarmRanks` at once (it is thread-safe).
"""

from __future__ import annotations

import logging
import threading

from raymesh.train.control.member import Rank

logger = logging.getLogger("raymesh")

__all__ = ["WarmRanks"]

Shape = tuple[float, bool]  # (CPUs per worker, GPU)


class WarmRanks:
    """Trainer procs kept between jobs (see the module docstring)."""

    def __init__(self) -> None:
        self._idle: list[tuple[Shape, Rank]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.served = 0  # ranks handed to a job that did not have to start a proc for them

    def take(self, n: int, shape: Shape) -> list[Rank]:
        """Up to `n` live idle ranks of `shape` (dead ones are stopped and dropped)."""
        out: list[Rank] = []
        dead: list[Rank] = []
        with self._lock:
            keep: list[tuple[Shape, Rank]] = []
            for s, rank in self._idle:
                if s != shape or len(out) == n:
                    keep.append((s, rank))
                else:
                    (out if rank.alive() else dead).append(rank)
            self._idle = keep
            self.served += len(out)
        for rank in dead:
            rank.stop()
        return out

    def give(self, ranks: list[Rank], shape: Shape) -> None:
        """Hold `ranks` (cleaned by their job: see `RankPool.close`) for the next job."""
        with self._lock:
            if not self._closed:
                self._idle.extend((shape, r) for r in ranks)
                return
        for rank in ranks:  # closed meanwhile: nobody will take them
            rank.stop()

    @property
    def pids(self) -> list[int]:
        """The process ids of the idle ranks."""
        with self._lock:
            return [r.procs.pids[0] for _, r in self._idle]

    def __len__(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """Stop every idle rank and release its resources; ranks given back later are stopped
        at once."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, rank in idle:
            rank.stop()

    def __enter__(self) -> WarmRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
