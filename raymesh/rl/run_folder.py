"""An RL run's folder (`rl.run(run_dir=...)`), laid out as raymesh.train's, so `raymesh
dashboard` shows an RL run as it shows a training job, live:
- `metrics.jsonl`: a JSON line per step, `step` (the policy version) and `end` (the time it
  ended) beside the step's statistics; NaN as null (JSON has no NaN);
- `events.jsonl`: what happened: "job" (name, pid, host, steps, kind "rl", the algorithm),
  "state" (Running, then how it ended, with the reason) and "end".

Each line is written whole (a reader that keeps complete lines never sees a torn one). A run
starting at version v (0 for a fresh start, or one resumed before any checkpoint) first drops
the metrics lines of the steps after v (and a line torn by the crash): it makes those steps
again, so each step keeps one line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from raymesh._common import append_lines, replace_text
from raymesh.rl.algorithms import Stats

__all__ = ["RunFolder"]

METRICS, EVENTS = "metrics.jsonl", "events.jsonl"


class RunFolder:
    """The run folder `dir` of an RL run of `steps` steps with `algorithm` (its name),
    starting at version `start` (0, or the version it resumed from)."""

    def __init__(self, dir: Path, *, steps: int, algorithm: str, start: int) -> None:
        self.dir = dir
        self.step = start
        metrics = dir / METRICS
        # Also at version 0: a controller that died after its first step's line and before
        # that step's checkpoint resumes from nothing and makes the step again.
        if metrics.exists():
            kept = []
            for line in metrics.read_text().splitlines():
                try:
                    if int(json.loads(line)["step"]) <= start:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):  # torn by the crash
                    continue
            replace_text(metrics, "".join(kept))
        self._event(
            "job",
            name=dir.name,
            pid=os.getpid(),
            host=socket.gethostname(),
            steps=steps,
            kind="rl",
            algorithm=algorithm,
        )
        reason = f"resumed from version {start}" if start else "started"
        self._event("state", state="Running", reason=reason, step=start)

    def __call__(self, stats: Stats) -> None:
        """Append a step's statistics."""
        self.step = int(stats["version"])
        row: dict[str, Any] = {"step": self.step, "end": time.time()}
        row.update({k: (v if math.isfinite(v) else None) for k, v in stats.items()})
        append_lines(self.dir / METRICS, json.dumps(row) + "\n")

    def end(self, state: str, reason: str) -> None:
        """The run ended: "Finished" or "Failed", for `reason`."""
        self._event("state", state=state, reason=reason, step=self.step)
        self._event("end", state=state, reason=reason, step=self.step)

    def _event(self, event: str, /, **data: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **data})
        append_lines(self.dir / EVENTS, line + "\n")
