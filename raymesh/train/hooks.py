"""Hooks into a training job: where code outside the training loop can act on it.

`TrainHooks` runs in the controller; for each world that forms it hands out `RankHooks`, which
travel to every rank and run in its process at fixed points of its life. raymesh.testing's
`FaultInjector` implements both, to kill, fail, hang or slow chosen ranks at chosen steps; the
training code has no fault-specific branch, only these calls. A job without hooks makes no hook
call at all (and no extra message to its ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["RankHooks", "TrainHooks"]


class RankHooks(Protocol):
    """Runs in each rank's process; sent there pickled, once per world (generation)."""

    def on_join(self, rank: int, step: int) -> None:
        """As the rank joins a world re-formed (healing or resizing) with `step` next, before
        it enters the process group; may raise or never return, like any failure there."""

    def on_step(self, rank: int, step: int) -> None:
        """As `rank` starts `step` (1-based), before any of its work."""

    def in_step(self, rank: int, step: int, compute_s: float) -> None:
        """Between the forward and the backward of the step's last micro batch; `compute_s` is
        the rank's own forward + backward time of its previous step (0 at first). The time this
        takes counts as waiting, not as the rank's compute (load balancing sees a straggler)."""


class TrainHooks(Protocol):
    """Runs in the controller."""

    def for_world(self, next_step: int, *, rejoin: bool) -> RankHooks | None:
        """The rank hooks for a world forming with `next_step` (1-based) next: the first world
        (`rejoin` False) or one re-formed after a failure or to resize. None: no hooks."""

    def on_lost(self, ranks: Sequence[int], step: int) -> None:
        """`ranks` (places in the world) were lost while `step` was in flight."""
