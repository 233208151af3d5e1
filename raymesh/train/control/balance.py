"""Dynamic load balancing: split the global batch so that every rank finishes its share at once.

A rank's cost is its own compute per step: the forward and backward time DDP measures on that
rank, which leaves out the time spent waiting for peers in the gradient all-reduce (so a fast
rank that waits for a straggler does not look slow). Under DDP every step ends when the slowest
rank's share is done, so shares fitted to the ranks' speeds shorten the step, while the global
batch, its sample order and the averaged gradient stay the same (the trainer weights each rank's
loss by its share).

Each rank's time is modelled as proportional to its share (its latest report's time per
sample); the split that minimises the slowest rank's predicted time is found exactly, one sample
at a time to the rank that would finish it first, and the policy moves halfway there. Halfway,
because a step also has a fixed cost that does not shrink with the share: a proportional model
overestimates a straggler's time per sample once its share is cut, and a full move would starve
it; successive half moves settle where the measured times meet.

`BalancePolicy.decide` is plain data in, plain data out: given the ranks' reports and the current
split it returns a `BalanceDecision` (the new split, the ranks too slow to keep, and why) or
None. `Balancer` keeps the split the next chunks use: it asks the policy after each chunk, and
the controller logs a new split and sends it with the next chunk it queues, to every rank at
once.
"""

from __future__ import annotations

import heapq
import logging
import statistics
from dataclasses import dataclass
from typing import Any

from raymesh.data.order import split_sizes
from raymesh.train.protocol import StepMetrics

logger = logging.getLogger("raymesh")

__all__ = ["BalanceDecision", "BalancePolicy", "Balancer"]


@dataclass(frozen=True)
class BalanceDecision:
    sizes: tuple[int, ...]  # samples per rank, summing to the global batch
    flagged: tuple[int, ...]  # ranks slower per sample than the median by more than flag_factor
    reason: str


class BalancePolicy:
    """Rebalance when the predicted step time improves by more than `gain` (1.15: 15%) for
    `patience` reports in a row (one noisy report does not move samples); flag a rank for
    replacement when it is `flag_factor` times slower per sample than the median rank. Keeps the
    streak of reports; `reset()` when the world changes."""

    def __init__(self, *, gain: float = 1.15, patience: int = 2, flag_factor: float = 3.0) -> None:
        self.gain = gain
        self.patience = patience
        self.flag_factor = flag_factor
        self._streak = 0

    def reset(self) -> None:
        self._streak = 0

    def decide(
        self, samples: list[float], seconds: list[float], sizes: list[int]
    ) -> BalanceDecision | None:
        """samples, seconds: each rank's samples and own compute time per step (averaged over a
        report); sizes: the split now (summing to the global batch)."""
        if len(sizes) < 2 or min(seconds) <= 0 or min(samples) <= 0:
            return None
        models = [(0.0, t / n) for n, t in zip(samples, seconds)]
        target = _split(models, sum(sizes))
        proposed = _halfway(sizes, target, models)
        now = max(a + b * n for (a, b), n in zip(models, sizes))
        then = max(a + b * n for (a, b), n in zip(models, proposed))
        if proposed == sizes or now < self.gain * then:
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < self.patience:
            return None
        self._streak = 0
        per_sample = [b for _, b in models]
        median = statistics.median(per_sample)
        flagged = tuple(r for r, b in enumerate(per_sample) if b > self.flag_factor * median)
        relative = ", ".join(f"{b / median:.2f}" for b in per_sample)
        reason = (
            f"time per sample {relative} x the median: split {sizes} -> {list(proposed)}, "
            f"predicted step {now * 1000:.1f} -> {then * 1000:.1f} ms"
        )
        if flagged:
            reason += f"; rank(s) {list(flagged)} over {self.flag_factor:g}x the median"
        return BalanceDecision(tuple(proposed), flagged, reason)


class Balancer:
    """The samples per rank of the next chunks (`sizes`; None: the even split of
    `global_batch_size`), moved by `policy` on DDP worlds of two or more ranks when `enabled`."""

    def __init__(
        self, *, enabled: bool, global_batch_size: int, policy: BalancePolicy | None = None
    ) -> None:
        self.enabled = enabled
        self.global_batch_size = global_batch_size
        self.policy = policy or BalancePolicy()
        self.sizes: list[int] | None = None

    def reset(self) -> None:
        """A new world starts from the even split."""
        self.sizes = None
        self.policy.reset()

    def observe(
        self, per_rank: list[tuple[StepMetrics, ...]], *, sharded: bool, step: int
    ) -> dict[str, Any] | None:
        """Ask the policy for a new split from one chunk's measured speeds; the rebalance
        record (step, sizes, flagged ranks, reason) when the split moved, else None."""
        ranks = len(per_rank)
        if not self.enabled or sharded or ranks < 2:
            return None
        steps = len(per_rank[0])
        samples = [sum(m.samples for m in ms) / steps for ms in per_rank]
        seconds = [sum(m.compute_s for m in ms) / steps for ms in per_rank]
        sizes = self.sizes or split_sizes(self.global_batch_size, ranks)
        balance = self.policy.decide(samples, seconds, sizes)
        if balance is None:
            return None
        self.sizes = list(balance.sizes)
        logger.info("raymesh.train: rebalance at step %d: %s", step, balance.reason)
        if balance.flagged:
            logger.warning(
                "raymesh.train: rank(s) %s flagged for replacement (far slower than the rest)",
                list(balance.flagged),
            )
        return {
            "step": step,
            "sizes": self.sizes,
            "flagged": list(balance.flagged),
            "reason": balance.reason,
        }


def _split(models: list[tuple[float, float]], batch: int) -> list[int]:
    """The split of `batch` samples (each rank at least one) that minimises the slowest rank's
    a + b * n: each next sample goes to the rank that would finish it first (ties: lower rank),
    which is optimal for this objective."""
    sizes = [1] * len(models)
    heap = [(a + 2 * b, r) for r, (a, b) in enumerate(models)]
    heapq.heapify(heap)
    for _ in range(batch - len(models)):
        _, r = heapq.heappop(heap)
        sizes[r] += 1
        a, b = models[r]
        heapq.heappush(heap, (a + b * (sizes[r] + 1), r))
    return sizes


def _halfway(sizes: list[int], target: list[int], models: list[tuple[float, float]]) -> list[int]:
    """Each rank's share moved half the way from `sizes` to `target` (rounded toward the
    current share), then made to sum to the batch again: the samples rounding left over go to
    the ranks that would finish them first, an excess comes off the ranks that finish last."""
    moved = [n + int((t - n) / 2) for n, t in zip(sizes, target)]
    while sum(moved) < sum(sizes):
        r = min(range(len(moved)), key=lambda i: (models[i][0] + models[i][1] * (moved[i] + 1), i))
        moved[r] += 1
    while sum(moved) > sum(sizes):
        fits = [i for i in range(len(moved)) if moved[i] > 1]
        r = max(fits, key=lambda i: (models[i][0] + models[i][1] * moved[i], -i))
        moved[r] -= 1
    return moved
