"""A rank's progress, and the `Monitor` actor that reports it while the trainer is busy.

The trainer marks each phase of each step here; the Monitor, a second actor on the trainer's
proc (actors sharing a proc run concurrently), reads the marks. So the controller can ask a
rank where it is even while its trainer is stuck, which is how a hung rank is told apart from
the ranks waiting for it in a collective (`raymesh.train.control.detection`).
"""

from __future__ import annotations

import os
import time

from raymesh.actor import Actor, endpoint
from raymesh.train.protocol import RankStatus

__all__ = ["PHASES", "Monitor", "mark"]

# A step's phases in order: a rank in a later phase of the same step is ahead.
PHASES = ("idle", "start", "forward", "backward", "optimizer", "done")

# This process's progress: (step, phase, time.monotonic() when it began). One tuple, replaced
# whole, so a reader on another thread never sees half an update.
_progress: tuple[int, str, float] = (0, "idle", time.monotonic())


def mark(step: int, phase: str) -> None:
    """The trainer entered `phase` of `step` (1-based)."""
    global _progress
    _progress = (step, phase, time.monotonic())


class Monitor(Actor):
    """Reports the trainer's progress in this proc, even while the trainer is stuck."""

    @endpoint
    def status(self) -> RankStatus:
        step, phase, since = _progress
        return RankStatus(
            step=step,
            phase=phase,
            phase_index=PHASES.index(phase),
            for_s=time.monotonic() - since,
            pid=os.getpid(),
        )
