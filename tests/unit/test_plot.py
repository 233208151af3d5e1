"""The picture `raymesh train` saves of a run (raymesh.train.plot), from a Result made here."""

from __future__ import annotations

from PIL import Image

from raymesh.train.estimate import MemoryEstimate
from raymesh.train.plot import figure, save_picture
from raymesh.train.result import FailureRecord, Result
from raymesh.train.strategy import StrategyDecision


def _result() -> Result:
    steps = range(1, 21)
    return Result(
        history=[{"step": s, "loss": 3.0 / s, "samples_per_s": 100.0, "end": s} for s in steps],
        decision=StrategyDecision(
            strategy="ddp", reason="fits", estimate=MemoryEstimate(0, 0, 0, 0), budget_bytes=1
        ),
        checkpoint=None,
        resumed_from=0,
        transitions=[("Starting", "job"), ("Running", "formed"), ("Healing", "rank 1 died")],
        failures=[
            FailureRecord(
                rank=1, step=8, cause="SIGKILL", kind="died", recovery_s=0.31, steps_recomputed=0
            )
        ],
        # Two ranks, then one after the failure (an elastic job that shrank).
        rank_step_s=[(0.01, 0.02) if s < 8 else (0.012,) for s in steps],
    )


def test_the_picture_shows_the_loss_each_ranks_step_times_and_the_healing():
    fig = figure(_result(), title="job.toml")
    loss_ax, time_ax = fig.axes
    (loss_line,) = [ln for ln in loss_ax.get_lines() if len(ln.get_xdata()) > 2]
    assert list(loss_line.get_ydata())[:2] == [3.0, 1.5]
    ranks = {
        ln.get_label(): len(ln.get_xdata())
        for ln in time_ax.get_lines()
        if ln.get_label()[0] != "_"
    }
    assert ranks == {"rank 0": 20, "rank 1": 7}  # rank 1 ran steps 1-7
    labels = [t.get_text() for t in loss_ax.texts]
    assert labels == ["rank 1 died at step 8, healed in 0.31 s"]
    assert fig.get_suptitle() == "job.toml"


def test_the_picture_is_written_whole_as_png(tmp_path):
    path = save_picture(_result(), tmp_path / "run" / "run.png")
    assert path == tmp_path / "run" / "run.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (990, 660)
    assert list(path.parent.iterdir()) == [path]  # no partial file left behind
