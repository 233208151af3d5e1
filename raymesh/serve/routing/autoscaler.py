"""The autoscaler: carries out `AutoscalePolicy`'s decisions on the replica pool.

It measures a window (the latencies of the requests answered and the time replicas spent
computing) since the last decision, and once per `cooldown_s` asks the policy for one. Each
decision is logged with its reason and kept (the last `KEPT_DECISIONS`, in `decisions`); it
sets the pool's target, and a step down retires one replica (idle if any). The latencies are
the last `LATENCY_SAMPLES` of the window, so a server whose policy never decides (a fixed
replica count) holds no more.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from raymesh.serve.metrics import Metrics
from raymesh.serve.routing.pool import ReplicaPool
from raymesh.serve.scaling import AutoscalePolicy, ReplicaScale

logger = logging.getLogger("raymesh.serve")

__all__ = ["Autoscaler", "Window"]

# The latencies a p99 is taken over: the newest this many since the last decision. Bounded, as
# a window is kept for as long as no decision ends it (forever, with a fixed replica count).
LATENCY_SAMPLES = 4096
KEPT_DECISIONS = 256  # scaling decisions kept for stats() (oldest dropped)


@dataclass
class Window:
    """What happened since the policy last looked."""

    start: float
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_SAMPLES)
    )
    busy_s: float = 0.0


class Autoscaler:
    """Measures through `observe` (the dispatcher's batches) and decides through `tick` (the
    router's loop); `start` opens the first window."""

    def __init__(self, policy: AutoscalePolicy, pool: ReplicaPool, metrics: Metrics) -> None:
        self.policy = policy
        self.pool = pool
        self.metrics = metrics
        self.decisions: collections.deque[ReplicaScale] = collections.deque(maxlen=KEPT_DECISIONS)

    def start(self, now: float) -> None:
        self.window = Window(now)
        self._last_decision = now

    def observe(self, sent: float, now: float, arrived: Sequence[float]) -> None:
        """A batch sent at `sent` was answered at `now`; its requests arrived at `arrived`."""
        self.window.busy_s += now - sent
        self.window.latencies.extend(now - a for a in arrived)

    def tick(self, now: float, queue_depth: int) -> None:
        """Decide, when a cooldown has passed since the window began and the policy has a
        range to move in."""
        if now - self.window.start >= self.policy.cooldown_s and self.policy.min < self.policy.max:
            self._decide(now, queue_depth)

    def _decide(self, now: float, queue_depth: int) -> None:
        window, self.window = self.window, Window(now)
        latencies = sorted(window.latencies)
        p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
        replicas = self.pool.live()
        decision = self.policy.decide(
            replicas=replicas,
            queue_depth=queue_depth,
            p99_s=p99,
            busy_replicas=window.busy_s / max(now - window.start, 1e-9),
            since_last_s=now - self._last_decision,
        )
        if decision is None:
            return
        self._last_decision = now
        self.decisions.append(decision)
        self.metrics.scale_decisions.inc()
        logger.info(
            "raymesh.serve: %d -> %d replicas: %s", replicas, decision.replicas, decision.reason
        )
        self.pool.target = decision.replicas
        if decision.replicas < replicas:
            self.pool.retire_one()
