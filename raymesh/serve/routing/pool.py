"""The replica pool: the replicas a server runs, each with what it is doing, kept at a target.

Each replica computes one batch at a time, or up to its `max_streams` token streams (one where
its model cannot batch them), never both: a `Slot` says whether it is busy with a batch, how
many streams it holds, and whether it is held out of rotation (reloading, retiring). The pool
guarantees:
- a replica lost (its proc died, or it was killed for running past `request_timeout_s`) leaves
  the pool at once, is stopped, and counts in `replaced`; the next `maintain` starts another;
- `maintain` starts replicas until the count, less those retiring, plus those starting, reaches
  `target`, but not while it backs off after a failed start (2, 4, 8... up to 30 s);
- a retiring replica leaves when it is idle, never with a batch or a stream in flight;
- each replica that joins is handed to `on_ready` with the spec it loaded, which is not `spec`
  when the weights changed while it started (the reloader sets `spec`).

Starting and stopping procs blocks, so it runs on the pool's threads (`blocking`); the event
loop never waits on a replica.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelInfo, ModelSpec
from raymesh.serve.routing.replica import ReplicaProc
from raymesh.serve.sections import ReplicaConfig

logger = logging.getLogger("raymesh.serve")

__all__ = ["ReplicaPool", "Slot", "wait_reply"]


@dataclass(eq=False)
class Slot:
    """A ready replica and what it is doing."""

    replica: ReplicaProc
    busy: bool = False  # computing a batch
    held: bool = False  # taken out of rotation (reloading, retiring)
    retiring: bool = False
    streams: int = 0  # token streams it decodes now

    @property
    def working(self) -> bool:
        """Computing a batch or decoding a stream."""
        return self.busy or self.streams > 0

    @property
    def max_streams(self) -> int:
        """The streams its replica decodes at once (what it reported)."""
        return self.replica.info.max_streams


class ReplicaPool:
    """config: how many replicas (`min` at the start) and how each starts; start_replica: how a
    replica starts, `spawn_replica`'s signature (tests pass a fake);
    spawn: runs a coroutine as a task of the server's (cancelled when it stops); on_ready: sees
    each replica that joins, with the spec it loaded."""

    def __init__(
        self,
        spec: ModelSpec,
        config: ReplicaConfig,
        metrics: Metrics,
        *,
        start_replica: Callable[..., ReplicaProc],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        on_ready: Callable[[Slot, ModelSpec], None],
    ) -> None:
        self.spec = spec  # what a replica started now loads
        self.config = config
        self.metrics = metrics
        self.slots: list[Slot] = []
        self.target = config.replicas.min
        self.info: ModelInfo | None = None  # the first replica's, for the front
        self.replaced = 0  # replicas lost and replaced
        self.starting = 0
        self._start_replica = start_replica
        self._spawn = spawn
        self._on_ready = on_ready
        self._start_failures = 0
        self._backoff_until = 0.0
        self._names = itertools.count()
        self._threads = ThreadPoolExecutor(
            config.replicas.max + 2, thread_name_prefix="raymesh-serve"
        )
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the pool to the server's event loop (before any other call)."""
        self._loop = loop

    def blocking(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """`fn()` on the pool's threads."""
        return self._loop.run_in_executor(self._threads, fn)

    # ---- what the replicas are doing ---------------------------------------------------------
    def free(self) -> Slot | None:
        """A replica doing nothing, for a batch."""
        for slot in self.slots:
            if not (slot.working or slot.held):
                return slot
        return None

    def for_stream(self) -> Slot | None:
        """The replica with room for one more stream that holds the fewest (streams spread
        over the replicas: each decodes its own batch, on its own CPUs)."""
        room = [
            s for s in self.slots if not (s.busy or s.held) and s.streams < s.max_streams
        ]  # fmt: skip
        return min(room, key=lambda s: s.streams, default=None)

    def idle(self) -> bool:
        """No replica computes anything."""
        return not any(s.working for s in self.slots)

    def live(self) -> int:
        """The replicas that will serve: ready and not retiring, or starting."""
        return len([s for s in self.slots if not s.retiring]) + self.starting

    # ---- in and out --------------------------------------------------------------------------
    async def start_one(self, raise_error: bool = False) -> None:
        self.starting += 1
        name = f"replica{next(self._names)}"
        spec = self.spec
        try:
            replica = await self.blocking(
                functools.partial(
                    self._start_replica,
                    name,
                    spec,
                    cpus=self.config.cpus,
                    gpus=self.config.gpus,
                    timeout=self.config.start_timeout_s,
                    max_streams=self.config.max_streams,
                )
            )
        except Exception as e:
            self._start_failures += 1
            self._backoff_until = time.monotonic() + min(30.0, 2.0**self._start_failures)
            logger.error("raymesh.serve: replica %s failed to start: %s", name, e)
            if raise_error:
                raise
            return
        finally:
            self.starting -= 1
        self._start_failures = 0
        if self._stopping:
            await self.blocking(replica.stop)
            return
        self.info = self.info or replica.info
        slot = Slot(replica)
        self.slots.append(slot)
        self.metrics.replicas.set(len(self.slots))
        logger.info("raymesh.serve: replica %s ready (pid %d)", name, replica.pid)
        self._on_ready(slot, spec)

    def lose(self, slot: Slot, why: str) -> None:
        """`slot`'s replica failed: drop and stop it (once, however many saw it fail)."""
        if slot not in self.slots:
            return
        self.slots.remove(slot)
        self.replaced += 1
        self.metrics.replicas_lost.inc()
        self.metrics.replicas.set(len(self.slots))
        logger.warning(
            "raymesh.serve: replica %s (pid %d) lost: %s; starting a replacement",
            slot.replica.name,
            slot.replica.pid,
            why,
        )
        self.blocking(slot.replica.stop)

    def kill(self, slot: Slot) -> None:
        """SIGKILL `slot`'s proc (a hung replica): what it computes fails, and it is lost."""
        self.blocking(slot.replica.procs.kill)

    def retire_one(self) -> None:
        """Take one replica out of rotation, to leave when idle: an idle one if any (it leaves
        at once), else the last started."""
        candidates = [s for s in self.slots if not s.retiring]
        victim = min(candidates, key=lambda s: (s.working, -self.slots.index(s)))
        victim.retiring = victim.held = True

    def maintain(self, now: float) -> None:
        """Start replicas up to `target` (unless backing off), and let idle retirees go."""
        live = self.live()
        if live < self.target and now >= self._backoff_until:
            for _ in range(self.target - live):
                self._spawn(self.start_one())
        for slot in [s for s in self.slots if s.retiring and not s.working]:
            self.slots.remove(slot)
            self.metrics.replicas.set(len(self.slots))
            logger.info("raymesh.serve: replica %s retired", slot.replica.name)
            self.blocking(slot.replica.stop)

    async def stop(self) -> None:
        """Stop every replica; one that finishes starting later is stopped at once."""
        self._stopping = True
        slots, self.slots = self.slots, []
        await asyncio.gather(*(self.blocking(s.replica.stop) for s in slots))
        self._threads.shutdown(wait=True)  # the replicas lost earlier finish stopping


async def wait_reply(call: Any) -> Any:
    """A replica's reply to `call` (a Future; a coroutine from a test's fake), as a coroutine
    that asyncio's waits take."""
    return await call
