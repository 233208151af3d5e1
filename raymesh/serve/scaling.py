"""How many replicas a server runs: a small policy over measured figures, returning its
decision as data (as `raymesh.data.scaling` and `raymesh.train.control.failure` do); the
server carries it out and logs its reason.

- Add a replica when requests queue up (more than `queue_up` waiting per replica) or the p99
  latency since the last decision is above `latency_up_s` (when set), below the maximum.
- Remove one when nothing waits and the replicas' measured work would keep one fewer replica
  at most `busy_down` busy, above the minimum.
- One step at a time, at most one decision every `cooldown_s`, so each change is measured
  before the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymesh._common import is_int

__all__ = ["AutoscalePolicy", "ReplicaScale"]


@dataclass(frozen=True)
class ReplicaScale:
    """A scaling decision: the replica count to move to, and why."""

    replicas: int
    reason: str


def _number(name: str, value: object, low: float, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > low if strict else value >= low):  # type: ignore[operator]
        raise ValueError(f"{name}={value!r}: give a number {'>' if strict else '>='} {low:g}")


@dataclass(frozen=True, kw_only=True)
class AutoscalePolicy:
    """Checked on construction: a bad field raises ValueError naming it and the fix."""

    min: int = 1
    max: int = 1
    queue_up: float = 4.0  # waiting requests per replica that add one
    latency_up_s: float | None = None  # a p99 above this adds one (None: queue depth only)
    busy_down: float = 0.5  # one replica fewer would be busy at most this share: remove one
    cooldown_s: float = 5.0  # the least time between two decisions

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"replicas {name}={value!r}: give an integer >= 1")
        if self.min > self.max:
            raise ValueError(f"replicas=({self.min}, {self.max}): min must be <= max, e.g. (1, 4)")
        _number("queue_up", self.queue_up, 0, strict=True)
        if self.latency_up_s is not None:
            _number("latency_up_s", self.latency_up_s, 0, strict=True)
        _number("busy_down", self.busy_down, 0)
        if self.busy_down > 1:
            raise ValueError(f"busy_down={self.busy_down!r}: a share of the time, in [0, 1]")
        _number("cooldown_s", self.cooldown_s, 0)

    def decide(
        self,
        *,
        replicas: int,
        queue_depth: int,
        p99_s: float | None,
        busy_replicas: float,
        since_last_s: float,
    ) -> ReplicaScale | None:
        """`queue_depth`: requests waiting now; `p99_s`: the p99 latency since the last
        decision (None: no request); `busy_replicas`: the replicas' busy seconds over the wall
        time since then (how many replicas' worth of work there was); `since_last_s`: seconds
        since the last decision. None: stay."""
        if since_last_s < self.cooldown_s:
            return None
        if replicas < self.max:
            per = queue_depth / max(replicas, 1)
            if per > self.queue_up:
                return ReplicaScale(
                    replicas + 1,
                    f"{queue_depth} requests waiting, {per:.1f} per replica > "
                    f"{self.queue_up:g}: add a replica",
                )
            if self.latency_up_s is not None and p99_s is not None and p99_s > self.latency_up_s:
                return ReplicaScale(
                    replicas + 1,
                    f"p99 {p99_s * 1000:.1f} ms > {self.latency_up_s * 1000:.1f} ms: add a replica",
                )
        if replicas > self.min and queue_depth == 0:
            fewer = busy_replicas / (replicas - 1)
            if fewer <= self.busy_down:
                return ReplicaScale(
                    replicas - 1,
                    f"nothing waiting and {busy_replicas:.2f} replicas' worth of work: "
                    f"{replicas - 1} would be {fewer:.0%} busy <= {self.busy_down:.0%}: "
                    "remove a replica",
                )
        return None
