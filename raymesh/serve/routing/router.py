"""The router: the server's one front over its replicas, on one asyncio event loop (the HTTP
server's). It composes, and starts and stops together:
- the `ReplicaPool` (`pool`, beside this): the replicas, each doing one thing at a time, a lost
  one replaced, kept at a target;
- the `Dispatcher` (`dispatcher`, beside this): requests batched out to free replicas and their
  results back, a batch or stream whose replica is lost sent again elsewhere;
- the `Autoscaler` (`autoscaler`, beside this): `AutoscalePolicy`'s decisions on the pool's
  target, from what the dispatcher measured;
- the `Reloader` (`reloader`, beside this): new weights on every replica, one at a time.

Every `TICK_S` it has the autoscaler decide and the pool start or retire replicas. Starting and
stopping procs blocks, so it runs on the pool's threads; the loop never blocks on a replica.
Every wait is bounded: a request that nothing answers in `request_timeout_s` is a TimeoutError
(HTTP 504).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from raymesh.actor import Channel
from raymesh.serve.batching import BatchConfig
from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelInfo, ModelSpec
from raymesh.serve.routing.autoscaler import Autoscaler
from raymesh.serve.routing.dispatcher import Dispatcher, Outcome
from raymesh.serve.routing.pool import ReplicaPool, Slot
from raymesh.serve.routing.reloader import Reloader
from raymesh.serve.routing.replica import ReplicaProc, spawn_replica
from raymesh.serve.sections import RouterConfig

__all__ = ["Router"]

TICK_S = 0.1  # how often the router looks at its replicas (replacements, autoscaling)


class Router:
    """Each room gets its part of `config` (the pool its `ReplicaConfig`, the autoscaler the
    policy, the dispatcher the request bounds and the batcher's `batch`), and `metrics`.
    start_replica: how a replica starts, `spawn_replica`'s signature (tests pass a fake)."""

    def __init__(
        self,
        spec: ModelSpec,
        config: RouterConfig,
        batch: BatchConfig,
        metrics: Metrics,
        *,
        start_replica: Callable[..., ReplicaProc] = spawn_replica,
    ) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.pool = ReplicaPool(
            spec,
            config.replicas,
            metrics,
            start_replica=start_replica,
            spawn=self._spawn,
            on_ready=self._ready,
        )
        self.autoscaler = Autoscaler(config.autoscale, self.pool, metrics)
        self.dispatcher = Dispatcher(
            self.pool,
            batch,
            metrics,
            request_timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
            observe=self.autoscaler.observe,
            spawn=self._spawn,
        )
        self.reloader = Reloader(self.pool, pump=self.dispatcher.pump)

    @property
    def spec(self) -> ModelSpec:
        """What the replicas load (a reload changes it)."""
        return self.pool.spec

    @property
    def info(self) -> ModelInfo | None:
        """The model's, once a replica has loaded it."""
        return self.pool.info

    @property
    def slots(self) -> list[Slot]:
        """The ready replicas, each with what it is doing."""
        return self.pool.slots

    # ---- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start `min` replicas and the router's loops; raises what the first failed start
        raised (PlacementError, ActorError from loading the model)."""
        self._loop = asyncio.get_running_loop()
        self.dispatcher.start(self._loop)
        self.pool.start(self._loop)
        self.autoscaler.start(time.monotonic())
        if self.spec.generate is not None:
            # The controller's channel mailbox starts on first use: here, not on the first
            # stream (a model without `generate` streams nothing, so it needs none).
            await self.pool.blocking(Channel.open)
        await asyncio.gather(
            *(self.pool.start_one(raise_error=True) for _ in range(self.pool.target))
        )
        self._spawn(self._maintain())

    async def stop(self) -> None:
        """Refuse new requests, fail the waiting ones (Unavailable), stop every replica."""
        self.dispatcher.stop()
        for task in list(self._tasks):
            task.cancel()
        await self.pool.stop()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ready(self, slot: Slot, loaded: ModelSpec) -> None:
        if loaded is not self.pool.spec:  # a reload began while it started: bring it up to date
            self._spawn(self.reloader.reload_slot(slot, self.pool.spec))
        self.dispatcher.pump()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.autoscaler.tick(now, len(self.dispatcher.queue))
            self.pool.maintain(now)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, x: Any) -> asyncio.Future[Outcome]:
        """Queue one input; its future resolves with its Outcome, or raises Unavailable.
        Raises Overloaded when the queue is full."""
        return self.dispatcher.submit(x)

    async def predict(self, x: Any) -> Any:
        """The output for `x`, within `request_timeout_s` (TimeoutError), or ModelError."""
        return await self.dispatcher.predict(x)

    def stream(
        self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, seed: int = 0
    ) -> AsyncIterator[str]:
        """The generated text, a token at a time, unbroken by a lost replica (see
        `Dispatcher.stream`)."""
        return self.dispatcher.stream(prompt, max_tokens, temperature, seed)

    async def reload(self, checkpoint: str, root: Path | None = None) -> str:
        """Move every replica to `checkpoint` with no failed request (see `Reloader.reload`):
        returns the step folder loaded; ValueError, every replica back on the old weights,
        when it does not load; PermissionError for a path outside `root`."""
        return await self.reloader.reload(checkpoint, root)

    # ---- what it did -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "replicas": [
                {
                    "name": s.replica.name,
                    "pid": s.replica.pid,
                    "busy": s.working,
                    "streams": s.streams,
                    "retiring": s.retiring,
                }
                for s in self.pool.slots
            ],
            "starting": self.pool.starting,
            "target": self.pool.target,
            "queue_depth": len(self.dispatcher.queue),
            "batch_sizes": dict(sorted(self.dispatcher.batch_sizes.items())),
            "retried": self.dispatcher.retried,
            "stopped_streams": self.dispatcher.stopped_streams,
            "replaced": self.pool.replaced,
            "decisions": [dataclasses.asdict(d) for d in self.autoscaler.decisions],
            "checkpoint": self.pool.spec.checkpoint,
        }
