"""A picture of a finished training run: the loss, each rank's step time, the healing events.

`raymesh train` saves it as `run.png` next to `metrics.jsonl`. It needs matplotlib
(`pip install "raymesh[tune]"`); `figure` raises ImportError naming that extra without it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from raymesh.train.result import Result

__all__ = ["figure", "save_picture"]


def figure(result: Result, title: str = "") -> Any:
    """A matplotlib Figure of `result`:
    - the top panel shows the loss per step;
    - the bottom panel shows each rank's step time;
    - each failure is a red line at its step, labelled with its rank, its kind, and how long
      healing took."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: the picture goes to a file
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('the run picture needs matplotlib: pip install "raymesh[tune]"') from None
    fig = Figure(figsize=(9, 6), layout="constrained")
    loss_ax, time_ax = fig.subplots(2, 1, sharex=True)
    steps = [h["step"] for h in result.history]
    losses = [math.nan if h["loss"] is None else h["loss"] for h in result.history]
    loss_ax.plot(steps, losses, color="tab:blue", lw=1.2)  # a failed chunk's rows: a gap
    loss_ax.set_ylabel("loss (mean of ranks)")
    ranks = max((len(t) for t in result.rank_step_s), default=0)
    for r in range(ranks):
        points = [
            (s, 1e3 * t[r]) for s, t in zip(steps, result.rank_step_s, strict=False) if r < len(t)
        ]
        time_ax.plot(*zip(*points, strict=True), lw=0.8, label=f"rank {r}")
    time_ax.set_ylabel("step time (ms)")
    time_ax.set_xlabel("step")
    if ranks:
        time_ax.legend(loc="upper right", fontsize="small", ncol=min(ranks, 8))
    for f in result.failures:
        healed = f"healed in {f.recovery_s:.2f} s" if f.recovery_s is not None else "not healed"
        for ax in (loss_ax, time_ax):
            ax.axvline(f.step, color="tab:red", ls="--", lw=1)
        loss_ax.annotate(
            f"rank {f.rank} {f.kind} at step {f.step}, {healed}",
            (f.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12),
            textcoords="offset points",
            color="tab:red",
            fontsize="small",
        )
    fig.suptitle(title or f"{result.decision.strategy}, {len(steps)} steps")
    return fig


def save_picture(result: Result, path: str | Path, title: str = "") -> Path:
    """Writes `figure(result)` to `path` as PNG (atomically: a reader never sees half a
    file) and returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    figure(result, title).savefig(partial, format="png", dpi=110)
    partial.replace(path)
    return path
