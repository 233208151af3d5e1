"""When a pipeline adds or removes a preprocessing proc: a small policy over measured figures,
returning its decision as data (as `raymesh.train.control.failure` and
`raymesh.train.control.balance` do).

- Add one when the trainers waited for data for more than `wait_up` of their time since the
  last decision, and the pipeline is below its maximum.
- Remove one when the trainers did not wait (below `wait_down`) and the workers' measured work
  would keep one fewer worker at most `busy_down` busy, and the pipeline is above its minimum.
One step at a time, so each decision is measured before the next.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Scale", "ScalePolicy"]


@dataclass(frozen=True)
class Scale:
    """A scaling decision: the worker count to move to, and why."""

    workers: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ScalePolicy:
    min: int
    max: int
    wait_up: float = 0.05  # trainers' data-wait share that adds a worker
    wait_down: float = 0.01  # below this, the pipeline is ahead
    busy_down: float = 0.6  # a worker fewer would be busy at most this share: remove one

    def decide(self, *, workers: int, wait_fraction: float, busy_workers: float) -> Scale | None:
        """`wait_fraction`: the share of the trainers' time spent waiting for batches since
        the last decision; `busy_workers`: the workers' busy seconds over that wall time (how
        many workers' worth of work there was). None: stay."""
        if wait_fraction > self.wait_up and workers < self.max:
            return Scale(
                workers + 1,
                f"trainers waited {wait_fraction:.0%} of their time for data "
                f"(> {self.wait_up:.0%}): {workers} -> {workers + 1} preprocessing workers",
            )
        if (
            wait_fraction < self.wait_down
            and workers > self.min
            and busy_workers < (workers - 1) * self.busy_down
        ):
            return Scale(
                workers - 1,
                f"pipeline ahead (trainers waited {wait_fraction:.1%}, workers busy "
                f"{busy_workers:.2f} of {workers}): {workers} -> {workers - 1} "
                "preprocessing workers",
            )
        return None
