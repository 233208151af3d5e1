"""The messages between the training controller and its ranks, as typed data.

Every endpoint of `TrainWorker` and `Monitor` takes and returns these (or plain numbers), so a
reader never has to remember which keys a dict carries, and the controller's decisions can be
unit-tested over hand-made values (see `raymesh.train.control.detection`). All are frozen
dataclasses of plain values: cheap to pickle, safe to share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from raymesh.train.estimate import MemoryEstimate
from raymesh.train.task import Local

__all__ = [
    "ChunkResult",
    "Feeders",
    "LostRank",
    "RankStatus",
    "Rendezvous",
    "ReplicaState",
    "SetupInfo",
    "StepMetrics",
]


@dataclass(frozen=True)
class Rendezvous:
    """Where and as what a rank joins a process group generation."""

    addr: str  # the store's host (rank 0's node)
    port: int  # the store's port there
    rank: int  # this rank's place in the world
    world_size: int
    local: Local  # its place among its host's ranks (LOCAL_RANK, LOCAL_WORLD_SIZE)
    next_step: int = 1  # the step (1-based) this world trains next, as far as the controller knows


@dataclass(frozen=True)
class SetupInfo:
    """What a rank reports once it has built the user's task."""

    params: int  # parameters in the model
    device: str  # "cpu" or "cuda:<i>"
    # The per-rank memory estimate and this rank's budget: at the start only (the strategy
    # decision needs them once; a rank that joins later is not measured).
    estimate: MemoryEstimate | None = None
    budget_bytes: int | None = None


@dataclass(frozen=True)
class StepMetrics:
    """One completed step on one rank."""

    step: int  # 1-based
    loss: float  # this rank's loss (the mean over its share of the batch)
    step_s: float  # wall seconds of the whole step
    end: float  # wall clock (time.time()) when the step was complete here
    compute_s: float  # this rank's own forward + backward seconds (for load balancing)
    samples: int  # the samples compute_s was measured on
    data_wait_s: float | None = None  # seconds it waited for batches (None: no pipeline)
    eval_loss: float | None = None  # the world's mean loss on Task.eval_dataset (every rank's)
    # What the loss function returned beside the loss (`(loss, {name: value})`), weighed by the
    # rank's share of the batch as its loss is: the mean over the ranks is the global batch's.
    stats: dict[str, float] | None = None


@dataclass(frozen=True)
class Feeders:
    """The preprocessing workers a rank asks for batches (raymesh.data), sent with a chunk
    when they changed since the rank last heard."""

    generation: int  # grows with every change of the set
    workers: tuple[Any, ...]  # one-actor meshes of raymesh.data's Preprocessor


@dataclass(frozen=True)
class ChunkResult:
    """A rank's answer to `run(start, stop)`: what it trained, and why it stopped early."""

    metrics: tuple[StepMetrics, ...]  # the steps it completed, in order
    done: int  # steps completed in all (the data position)
    error: str | None = None  # why the chunk stopped early (None: it completed)
    # "peer": a collective failed because another rank went away; "own": this rank's step
    # itself raised (the rank is then replaced); "data": a sample could not be made
    # (raymesh.data.DataError: the job stops, as redoing it fails the same way). None when
    # there is no error.
    cause: Literal["own", "peer", "data"] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RankStatus:
    """A rank's progress, from the Monitor beside it (it answers while the trainer hangs)."""

    step: int  # the step it is in (1-based), or last completed
    phase: str  # "idle" | "start" | "forward" | "backward" | "optimizer" | "done"
    phase_index: int  # the phase's order within a step (a rank further along is waiting)
    for_s: float  # seconds in that phase so far
    pid: int


@dataclass(frozen=True)
class LostRank:
    """A rank the controller must replace, and why."""

    rank: int
    # "died" (the process is gone), "error" (its step raised), "hung" (no progress), "stuck"
    # (blocked in a collective with a failed peer: a consequence, not counted as a failure)
    kind: Literal["died", "error", "hung", "stuck"]
    cause: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.cause}"


@dataclass(frozen=True)
class ReplicaState:
    """A DDP rank's whole state: every rank of a DDP world can restore from any one replica."""

    model: dict[str, Any] = field(repr=False)  # the unwrapped model's state_dict
    optim: dict[str, Any] = field(repr=False)  # the optimizer's state_dict
    done: int  # the steps it completed
