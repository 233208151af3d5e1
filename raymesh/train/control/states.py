"""The training controller's states: plain data, each carrying what its phase needs.

    Starting --> Running --> Finishing --> Finished
                 |  ^  ^ \\ \
                 v  |  |  \\ Stopped        (a sink ended the job)
           Healing  Resizing Waiting       (any state --> Failed on an unrecoverable error)
                             (a driven job: the steps supplied are trained; the loop's next)

A state is the phase the controller will run next and why it got there (`reason`, logged and
kept in `Result.transitions`); what a phase needs from the one before travels in the state
(`Healing` carries the failed chunk, `Resizing` the grow decision, `Finished` the weights,
`Failed` and `Stopped` the error), never through the controller's attributes. `Finished`,
`Failed` and `Stopped` are terminal, known by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raymesh.train.control.failure import FailureDecision

__all__ = [
    "TERMINAL",
    "Failed",
    "FailedChunk",
    "Finished",
    "Finishing",
    "Healing",
    "Resizing",
    "Running",
    "Starting",
    "State",
    "Stopped",
    "Waiting",
]


@dataclass(frozen=True)
class State:
    reason: str  # why the controller entered this state


@dataclass(frozen=True)
class FailedChunk:
    """A chunk of steps that did not complete on every rank."""

    start: int  # its first step (0-based)
    stop: int  # one past its last
    results: tuple[Any, ...]  # each rank's outcome: a ChunkResult, or the error it raised
    # The outcomes of the chunks queued behind it (they fail too, but may tell that the ranks
    # got further: a lost rank's reply to this chunk can be lost with it).
    later: tuple[tuple[Any, ...], ...] = ()
    # Each rank's pending reply: one that did not answer in time (stuck in a collective with a
    # hung rank) answers once that rank is gone, with the steps it completed.
    replies: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Starting(State):
    """Spawn the ranks and spares, form the process group, decide the strategy, restore."""


@dataclass(frozen=True)
class Running(State):
    """Train chunk after chunk, two in flight, until the last step, a failure or a grow."""


@dataclass(frozen=True)
class Healing(State):
    """Find the ranks `chunk` lost, replace them (or shrink), re-form, restore state."""

    chunk: FailedChunk


@dataclass(frozen=True)
class Resizing(State):
    """Grow the world with recruited ranks, at a step boundary (elastic jobs)."""

    grow: FailureDecision


@dataclass(frozen=True)
class Waiting(State):
    """A driven job (`train.drive`) trained every step its loop supplied: it waits for the
    loop's next one (`DrivenJob.step`), or for `close` (then Finishing)."""


@dataclass(frozen=True)
class Finishing(State):
    """The final checkpoint (with `extra` in its manifest: a driven job's loop's data), and
    the full weights from rank 0."""

    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class Finished(State):
    """Trained to the last step; `weights`: the full model state, from rank 0."""

    weights: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed(State):
    """The job stopped; `error` is what `fit` raises."""

    error: BaseException


@dataclass(frozen=True)
class Stopped(State):
    """A sink ended the job by raising `error` (raymesh.tune prunes a trial so), which `fit`
    raises. `drained`: the ranks finished the chunks they had, at a step boundary, so their
    procs can serve another job."""

    error: BaseException
    drained: bool


TERMINAL = (Finished, Failed, Stopped)
