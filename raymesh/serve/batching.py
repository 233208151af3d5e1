"""Dynamic batching as a plain queue: which requests leave together, and when.

Requests wait in arrival order. A batch is the oldest `max_batch_size` of them, and it may leave
as soon as it is full or its oldest request has waited `batch_wait_ms`, whichever comes first;
or at once when the caller says nothing is being computed (`ready(now, idle=True)`).
The queue is bounded: a request beyond `max_queue` waiting is refused (`Overloaded`, which the
HTTP front answers with 503 and Retry-After), so memory never grows with the load.

The queue does no waiting and reads no clock: its caller passes the time (`now`, seconds on any
monotonic clock) and asks `deadline()` when to look again. So the rules hold exactly and are
tested without sleeping; the server's event loop is the only thing that waits.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from raymesh._common import bad, check_int

__all__ = ["BatchConfig", "BatchQueue", "Overloaded"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How requests are batched. Checked on construction: a bad field raises ValueError naming
    it, the value and the fix."""

    max_batch_size: int = 32  # requests in one call of the model
    batch_wait_ms: float = 5.0  # the longest the oldest request waits for others to join it
    max_queue: int = 1024  # requests waiting at most; beyond it, Overloaded (HTTP 503)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue"):
            check_int(name, getattr(self, name), 1)
        wait = self.batch_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise bad("batch_wait_ms", wait, "give a number of milliseconds >= 0")
        if self.max_queue < self.max_batch_size:
            raise bad(
                "max_queue",
                self.max_queue,
                f"must hold at least one full batch (max_batch_size={self.max_batch_size})",
            )


class Overloaded(Exception):
    """The queue is full: the request was not taken. `retry_after_s` estimates when there will
    be room, from how fast batches have been leaving (at least 1 s)."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"{depth} requests are waiting; retry after {retry_after_s} s")
        self.depth = depth
        self.retry_after_s = retry_after_s


class BatchQueue(Generic[T]):
    """Requests waiting to be batched (see the module docstring). Not thread-safe: one event
    loop owns it."""

    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self._waiting: deque[tuple[float, T]] = deque()  # (arrival time, request), oldest first
        self._taken = 0  # requests that left in batches, and since when (for Retry-After)
        self._since: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, request: T, now: float) -> None:
        """Queue `request`, arrived at `now`. Raises Overloaded when `max_queue` are waiting."""
        if len(self._waiting) >= self.config.max_queue:
            raise Overloaded(len(self._waiting), self._retry_after(now))
        self._waiting.append((now, request))

    def ready(self, now: float, *, idle: bool = False) -> bool:
        """Whether a batch may leave at `now`: a full one is waiting, or the oldest request has
        waited `batch_wait_ms`, or (`idle`: nothing is being computed) anything waits, since
        an idle server gains nothing by holding a request back."""
        if not self._waiting:
            return False
        if idle:
            return True
        deadline = self.deadline()
        return len(self._waiting) >= self.config.max_batch_size or (
            deadline is not None and now >= deadline
        )

    def deadline(self) -> float | None:
        """When the oldest waiting request's wait ends (None: nothing waits)."""
        if not self._waiting:
            return None
        return self._waiting[0][0] + self.config.batch_wait_ms / 1000.0

    def take(self, now: float) -> list[T]:
        """The next batch: the oldest requests, at most `max_batch_size`, in arrival order
        (empty when nothing waits). Call it when `ready(now)`, or to flush."""
        n = min(len(self._waiting), self.config.max_batch_size)
        batch = [self._waiting.popleft()[1] for _ in range(n)]
        if batch:
            self._since = now if self._since is None else self._since
            self._taken += len(batch)
        return batch

    def requeue(self, requests: list[tuple[float, T]]) -> None:
        """Put taken requests, given as (arrival time, request) oldest first, back at the
        front (requests resent after their replica died): they leave first, and at once if
        they have waited `batch_wait_ms`. Not bounded by `max_queue`: they were admitted once."""
        self._waiting.extendleft(reversed(requests))

    def take_all(self) -> list[T]:
        """Every waiting request (to fail them when the server stops)."""
        out = [r for _, r in self._waiting]
        self._waiting.clear()
        return out

    def _retry_after(self, now: float) -> int:
        """Seconds until the queue has drained to half, at the rate batches have left so far."""
        if self._since is None or now <= self._since or self._taken == 0:
            return 1
        rate = self._taken / (now - self._since)  # requests per second
        return max(1, math.ceil((len(self._waiting) / 2) / rate))
