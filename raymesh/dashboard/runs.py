"""Run folders as the dashboard reads them: live (a job still appending) and afterwards.

A training job's run folder (`TrainConfig.run_dir`, else its checkpoint folder) holds
`metrics.jsonl` (a row per step) and `events.jsonl` (what happened: states, the strategy, the
placement, the procs, failures and healing), both append-only JSON lines written by
`raymesh.train`'s `RunFolder` sink. A raymesh.tune study's folder holds `results.csv` and its
trials' run folders under `trials/`.

Guarantees:
- reading is incremental and never blocks a writer: each `refresh` reads only what was
  appended since the last, and only whole lines (a line still being written is read next time);
- a line that is not a JSON object, or a row without a step, is skipped and named in the run's
  `warnings` (file, line number and why), never an exception; a number that is not finite
  (NaN, Infinity, a diverged loss, or a literal such as 1e999 or an integer too large for a
  float, which Python reads as infinite) reads as None, so that what the API sends is always
  valid JSON and no one row can break the pages, the API or /metrics;
- a run asked for by id is looked up by name under the root (never outside it: no `..`, no
  absolute path, no hidden folder, no link that leads out of the root), so an unknown id costs
  a few `stat` calls, not a walk of the root; the root is walked at most every couple of
  seconds whatever is asked;
- a step trained again (after healing from a checkpoint, or a resumed run) replaces the rows
  from that step on, so `rows` is always in step order without repeats.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["JsonLines", "Run", "Runs", "Study"]

logger = logging.getLogger("raymesh.dashboard")

METRICS, EVENTS = "metrics.jsonl", "events.jsonl"
_MAX_DEPTH = 4  # how deep under the root run folders are looked for (a study's trials are 2)
_RESCAN_S = 2.0  # how often the root is looked at again for new run folders


class JsonLines:
    """An append-only JSON-lines file read incrementally (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # bytes read, up to the end of the last whole line
        self.lineno = 0
        self.warnings: list[str] = []

    def read_new(self) -> list[tuple[int, dict[str, Any]]]:
        """The objects on the whole lines appended since the last call, with their line
        numbers."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # replaced or truncated: read it again from the start
            self.offset = self.lineno = 0
        if size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # a line without its newline is still being written
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            self.lineno += 1
            if not line.strip():
                continue
            try:
                item = json.loads(
                    line, parse_constant=_not_finite, parse_float=_float, parse_int=_int
                )
                if not isinstance(item, dict):
                    raise ValueError(f"a JSON {type(item).__name__}, not an object")
            except ValueError as e:
                self.warn(f"line {self.lineno} is not a JSON object ({e}): skipped")
                continue
            out.append((self.lineno, item))
        return out

    def warn(self, text: str) -> None:
        message = f"{self.path.name} {text}"
        self.warnings.append(message)
        logger.warning("raymesh.dashboard: %s: %s", self.path.parent, message)


class Run:
    """One run folder: its rows, its events, and what they add up to (`summary`)."""

    def __init__(self, id: str, path: Path, study: str | None = None) -> None:
        self.id = id
        self.path = path
        self.study = study
        self.metrics = JsonLines(path / METRICS)
        self.events_file = JsonLines(path / EVENTS)
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []

    @property
    def warnings(self) -> list[str]:
        return self.metrics.warnings + self.events_file.warnings

    def refresh(self) -> bool:
        """Read what was appended; True when anything was."""
        rows = self.metrics.read_new()
        events = self.events_file.read_new()
        for line, row in rows:
            step, loss = row.get("step"), row.get("loss", 0.0)
            if not isinstance(step, int | float) or not isinstance(loss, int | float | None):
                self.metrics.warn(f"line {line}: a row needs a numeric step and loss: skipped")
                continue
            while self.rows and self.rows[-1]["step"] >= step:  # trained again from `step`
                self.rows.pop()
            self.rows.append(row)
        for line, event in events:
            if not isinstance(event.get("event"), str) or not isinstance(
                event.get("t"), int | float
            ):
                self.events_file.warn(f"line {line}: an event needs its name and time: skipped")
                continue
            self.events.append(event)
        return bool(rows or events)

    def last(self, name: str) -> dict[str, Any] | None:
        """The newest event called `name`."""
        return next((e for e in reversed(self.events) if e["event"] == name), None)

    def status(self) -> str:
        """ "finished", "failed" or "stopped" (the job said so), "running" (its controller is
        alive or on another host), "interrupted" (its controller on this host is gone without
        a word), or "unknown" (a folder without events: written before raymesh recorded
        them)."""
        end, job = self.last("end"), self.last("job")
        if end is not None and (job is None or end["t"] >= job["t"]):
            return str(end.get("state", "finished")).lower()
        if job is None:
            return "unknown"
        if job.get("host") == socket.gethostname() and not _alive(job.get("pid")):
            return "interrupted"
        return "running"

    def summary(self) -> dict[str, Any]:
        """What the runs page shows of it (docs/dashboard.md, "Summary")."""
        job = self.last("job") or {}
        strategy = self.last("strategy") or {}
        row = self.rows[-1] if self.rows else {}
        files = (self.metrics.path, self.events_file.path)
        times = [p.stat().st_mtime for p in files if p.exists()]
        return {
            "id": self.id,
            "name": job.get("name") or self.path.name,
            "path": str(self.path),
            "status": self.status(),
            "step": int(row.get("step", 0)),
            "steps": job.get("steps"),
            "loss": row.get("loss"),
            "eval_loss": next(
                (r["eval_loss"] for r in reversed(self.rows) if "eval_loss" in r), None
            ),
            "samples_per_s": row.get("samples_per_s"),
            "kind": job.get("kind", "train"),  # "rl": a raymesh.rl run
            "reward": next(  # an RL run's newest (a row healed late may have none)
                (
                    r.get("reward_mean", r.get("episode_return_mean"))
                    for r in reversed(self.rows)
                    if "reward_mean" in r or "episode_return_mean" in r
                ),
                None,
            ),
            "failures": sum(e["event"] == "failure" for e in self.events),
            "world_size": row.get("world_size"),
            "spares": row.get("spares"),
            "strategy": strategy.get("strategy"),
            "started": job.get("t", self.events[0]["t"] if self.events else None),
            "updated": max(times, default=None),
            "study": self.study,
            "warnings": len(self.warnings),
        }


class Study:
    """A raymesh.tune study's folder: its trials from results.csv, each with its run."""

    def __init__(self, id: str, path: Path) -> None:
        self.id = id
        self.path = path

    def describe(self, runs: dict[str, Run]) -> dict[str, Any]:
        trials: list[dict[str, Any]] = []
        warning = None
        try:
            with (self.path / "results.csv").open(newline="") as f:
                trials = list(csv.DictReader(f))
        except (OSError, csv.Error, UnicodeDecodeError) as e:
            warning = f"{self.path / 'results.csv'}: cannot be read ({e})"
        by_path: dict[Path | None, str] = {r.path.resolve(): r.id for r in runs.values()}
        for t in trials:
            t["run"] = by_path.get(_resolved(t.get("dir")))
        return {
            "id": self.id,
            "name": self.path.name,
            "trials": trials,
            "warning": warning,
        }


class Runs:
    """The run folders under `root` (or `root` itself, when it is one), found again as new
    ones appear. Not thread-safe: the dashboard reads it from its event loop only."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.runs: dict[str, Run] = {}
        self.studies: dict[str, Study] = {}
        self.problems: list[str] = []
        self._scanned = 0.0

    def scan(self, *, force: bool = False) -> None:
        """Look for run folders again (at most every couple of seconds unless `force`)."""
        if not force and time.monotonic() - self._scanned < _RESCAN_S:
            return
        self._scanned = time.monotonic()
        self.problems = []
        if not self.root.is_dir():
            self.problems.append(
                f"{self.root}: no such folder (anymore); start the dashboard on a folder that "
                "holds run folders, e.g. `raymesh dashboard runs/`"
            )
            return
        for path, study in _walk(self.root):
            id = _id(self.root, path)
            if path.joinpath("results.csv").is_file() and not _is_run(path):
                self.studies.setdefault(id, Study(id, path))
            elif id not in self.runs:
                self.runs[id] = Run(id, path, study)

    def get(self, id: str) -> Run | None:
        """The run `id`, read up to now; None when there is no such run folder. An id not seen
        yet is looked up by name (`find`): asking for ids that do not exist never walks the
        root."""
        run = self.runs.get(id)
        if run is None:
            run = self.find(id)
        if run is None or not run.path.is_dir():
            return None
        run.refresh()
        return run

    def find(self, id: str) -> Run | None:
        """The run folder `id` under the root, found by its name alone where the walk would
        find it: each part a visible folder name (no `..`, `.`, empty or hidden part, so no
        absolute path), at most `_MAX_DEPTH` deep, not inside another run folder, and still
        under the root once links are resolved. None otherwise."""
        if _is_run(self.root):  # the root is the one run: its id is its own name
            if id != _id(self.root, self.root):
                return None
            run = self.runs[id] = Run(id, self.root)
            return run
        parts = id.split("/")
        if len(parts) > _MAX_DEPTH or "\0" in id or any(not p or p[0] in "._" for p in parts):
            return None
        path, study = self.root, None
        try:
            root = self.root.resolve(strict=True)
            for part in parts[:-1]:
                path = path / part
                if not path.is_dir() or _is_run(path):  # the walk stops at a run folder
                    return None
                if (path / "results.csv").is_file():
                    study = _id(self.root, path)
            path = path / parts[-1]
            if not path.is_dir() or not _is_run(path):
                return None
            if not path.resolve(strict=True).is_relative_to(root):  # a link out of the root
                return None
        except (OSError, ValueError, RuntimeError):  # gone meanwhile, a link loop
            return None
        run = self.runs[id] = Run(id, path, study)
        return run

    def listing(self) -> dict[str, Any]:
        """Every run's summary and every study (the runs page)."""
        self.scan()
        summaries = []
        for run in self.runs.values():
            if run.path.is_dir():
                run.refresh()
                summaries.append(run.summary())
        summaries.sort(key=lambda s: s["started"] or 0, reverse=True)
        return {
            "root": str(self.root.resolve()),
            "runs": summaries,
            "studies": [s.describe(self.runs) for s in self.studies.values()],
            "problems": self.problems,
        }


def _is_run(path: Path) -> bool:
    return (path / METRICS).is_file() or (path / EVENTS).is_file()


def _walk(root: Path) -> list[tuple[Path, str | None]]:
    """Run folders and study folders under `root`, each run with the study it belongs to. A
    run folder's own subfolders (checkpoints, TensorBoard) are not looked into, nor a link to
    a folder outside the root (the dashboard shows what is under its root, and nothing else)."""
    try:
        resolved = root.resolve(strict=True)
    except (OSError, RuntimeError):
        return []
    out: list[tuple[Path, str | None]] = []
    todo: list[tuple[Path, int, str | None]] = [(root, 0, None)]
    while todo:
        path, depth, study = todo.pop()
        if _is_run(path):
            out.append((path, study))
            continue
        if (path / "results.csv").is_file():
            out.append((path, None))
            study = _id(root, path)
        if depth >= _MAX_DEPTH:
            continue
        try:
            children = sorted(
                p
                for p in path.iterdir()
                if p.is_dir() and p.name[0] not in "._" and _inside(p, resolved)
            )
        except OSError:  # unreadable, or gone meanwhile
            continue
        todo.extend((p, depth + 1, study) for p in reversed(children))
    return out


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` (a folder under the resolved `root`, or a link there) stays inside it."""
    if not path.is_symlink():
        return True
    try:
        return path.resolve(strict=True).is_relative_to(root)
    except (OSError, RuntimeError):  # gone meanwhile, a link loop
        return False


def _not_finite(name: str) -> None:
    """NaN and +-Infinity (a diverged loss) read as None: JSON has no such numbers, so the
    browser could not parse a page that passed them on (and Starlette refuses to send them)."""
    return None


def _float(text: str) -> float | None:
    """A JSON number with a fraction or exponent; None where it is not finite (1e999)."""
    value = float(text)
    return value if math.isfinite(value) else None


def _int(text: str) -> int | None:
    """A JSON integer; None where a float cannot hold it (it would be infinite in the pages,
    in /metrics, and as a step). Python's own limit on digits still refuses a line of
    thousands of them, as a line that is not JSON."""
    value = int(text)
    try:
        float(value)
    except OverflowError:
        return None
    return value


def _resolved(folder: Any) -> Path | None:
    """A trial's folder as written in results.csv, resolved; None where it names none (empty,
    or a cell no path can be: a NUL byte, a link loop)."""
    if not isinstance(folder, str) or not folder:
        return None
    try:
        return Path(folder).resolve()
    except (OSError, ValueError, RuntimeError):
        return None


def _id(root: Path, path: Path) -> str:
    rel = path.relative_to(root).as_posix()
    return path.name if rel == "." else rel


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
