"""The bounded rollout buffer between the generators and the trainer.

A `Rollout` is the unit the trainer learns from: for GRPO one prompt's group of completions,
for PPO one runner's segment of steps. It carries a key, unique in the run (the prompt's or the
segment's number), and the policy version that made it.

Guarantees:
- Bounded: at most `capacity` rollouts wait; `put` blocks while the buffer is full (the
  generators run at most that far ahead), and raises TimeoutError past its timeout.
- Bounded staleness: `take(n, version=v)` hands out only rollouts made by versions
  v - max_staleness .. v. Older ones are dropped, and their keys returned by `stale()`, so the
  loop makes them again: no rollout is lost.
- Exactly once: a key is accepted once (`put` of a key already in the buffer or already taken
  returns False). A generator replaced after a failure may remake a rollout that its
  predecessor had delivered; the copy is refused, so nothing is counted twice.
- Deterministic order: `take` hands out the smallest keys first, whatever order the
  generators finished in. With max_staleness=0 the loop asks only for one step's keys, so a
  step's batch does not depend on timing.
- Every wait has a timeout: TimeoutError, never a hang.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from raymesh._common import check_int

__all__ = ["Rollout", "RolloutBuffer"]


@dataclass(frozen=True, order=True)
class Rollout:
    """One rollout: `key` unique in the run, `version` the policy that made it, `data` what
    the algorithm needs (tokens, log-probabilities, rewards...)."""

    key: int
    version: int = field(compare=False)
    data: Any = field(compare=False, default=None)


class RolloutBuffer:
    """See the module. Thread-safe: generators' results may arrive on several threads."""

    def __init__(self, *, capacity: int, max_staleness: int) -> None:
        check_int("capacity", capacity, minimum=1)
        check_int("max_staleness", max_staleness, minimum=0)
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._heap: list[Rollout] = []
        self._keys: set[int] = set()  # every key in the buffer or taken
        self._stale: list[int] = []
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def put(self, rollout: Rollout, *, timeout_s: float) -> bool:
        """Add `rollout`, waiting up to `timeout_s` for room; False (and nothing added) when
        its key was accepted before. TimeoutError when the buffer stays full."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if rollout.key in self._keys:
                return False
            while len(self._heap) >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"rollout buffer: full ({self.capacity} rollouts) for {timeout_s:g}s; "
                        "the trainer is not taking them"
                    )
                self._cond.wait(left)
                if rollout.key in self._keys:  # delivered by another while we waited
                    return False
            self._keys.add(rollout.key)
            heapq.heappush(self._heap, rollout)
            self._cond.notify_all()
            return True

    def take(self, n: int, *, version: int, timeout_s: float) -> list[Rollout]:
        """The `n` fresh rollouts with the smallest keys (fresh: made by version
        >= `version` - max_staleness), waiting up to `timeout_s` for them; stale ones found on
        the way are dropped (see `stale`). TimeoutError when fewer than `n` arrive in time;
        nothing is taken then."""
        check_int("n", n, minimum=1)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._drop_stale(version)
                if len(self._heap) >= n:
                    taken = [heapq.heappop(self._heap) for _ in range(n)]
                    self._cond.notify_all()  # room for the generators
                    return taken
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"rollout buffer: {len(self._heap)} of {n} rollouts after "
                        f"{timeout_s:g}s; the generators or environment runners are not delivering"
                    )
                self._cond.wait(left)

    def stale(self) -> list[int]:
        """The keys dropped as too stale since the last call, to be made again."""
        with self._cond:
            keys, self._stale = self._stale, []
            return keys

    def _drop_stale(self, version: int) -> None:
        oldest = version - self.max_staleness
        if not any(r.version < oldest for r in self._heap):
            return
        fresh = [r for r in self._heap if r.version >= oldest]
        for r in self._heap:
            if r.version < oldest:
                self._keys.discard(r.key)  # its remake is welcome
                self._stale.append(r.key)
        heapq.heapify(fresh)
        self._heap = fresh
        self._cond.notify_all()
