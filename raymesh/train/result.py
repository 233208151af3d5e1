"""What a training job returns (`Result`) or raises (`TrainError`), and the log it is made of.

`RunLog` is the job's record as it runs: the loss history, every state transition with its
reason, every failure and how long healing it took, every rebalance. The controller writes it,
and it tells the report sinks each event as it is recorded; `Result` is its final form.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raymesh.data import PipelineReport
from raymesh.train.protocol import LostRank, StepMetrics
from raymesh.train.reporting import Event, Report, ReportSink
from raymesh.train.strategy import StrategyDecision

__all__ = ["FailureRecord", "Result", "RunLog", "TrainError"]


@dataclass(frozen=True)
class FailureRecord:
    """One failure: which rank, at which step (the step in flight), why, and how it ended."""

    rank: int
    step: int
    cause: str
    # "died" (the process is gone), "error" (a step raised), "hung" (no progress), "stuck" (a
    # survivor still blocked in a collective with a failed peer: gloo cannot abort a group
    # whose peers are alive, so it is replaced too, as a consequence, not counted as a failure)
    kind: str
    time: float = field(default_factory=time.time)
    recovery_s: float | None = None  # from detection to the first step completed after healing
    steps_recomputed: int | None = None  # steps trained again because of this failure
    action: str | None = None  # how it was healed: "replace" or "shrink" (None: not yet)
    replaced_by: str | None = None  # the proc that took its place ("spare-3 (pid 4242)")

    def __str__(self) -> str:
        return f"rank {self.rank} at step {self.step}: {self.kind}: {self.cause}"


class TrainError(RuntimeError):
    """The job stopped. `cause` is the underlying failure; `history` what was trained."""

    def __init__(self, message: str, *, cause: BaseException | None, history: list[dict]) -> None:
        super().__init__(message)
        self.cause = cause
        self.history = history


@dataclass
class Result:
    """What `fit` returns."""

    # One entry per step: step (1-based), loss (mean of ranks), samples_per_s, end (wall time
    # the step was complete on every rank).
    history: list[dict[str, float]]
    decision: StrategyDecision  # the strategy and its arithmetic
    checkpoint: str | None  # the newest committed checkpoint folder, if checkpoints were on
    resumed_from: int  # the step the run started from (0: fresh)
    transitions: list[tuple[str, str]]  # (state, reason), in order
    failures: list[FailureRecord] = field(default_factory=list)  # and how each was healed
    # Each rebalance (rebalance=True): {"step", "sizes", "flagged", "reason"}
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    placement: str | None = None  # why the ranks run where they do (multi-host: the plan)
    # Each history entry's step seconds on each rank, in rank order (the world may resize).
    rank_step_s: list[tuple[float, ...]] = field(default_factory=list)
    data: PipelineReport | None = None  # what the pipeline did (TrainConfig.data), else None
    _weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final model weights: CPU tensors under the model's own (unwrapped) names."""
        return dict(self._weights)


class RunLog:
    """The record of a job so far (see the module docstring)."""

    def __init__(self, sinks: Sequence[ReportSink] = ()) -> None:
        self.sinks = sinks  # told every event (`emit`)
        self.history: list[dict[str, float]] = []
        self.transitions: list[tuple[str, str]] = []
        self.failures: list[FailureRecord] = []
        self.rebalances: list[dict[str, Any]] = []
        self.step_times: list[float] = []  # seconds per step, as the ranks measured them
        self.rank_step_s: list[tuple[float, ...]] = []  # per history entry, each rank's
        # Failures being healed, with the wall time each was detected and the steps it makes
        # the job train again: completed by the next chunk recorded.
        self.healing: list[tuple[FailureRecord, float, int]] = []

    def emit(self, name: str, /, **data: Any) -> None:
        """Tell every sink that `name` happened (`reporting.Event`)."""
        event = Event(name, data)
        for sink in self.sinks:
            sink.on_event(event)

    def transition(self, state: str, reason: str, step: int) -> None:
        """The controller entered `state` at `step`, for `reason`."""
        self.transitions.append((state, reason))
        self.emit("state", state=state, reason=reason, step=step)

    def lost(self, lost: list[LostRank], step: int) -> list[FailureRecord]:
        """Record ranks lost while `step` was in flight; returns their records."""
        records = [FailureRecord(rank=x.rank, step=step, cause=x.cause, kind=x.kind) for x in lost]
        self.failures.extend(records)
        for r in records:
            self.emit("failure", rank=r.rank, step=r.step, kind=r.kind, cause=r.cause)
        return records

    def healed(
        self,
        records: list[FailureRecord],
        detected: float,
        recomputed: int,
        *,
        action: str,
        replaced_by: dict[int, str],
    ) -> None:
        """`records` are healed (`action`; `replaced_by`: the proc that took each lost rank's
        place); the next chunk recorded tells how long recovery took."""
        for r in records:
            done = dataclasses.replace(r, action=action, replaced_by=replaced_by.get(r.rank))
            self.failures[self.failures.index(r)] = done
            self.healing.append((done, detected, recomputed))

    def trim(self, step: int) -> None:
        """Forget the steps after `step`: they are trained again (healing from a checkpoint)."""
        self.history = [h for h in self.history if h["step"] <= step]
        self.rank_step_s = self.rank_step_s[: len(self.history)]

    def median_step_s(self) -> float:
        times = sorted(self.step_times)
        return times[len(times) // 2] if times else 0.0

    def record(
        self,
        per_rank: list[list[StepMetrics]],
        *,
        global_batch_size: int,
        steps: int,
        data: dict[str, float] | None = None,
        spares: int = 0,
        reported: Sequence[bool] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Report | None:
        """Fold one chunk's per-rank metrics (the steps every rank completed) into the
        history; returns its report (None when no step completed). With a pipeline, each row
        also has `data_wait` (the ranks' mean share of the step spent waiting for batches)
        and the pipeline's figures `data` (`data_workers`, `data_samples_per_s`). `spares`:
        the warm spares ready now, for the report. `reported`: which ranks of the world
        `per_rank` are, in rank order, when not every rank reported (a chunk that failed);
        the report's per-rank figures are None for the others, and so is each row's `loss`,
        which is always the mean of the whole world's ranks: such a row has the mean of the
        ranks that did report as `partial_loss`, and those ranks as `reported`. A row also has
        the mean over the ranks of what the loss function reported beside the loss (its
        `stats`), and the last row `extra` (what a driven job's loop reports of its step)."""
        n = len(per_rank[0])
        if n == 0:
            return None
        seconds = sum(m.step_s for m in per_rank[0])
        self.step_times.extend(m.step_s for m in per_rank[0])
        rate = global_batch_size * n / seconds if seconds > 0 else 0.0
        rows = []
        for i in range(n):
            last = extra if i == n - 1 else None  # the loop's report is of its last step
            rows.append(_row(per_rank, i, rate=rate, reported=reported, data=data, extra=last))
            self.rank_step_s.append(tuple(r[i].step_s for r in per_rank))
        self.history.extend(rows)
        self._recovered(first_end=per_rank[0][0].end, world_size=len(per_rank))
        return self._report(
            per_rank,
            rows,
            steps=steps,
            seconds=seconds,
            rate=rate,
            spares=spares,
            reported=reported,
        )

    def _recovered(self, *, first_end: float, world_size: int) -> None:
        """Complete the failures being healed (`healed`): the chunk just recorded began with
        the first step completed after healing, at `first_end`; each gets its `recovery_s` and
        `steps_recomputed`, and a "healed" event."""
        if not self.healing:
            return
        for failure, detected, recomputed in self.healing:
            done = dataclasses.replace(
                failure, recovery_s=first_end - detected, steps_recomputed=recomputed
            )
            self.failures[self.failures.index(failure)] = done
            self.emit("healed", **dataclasses.asdict(done), world_size=world_size)
        self.healing.clear()

    def _report(
        self,
        per_rank: list[list[StepMetrics]],
        rows: list[dict[str, Any]],
        *,
        steps: int,
        seconds: float,
        rate: float,
        spares: int,
        reported: Sequence[bool] | None,
    ) -> Report:
        """The report of the chunk just recorded (`rows`, over `seconds`): the per-rank
        figures at their ranks' places in the world (`_spread`)."""
        n = len(rows)
        step = int(rows[-1]["step"])
        return Report(
            rows=tuple(rows),
            steps=steps,
            samples_per_s=rate,
            eta_s=(steps - step) * seconds / n,
            rank_losses=tuple(m[-1].loss for m in per_rank),
            failures=len(self.failures),
            world_size=len(reported) if reported is not None else len(per_rank),
            rank_step_s=tuple(_spread(t, reported) for t in self.rank_step_s[-n:]),
            rank_loss=tuple(
                _spread(tuple(r[i].loss for r in per_rank), reported) for i in range(n)
            ),
            spares=spares,
        )


def _row(
    per_rank: list[list[StepMetrics]],
    i: int,
    *,
    rate: float,
    reported: Sequence[bool] | None,
    data: dict[str, float] | None,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """The history row of the chunk's step `i` (its keys: `RunLog.record`), in a fixed key
    order: step, loss (partial_loss, reported), samples_per_s, end, eval_loss, perplexity, the
    loss function's stats, data_wait and the pipeline's figures, `extra`."""
    first = per_rank[0][i]
    loss = sum(r[i].loss for r in per_rank) / len(per_rank)
    end = max(r[i].end for r in per_rank)  # wall time the last rank finished it
    row: dict[str, Any] = {"step": first.step, "loss": loss}
    partial = reported is not None and not all(reported)
    if partial:  # a lost rank's figure is gone: the world's mean is unknown
        assert reported is not None
        row.update(
            loss=None,
            partial_loss=loss,
            reported=[r for r, ok in enumerate(reported) if ok],
        )
    row.update(samples_per_s=rate, end=end)
    if first.eval_loss is not None:  # the same on every rank (all-reduced)
        row.update(eval_loss=first.eval_loss, perplexity=_perplexity(first.eval_loss))
    if first.stats and not partial:  # weighed per rank as the loss is: their mean is global
        every = [r[i].stats or {} for r in per_rank]
        row.update({k: sum(s.get(k, 0.0) for s in every) / len(every) for k in first.stats})
    if data is not None:
        row["data_wait"] = _data_wait(per_rank, i)
        row.update(data)
    if extra is not None:
        row.update(extra)
    return row


def _data_wait(per_rank: list[list[StepMetrics]], i: int) -> float:
    """The ranks' mean share of step `i` spent waiting for batches (a rank whose step took no
    time counts as 0, but still in the mean)."""
    waits = [r[i].data_wait_s or 0.0 for r in per_rank]
    return sum(w / r[i].step_s for w, r in zip(waits, per_rank) if r[i].step_s > 0) / len(per_rank)


def _spread(values: tuple[float, ...], reported: Sequence[bool] | None) -> tuple[float | None, ...]:
    """`values`, one per reporting rank, at their ranks' places in the world (None where a
    rank did not report); `values` itself when every rank did (`reported` None)."""
    if reported is None:
        return values
    it = iter(values)
    return tuple(next(it) if r else None for r in reported)


def _perplexity(loss: float) -> float:
    """exp(loss) for a language model's mean token cross-entropy (inf past float range)."""
    return math.exp(loss) if loss < 700 else math.inf
