"""What a job tells as it goes: each chunk's metrics, folded into the `RunLog` and reported to
every sink, and the events that say what runs ("job") and where the ranks are ("placement",
"mesh").

The controller hands it what the ranks answered; it never reaches into the ranks itself, and
it moves the world's step only through the step it returns.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raymesh.data.workers import Workers
from raymesh.train.config import TrainConfig
from raymesh.train.control import detection
from raymesh.train.control.member import Rank
from raymesh.train.control.placement import Placer
from raymesh.train.control.ranks import RankPool
from raymesh.train.control.states import FailedChunk
from raymesh.train.protocol import ChunkResult, StepMetrics
from raymesh.train.result import RunLog

__all__ = ["Reporter"]


class Reporter:
    """Reports a job's progress to its sinks (see the module docstring)."""

    def __init__(
        self,
        log: RunLog,
        pool: RankPool,
        *,
        global_batch_size: int,
        steps: int,
        data: Workers | None = None,
    ) -> None:
        self.log = log  # and its sinks
        self.pool = pool
        self.global_batch_size = global_batch_size
        self.steps = steps
        self.data = data
        self.told_spares = -1  # spares in the newest "mesh" event

    def job(self, config: TrainConfig, labels: dict[str, Any]) -> None:
        """The "job" event: what runs, from where (the controller's pid and host), with
        `labels` (a driven job's loop's kind of run, e.g. raymesh.rl's "kind": "rl")."""
        run_dir = config.run_folder()
        self.log.emit(
            "job",
            name=Path(run_dir).name if run_dir else "train",
            pid=os.getpid(),
            host=socket.gethostname(),
            steps=config.steps,
            workers=[config.min_workers, config.max_workers],
            global_batch_size=config.global_batch_size,
            spares=config.spares,
            report_every=config.report_every,
            **labels,
        )

    def record(
        self,
        per_rank: list[tuple[StepMetrics, ...]],
        reported: list[bool] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int | None:
        """Fold one chunk's per-rank metrics into the log and report it to every sink
        (`reported`: which ranks `per_rank` are, when not all; see `RunLog.record`); the step
        it reached, or None when no step completed. The procs are told again when the spares
        ready changed (the recruiter refills them). `extra`: a driven job's loop's figures of
        the chunk's step, added to its row. A sink's exception propagates: it ends
        the job (raymesh.tune prunes a trial that way)."""
        report = self.log.record(
            [list(m) for m in per_rank],
            global_batch_size=self.global_batch_size,
            steps=self.steps,
            data=self.data.figures() if self.data is not None else None,
            spares=self.pool.ready(),
            reported=reported,
            extra=extra,
        )
        if report is None:
            return None
        if report.spares != self.told_spares:
            self.mesh()
        for sink in self.log.sinks:
            sink.on_report(report)
        return report.step

    def record_late(
        self,
        chunk: FailedChunk,
        survivors: list[int],
        *,
        since: int,
        upto: int,
        figures: Callable[[int], dict[str, Any] | None],
    ) -> int | None:
        """Record the steps in (`since`, `upto`] that the restored state holds but were not
        recorded when the chunk failed, from the survivors that completed them: a survivor can
        complete a step its peers failed in (one gloo rank's collective can end before a lost
        peer breaks the others'), and survivors stuck in a collective with a hung rank answer
        once it is killed, with the steps they completed before it hung. `figures(step)`: a
        driven job's loop's figures of 0-based `step`, for the last row. The step reached, if
        any."""
        late = [i for i in survivors if isinstance(chunk.results[i], TimeoutError)]
        replies = (
            dict(zip(late, detection.settle([chunk.replies[i] for i in late], 1.0)))
            if late and chunk.replies
            else {}
        )
        new = {
            i: [m for m in r.metrics if since < m.step <= upto]
            for i in survivors
            if isinstance(r := replies.get(i, chunk.results[i]), ChunkResult)
        }
        most = max((len(m) for m in new.values()), default=0)
        if not most:
            return None
        # the ranks that completed them all: the restored state is the furthest survivor's
        who = [len(new.get(i, ())) == most for i in range(len(chunk.results))]
        rows = [tuple(new[i]) for i in sorted(new) if who[i]]
        return self.record(rows, reported=who, extra=figures(rows[0][-1].step - 1))

    def mesh(self, snapshot: dict[str, Any] | None = None) -> None:
        """The "mesh" event: the procs of the ranks and the spares now (`snapshot`: as just
        taken)."""
        snapshot = snapshot or self.pool.snapshot()
        self.told_spares = len(snapshot["spares"])
        self.log.emit("mesh", **snapshot)

    def placement(self, ranks: list[Rank], placer: Placer) -> None:
        """The "placement" event: each host's ranks, why (the topology plan, on several
        hosts), and the topology it was planned on (links and measured latencies); then the
        procs ("mesh")."""
        hosts: dict[str, list[int]] = {}
        for i, r in enumerate(ranks):
            hosts.setdefault(r.node_id, []).append(i)
        snapshot = self.pool.snapshot()
        names = {p["node_id"]: p["host"] for p in snapshot["ranks"]}
        topo = placer.topology
        self.log.emit(
            "placement",
            reason=placer.reason,
            hosts=[{"node_id": n, "host": names[n], "ranks": rs} for n, rs in hosts.items()],
            topology=topo.to_dict() if topo is not None else None,
        )
        self.mesh(snapshot)
