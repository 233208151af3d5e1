"""Reporting: what each chunk of training reports, and the sinks that receive it.

The controller folds each chunk's per-rank `StepMetrics` into one `Report` and hands it to every
`ReportSink` (shaped like Ray Train's `ReportCallback`): the metrics file, TensorBoard, the
`progress` callable that the CLI draws its bar from, and whatever subscribes later (the
dashboard, a tuning trial). Sinks run in the controller, after the ranks have moved on to the
next chunk, so a slow sink never holds training back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from raymesh.train.config import TrainConfig

__all__ = ["MetricsFile", "Progress", "Report", "ReportSink", "TensorBoard", "sinks"]


@dataclass(frozen=True)
class Report:
    """One reported chunk of training."""

    # One row per step of the chunk: step (1-based), loss (mean of ranks), samples_per_s,
    # end (wall time the step was complete on every rank).
    rows: tuple[dict[str, float], ...]
    steps: int  # the job's total steps
    samples_per_s: float  # over the chunk
    eta_s: float  # the time the remaining steps take at the chunk's pace
    rank_losses: tuple[float, ...]  # each rank's loss at the chunk's last step
    failures: int  # failures so far
    world_size: int

    @property
    def step(self) -> int:
        return int(self.rows[-1]["step"])

    def progress(self) -> dict[str, Any]:
        """The plain dict that `fit(progress=...)` callables receive."""
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
        }


class ReportSink(Protocol):
    """Receives every report, in order, in the controller's process."""

    def on_report(self, report: Report) -> None: ...


class MetricsFile:
    """Appends one JSON line per step to `path` (metrics.jsonl)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_report(self, report: Report) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for row in report.rows:
                f.write(json.dumps(row) + "\n")


class TensorBoard:
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
            self.writer.add_scalar("loss", row["loss"], int(row["step"]))
            self.writer.add_scalar("samples_per_s", report.samples_per_s, int(row["step"]))
        self.writer.flush()


class Progress:
    """Calls `fn` with `Report.progress()` (the CLI's progress bar, `fit(progress=...)`)."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_report(self, report: Report) -> None:
        self.fn(report.progress())


def sinks(config: TrainConfig, progress: Callable[[dict[str, Any]], None] | None) -> list[Any]:
    """The sinks a job's config asks for: metrics.jsonl and TensorBoard in the run folder
    (`run_dir`, else the checkpoint folder), and the progress callable."""
    out: list[ReportSink] = []
    run_dir = config.run_dir or (config.checkpoint.dir if config.checkpoint else None)
    if run_dir:
        out.append(MetricsFile(Path(run_dir) / "metrics.jsonl"))
        board = TensorBoard.open(Path(run_dir) / "tensorboard")
        if board is not None:
            out.append(board)
    if progress is not None:
        out.append(Progress(progress))
    return out
