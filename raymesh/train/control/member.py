"""`Rank`: one member of a job's world (or a spare), as the controller holds it: its trainer,
the monitor beside it and its proc. The rank pool (`ranks`) makes them, the world forms from
them, and `WarmRanks` (`warm`) keeps them between jobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from raymesh.actor import ProcMesh
from raymesh.train.rank.monitor import Monitor
from raymesh.train.rank.worker import TrainWorker

logger = logging.getLogger("raymesh")

__all__ = ["Rank"]


@dataclass(eq=False)
class Rank:
    """One member of the world (or a spare): its trainer, the monitor beside it, its proc."""

    worker: Any  # ActorMesh of one TrainWorker
    monitor: Any  # ActorMesh of one Monitor, on the same proc
    procs: ProcMesh  # a mesh of this one proc, with its own placement group
    node_id: str
    fed: int = -1  # the pipeline workers' generation its trainer last heard (raymesh.data)

    def alive(self) -> bool:
        return self.procs.failure is None

    def label(self) -> str:
        """Its proc, for people: "spare-3 (pid 4242)"."""
        return f"{self.procs.name} (pid {self.procs.pids[0]})"

    def describe(self, rank: int | None, hosts: dict[str, str]) -> dict[str, Any]:
        """Its proc as plain data (the "mesh" event): `rank` in the world (None: a spare),
        its mesh, pid, host (`hosts`: node id -> name), state, and the actors on it."""
        failure = self.procs.failure
        state = "alive" if failure is None else "stopped" if failure.kind == "stopped" else "dead"
        return {
            "rank": rank,
            "mesh": self.procs.name,
            "pid": self.procs.pids[0],
            "node_id": self.node_id,
            "host": hosts.get(self.node_id, self.node_id[:12]),
            "state": state,
            "actors": [TrainWorker.__name__, Monitor.__name__],
        }

    def stop(self, *, kill: bool = False) -> None:
        """End the proc and release its resources (it may already be dead). `kill`: SIGKILL
        it first, for a rank that raised or hung (its trainer may never return)."""
        try:
            if kill:
                self.procs.kill()
            self.procs.stop(timeout=10.0)
        except Exception as e:  # its resources are released either way
            logger.debug("raymesh.train: stopping %s: %s", self.procs.name, e)
