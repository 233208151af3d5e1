"""Reporting: what each chunk of training reports, what happens to the job, and the sinks that
receive both.

The controller folds each chunk's per-rank `StepMetrics` into one `Report`, and records what
happens to the job (a state entered, the strategy and placement decided, a rank lost, a
failure healed, the procs after a change) as an `Event`; it hands both to every `ReportSink`
(shaped like Ray Train's `ReportCallback`): the run folder (`metrics.jsonl`, `events.jsonl`:
what raymesh.dashboard reads, live and afterwards), TensorBoard, the `progress` callable that
the CLI draws its bar from. Sinks run in the controller, after the ranks have moved on to the
next chunk, so a slow sink never holds training back.

The run folder's files are append-only JSON lines, each written whole with one `write`: a
reader that keeps only complete lines never sees a torn record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymesh._common import append_lines

__all__ = [
    "JOB_EVENTS",
    "Event",
    "Progress",
    "Report",
    "ReportSink",
    "RunFolder",
    "TensorBoard",
    "sinks",
]


@dataclass(frozen=True)
class Report:
    """One reported chunk of training."""

    # One row per step of the chunk: step (1-based), loss (mean of the world's ranks; None in
    # a failed chunk's rows, which carry partial_loss and the ranks reported instead),
    # samples_per_s, end (wall time the step was complete on every rank).
    rows: tuple[dict[str, Any], ...]
    steps: int  # the job's total steps
    samples_per_s: float  # over the chunk
    eta_s: float  # the time the remaining steps take at the chunk's pace
    rank_losses: tuple[float, ...]  # each rank's loss at the chunk's last step
    failures: int  # failures so far
    world_size: int
    # Per row, each rank's step seconds and loss, in rank order (None: the rank did not
    # report this chunk, which failed).
    rank_step_s: tuple[tuple[float | None, ...], ...] = ()
    rank_loss: tuple[tuple[float | None, ...], ...] = ()
    spares: int = 0  # warm spares ready when the chunk was recorded

    @property
    def step(self) -> int:
        return int(self.rows[-1]["step"])

    def progress(self) -> dict[str, Any]:
        """The plain dict that `fit(progress=...)` callables receive (with `eval_loss` when
        the chunk evaluated)."""
        evals = [r["eval_loss"] for r in self.rows if "eval_loss" in r]
        return {
            "step": self.step,
            "steps": self.steps,
            "loss": self.rows[-1]["loss"],
            "samples_per_s": self.samples_per_s,
            "eta_s": self.eta_s,
            "ranks": [{"rank": r, "loss": loss} for r, loss in enumerate(self.rank_losses)],
            "failures": self.failures,
            "world_size": self.world_size,
            **{k: v for k, v in self.rows[-1].items() if k.startswith("data_")},
            **({"eval_loss": evals[-1]} if evals else {}),
        }


# The events a job writes itself (see `Event`); a driven job's loop adds its own (`tell`).
JOB_EVENTS = frozenset(
    {"job", "state", "end", "strategy", "placement", "mesh", "failure", "healed", "rebalance"}
)


@dataclass(frozen=True)
class Event:
    """Something that happened to the job, as one line of events.jsonl: `{"t", "event", ...}`.

    `name` and its data (docs/dashboard.md lists every field):
      - "job": name, pid, host, steps, workers, global_batch_size, spares, report_every
      - "state": state, reason, step (a state entered; "end" too for Finished, Failed, Stopped)
      - "strategy": the decision with its memory arithmetic; "placement": ranks on hosts
      - "mesh": the procs of the ranks and spares (pid, host, state, actors)
      - "failure": a rank lost (rank, step, kind, cause); "healed": how, and how long it took
      - "rebalance": a new split of the global batch
    """

    name: str
    data: dict[str, Any]
    t: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.name, **self.data}


class ReportSink:
    """Receives every report and event, in order, in the controller's process. A sink
    overrides what it wants; the rest are no-ops."""

    def on_report(self, report: Report) -> None:
        pass

    def on_event(self, event: Event) -> None:
        pass


class RunFolder(ReportSink):
    """The run folder: one JSON line per step in metrics.jsonl (the history's row with the
    world size, the spares ready, and each rank's step seconds and loss), one per event in
    events.jsonl."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.metrics = dir / "metrics.jsonl"
        self.events = dir / "events.jsonl"

    def on_report(self, report: Report) -> None:
        lines = []
        for i, row in enumerate(report.rows):
            out: dict[str, Any] = {**row, "world_size": report.world_size, "spares": report.spares}
            if report.rank_step_s:
                out["rank_step_s"] = list(report.rank_step_s[i])
                out["rank_loss"] = list(report.rank_loss[i])
            lines.append(json.dumps(out) + "\n")
        append_lines(self.metrics, "".join(lines))

    def on_event(self, event: Event) -> None:
        append_lines(self.events, json.dumps(event.to_json(), default=str) + "\n")


class TensorBoard(ReportSink):
    """Loss and throughput per step, as TensorBoard scalars in `dir`."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, dir: Path) -> TensorBoard | None:
        """A sink writing to `dir` when TensorBoard is installed, else None."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional; metrics.jsonl has everything
            return None
        return cls(SummaryWriter(str(dir)))

    def on_report(self, report: Report) -> None:
        for row in report.rows:
            if row["loss"] is not None:  # a failed chunk's row: the world's mean is unknown
                self.writer.add_scalar("loss", row["loss"], int(row["step"]))
            self.writer.add_scalar("samples_per_s", report.samples_per_s, int(row["step"]))
        self.writer.flush()


class Progress(ReportSink):
    """Calls `fn` with `Report.progress()` (the CLI's progress bar, `fit(progress=...)`)."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_report(self, report: Report) -> None:
        self.fn(report.progress())


def sinks(
    run_dir: str | None, progress: Callable[[dict[str, Any]], None] | None
) -> list[ReportSink]:
    """The sinks a job asks for: its run folder (`TrainConfig.run_folder()`), with TensorBoard
    in it, and the progress callable."""
    out: list[ReportSink] = []
    if run_dir:
        out.append(RunFolder(Path(run_dir)))
        board = TensorBoard.open(Path(run_dir) / "tensorboard")
        if board is not None:
            out.append(board)
    if progress is not None:
        out.append(Progress(progress))
    return out
