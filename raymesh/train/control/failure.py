"""Failures of a training job as data, and the policies that decide the world's size.

The policies are pure: given what failed and what the cluster can offer, `FailurePolicy`
returns a `FailureDecision` (replace the lost ranks, shrink the world, or abort), and
`GrowPolicy` says when an elastic job grows back (grow), each with its reason. The controller
logs the reason and carries the decision out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from raymesh.train.result import FailureRecord

__all__ = ["FailureDecision", "FailurePolicy", "GrowPolicy", "TooManyFailures"]

Action = Literal["replace", "shrink", "grow", "abort"]


@dataclass(frozen=True)
class FailureDecision:
    action: Action
    reason: str
    world_size: int  # the world size to continue with


class TooManyFailures(RuntimeError):
    """More failures than `max_failures` (within `failure_window_s`): the job stopped.

    `failures` lists every failure (rank, step, cause); the newest valid checkpoint, if
    checkpoints are on, is `checkpoint`."""

    def __init__(self, failures: list[FailureRecord], checkpoint: str | None) -> None:
        self.failures = failures
        self.checkpoint = checkpoint
        listed = "; ".join(str(f) for f in failures)
        super().__init__(
            f"{len(failures)} failures, more than the job allows: {listed}. "
            f"Last valid checkpoint: {checkpoint or 'none'}"
        )


class FailurePolicy:
    """Replace lost ranks while the failure budget lasts.

    max_failures: how many failures the job survives; the next one aborts it.
    window_s: count only failures this recent (None: the whole job).
    """

    def __init__(self, *, max_failures: int, window_s: float | None = None) -> None:
        self.max_failures = max_failures
        self.window_s = window_s

    def decide(
        self,
        failures: list[FailureRecord],
        world_size: int,
        *,
        replacements: int,
        lost: int,
        min_workers: int,
    ) -> FailureDecision:
        """failures: all so far (the newest last); lost: ranks to replace now; replacements:
        how many new ranks can be placed now."""
        now = failures[-1].time if failures else time.time()
        # A rank stuck behind a peer's failure is not at fault, once; stuck again in the same
        # place at the same step, the world cannot re-form there, and replacing it forever
        # would hang the job: from then on it counts.
        stuck_at: set[tuple[int, int]] = set()
        counted = []
        for f in failures:
            if f.kind == "stuck" and (f.rank, f.step) not in stuck_at:
                stuck_at.add((f.rank, f.step))
                continue
            if self.window_s is None or now - f.time <= self.window_s:
                counted.append(f)
        window = f" in the last {self.window_s:g}s" if self.window_s is not None else ""
        if len(counted) > self.max_failures:
            return FailureDecision(
                "abort",
                f"{len(counted)} failures{window}, more than max_failures={self.max_failures}",
                world_size,
            )
        if replacements >= lost:
            return FailureDecision(
                "replace",
                f"{lost} lost rank(s) to replace; failure {len(counted)} of "
                f"max_failures={self.max_failures}{window}",
                world_size,
            )
        survivors = world_size - lost + replacements
        if survivors >= min_workers:
            return FailureDecision(
                "shrink",
                f"only {replacements} of {lost} lost rank(s) can be replaced: continue with "
                f"{survivors} (min {min_workers})",
                survivors,
            )
        return FailureDecision(
            "abort",
            f"{survivors} rank(s) left, fewer than min workers {min_workers}, and no capacity "
            "to replace the lost ones",
            world_size,
        )


class GrowPolicy:
    """Grow an elastic job back toward max_workers as soon as recruited ranks are ready (the
    controller then resizes at the next step boundary)."""

    def decide(self, world_size: int, *, max_workers: int, ready: int) -> FailureDecision | None:
        add = min(max_workers - world_size, ready)
        if add <= 0:
            return None
        return FailureDecision(
            "grow",
            f"capacity returned: {add} rank(s) ready, {world_size} -> {world_size + add} "
            f"(max {max_workers})",
            world_size + add,
        )
