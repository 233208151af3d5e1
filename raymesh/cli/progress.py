"""A live progress bar for training runs: step/total, loss, samples/s, ETA, per-rank losses,
and with a pipeline the ranks' data wait, its preprocessing procs and their samples/s.

On a terminal it redraws one line in place; otherwise (CI logs, pipes) it prints a line at every
10% so that logs stay short.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.live = self.stream.isatty()
        self._last_decile = -1

    def __call__(self, p: dict[str, Any]) -> None:
        step, steps = p["step"], p["steps"]
        done = step / steps if steps else 1.0
        filled = int(self.width * done)
        bar = "#" * filled + "." * (self.width - filled)
        ranks = " ".join(f"r{r['rank']}:{r['loss']:.3f}" for r in p["ranks"])
        loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"  # a failed chunk's: unknown
        line = (
            f"step {step}/{steps} [{bar}] {done:4.0%} loss {loss} "
            f"{p['samples_per_s']:.0f} samples/s ETA {_fmt_eta(p['eta_s'])} | {ranks}"
        )
        if "eval_loss" in p:
            line += f" | eval loss {p['eval_loss']:.4f}"
        if "data_workers" in p:  # a pipeline: the ranks' wait for batches, its procs
            line += (
                f" | data wait {p['data_wait']:.0%}, {p['data_workers']} prep "
                f"{p['data_samples_per_s']:.0f} samples/s"
            )
        if self.live:
            self.stream.write("\r" + line[:200])
            if step >= steps:
                self.stream.write("\n")
        else:
            decile = int(done * 10)
            if decile != self._last_decile or step >= steps:
                self._last_decile = decile
                self.stream.write(line + "\n")
        self.stream.flush()
