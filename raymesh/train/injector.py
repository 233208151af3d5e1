"""`FaultInjector`: carries a job's `Fault`s out through raymesh.train's hooks.

Each fault fires once per job. The injector keeps the pending ones in the controller and gives
every world the faults still to come; a fault that fired on a rank that was then lost is
dropped, so its replacement, which resumes at the same step, does not fire it again. Faults
name a rank by its place in the current world.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raymesh.train.faults import Fault

__all__ = ["FaultInjector", "RankFaults"]


@dataclass(frozen=True)
class RankFaults:
    """The faults of one world, as rank hooks (runs in the ranks' processes)."""

    faults: tuple[Fault, ...]

    def on_join(self, rank: int, step: int) -> None:
        for f in self.faults:
            if f.when == "join" and f.rank == rank and f.at_step == step:
                f.fire()

    def on_step(self, rank: int, step: int) -> None:
        for f in self.faults:
            if f.when == "step" and f.rank == rank and f.at_step == step:
                f.fire()

    def in_step(self, rank: int, step: int, compute_s: float) -> None:
        # A straggler: from its step on, the rank takes `factor` times its own compute time.
        factors = [
            f.factor
            for f in self.faults
            if f.kind == "slow" and f.rank == rank and f.at_step <= step and f.factor
        ]
        if factors:
            time.sleep((max(factors) - 1) * compute_s)


class FaultInjector:
    """The controller's side: which faults are still to fire (see the module docstring)."""

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.pending = list(faults)

    def for_world(self, next_step: int, *, rejoin: bool) -> RankFaults | None:
        # A join fault fires in the world re-formed while its step is next, and only there.
        joining = [
            f for f in self.pending if rejoin and f.when == "join" and f.at_step == next_step
        ]
        for f in joining:
            self.pending.remove(f)
        faults = tuple(f for f in self.pending if f.when == "step") + tuple(joining)
        return RankFaults(faults) if faults else None

    def on_lost(self, ranks: Sequence[int], step: int) -> None:
        # A rank is never more than one step ahead of the others (each step ends in an
        # all-reduce), so a lost rank's fault at or before the step in flight fired.
        for f in self.pending[:]:
            if f.when == "step" and f.at_step <= step and f.rank in ranks:
                self.pending.remove(f)
