"""The client procs of a run, by index, and their replacement.

A proc that fails during a round (it died, or did not answer a step in time) is noted with
`lose`, and all its clients are dropped from that round; `replace_lost`, after the round, kills
it and starts another in its place, under the same index. So a round never waits for a proc to
start, and the other procs keep the clients they have built. A proc noted lost takes no more
work in its round (`live`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from raymesh.federated.simulation.host import HostProc

__all__ = ["HostPool"]

logger = logging.getLogger("raymesh.federated")


class HostPool:
    """spawn(index): starts the host proc `index` (the run's `Federation._spawn`)."""

    def __init__(self, spawn: Callable[[int], HostProc]) -> None:
        self._spawn = spawn
        self.hosts: list[HostProc] = []
        self._lost: set[int] = set()

    def start(self, n: int) -> None:
        """Start hosts 0..n-1, in parallel; raises what a failed start raised."""
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            self.hosts = list(pool.map(self._spawn, range(n)))

    def lose(self, index: int) -> None:
        """Host `index` failed: it is replaced after the round."""
        self._lost.add(index)

    def live(self) -> list[HostProc]:
        """The hosts not lost in this round."""
        return [h for h in self.hosts if h.index not in self._lost]

    def replace_lost(self) -> int:
        """Replace every host lost since the last call; returns how many."""
        lost, self._lost = sorted(self._lost), set()
        for i in lost:
            old = self.hosts[i]
            try:
                old.procs.kill()
            except Exception:
                pass
            self.hosts[i] = self._spawn(i)
            logger.warning(
                "raymesh.federated: client proc %d replaced (pid %d -> %d)",
                i,
                old.pid,
                self.hosts[i].pid,
            )
        return len(lost)

    def stop(self) -> None:
        for h in self.hosts:
            h.stop()
