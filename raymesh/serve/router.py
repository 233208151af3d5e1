"""The router: requests in, batches out to replicas, results back to each caller.

It runs on one asyncio event loop (the HTTP server's) and owns:
- the `BatchQueue`: a batch leaves for a free replica when it is full, when its oldest request
  has waited `batch_wait_ms`, or at once when no batch is being computed anywhere (an idle
  server has nothing to gain by waiting);
- the replicas: each computes one batch (or one token stream) at a time. A replica whose proc
  dies, or whose batch runs past `request_timeout_s` (it is killed), is dropped; its requests go
  back to the front of the queue and are sent again, at most `max_retries` times each, and a
  replacement starts. So a replica SIGKILLed under load fails no request;
- the replica count: `AutoscalePolicy` decides from the queue, latency and busy share, once per
  `cooldown_s`, and each decision is logged with its reason and kept (the last
  `KEPT_DECISIONS`, in `decisions`). The latencies it reads are the last `LATENCY_SAMPLES` of
  the window, so a server whose policy never decides (a fixed replica count) holds no more.

Starting and stopping procs blocks, so it runs on a thread pool; the loop never blocks on a
replica. Every wait is bounded: a request that nothing answers in `request_timeout_s` is a
TimeoutError (HTTP 504).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymesh.actor import ActorError, Channel, Future
from raymesh.serve.batching import BatchQueue, Overloaded
from raymesh.serve.config import ServeConfig
from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelInfo, ModelSpec, check_under_root
from raymesh.serve.replica import ReplicaProc, spawn_replica
from raymesh.serve.scaling import ReplicaScale

logger = logging.getLogger("raymesh.serve")

__all__ = ["ModelError", "Router", "Unavailable"]

TICK_S = 0.1  # how often the router looks at its replicas (replacements, autoscaling)
# The latencies a p99 is taken over: the newest this many since the last decision. Bounded, as
# a window is kept for as long as no decision ends it (forever, with a fixed replica count).
LATENCY_SAMPLES = 4096
KEPT_DECISIONS = 256  # scaling decisions kept for stats() (oldest dropped)


class ModelError(Exception):
    """The model raised on this request (HTTP 500). The replica keeps serving."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class Unavailable(Exception):
    """No replica could answer: the request was resent `max_retries` times, or the server is
    stopping (HTTP 503)."""


@dataclass(frozen=True)
class Outcome:
    """One request's result: its output, or the error the model raised on it."""

    value: Any = None
    error: tuple[str, str] | None = None  # (exception type, message)


@dataclass(eq=False)
class _Request:
    x: Any
    future: asyncio.Future[Outcome]
    arrived: float
    tries: int = 0


@dataclass(eq=False)
class _Slot:
    """A ready replica and what it is doing."""

    replica: ReplicaProc
    busy: bool = False
    held: bool = False  # taken out of rotation (reloading, retiring)
    retiring: bool = False


@dataclass
class _Window:
    """What happened since the policy last looked."""

    start: float
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_SAMPLES)
    )
    busy_s: float = 0.0


async def _wait(future: Future[Any]) -> Any:
    return await future


class Router:
    """start_replica: how a replica starts, `spawn_replica`'s signature (tests pass a fake)."""

    def __init__(
        self,
        spec: ModelSpec,
        config: ServeConfig,
        metrics: Metrics,
        *,
        start_replica: Callable[..., ReplicaProc] = spawn_replica,
    ) -> None:
        self.spec = spec
        self._start_replica = start_replica
        self.config = config
        self.metrics = metrics
        self.policy = config.autoscale()
        self.queue: BatchQueue[_Request] = BatchQueue(config.batch())
        self.slots: list[_Slot] = []
        self.target = config.min_replicas
        self.info: ModelInfo | None = None
        self.decisions: collections.deque[ReplicaScale] = collections.deque(maxlen=KEPT_DECISIONS)
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.retried = 0  # requests resent after their replica died
        self.replaced = 0  # replicas lost and replaced
        self._starting = 0
        self._start_failures = 0
        self._backoff_until = 0.0
        self._names = itertools.count()
        self._streams: collections.deque[asyncio.Future[_Slot]] = collections.deque()
        self._pool = ThreadPoolExecutor(config.max_replicas + 2, thread_name_prefix="raymesh-serve")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._reloading = False

    # ---- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start `min` replicas and the router's loops; raises what the first failed start
        raised (PlacementError, ActorError from loading the model)."""
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._window = _Window(time.monotonic())
        self._last_decision = time.monotonic()
        if self.spec.generate is not None:
            # The controller's channel mailbox starts on first use: here, not on the first
            # stream (a model without `generate` streams nothing, so it needs none).
            await self._loop.run_in_executor(self._pool, Channel.open)
        await asyncio.gather(*(self._start_one(raise_error=True) for _ in range(self.target)))
        self._spawn(self._maintain())

    async def stop(self) -> None:
        """Refuse new requests, fail the waiting ones (Unavailable), stop every replica."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        for r in self.queue.take_all():
            if not r.future.done():
                r.future.set_exception(Unavailable("the server is stopping"))
        for waiter in self._streams:
            waiter.cancel()
        slots, self.slots = self.slots, []
        await asyncio.gather(
            *(self._loop.run_in_executor(self._pool, s.replica.stop) for s in slots)
        )
        self._pool.shutdown(wait=True)  # the replicas lost earlier finish stopping

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, x: Any) -> asyncio.Future[Outcome]:
        """Queue one input; its future resolves with its Outcome, or raises Unavailable.
        Raises Overloaded when the queue is full."""
        if self._stopping:
            raise Unavailable("the server is stopping")
        now = time.monotonic()
        request = _Request(x, self._loop.create_future(), now)
        self.queue.put(request, now)
        self._pump()
        return request.future

    async def predict(self, x: Any) -> Any:
        """The output for `x`, within `request_timeout_s` (TimeoutError), or ModelError."""
        future = self.submit(x)
        expire = self._loop.call_later(self.config.request_timeout_s, _expire, future, self.config)
        try:
            outcome = await future
        finally:
            expire.cancel()
        if outcome.error is not None:
            raise ModelError(*outcome.error)
        return outcome.value

    async def stream(
        self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, seed: int = 0
    ) -> AsyncIterator[str]:
        """The generated text, a token at a time. A replica lost mid-stream is replaced by
        another that continues from the text already sent (the prompt plus it), so the caller
        sees one unbroken stream."""
        if self.info is not None and not self.info.generates:
            raise ModelError("ValueError", "this model has no generate function")
        pieces: list[str] = []
        tries = 0
        deadline = time.monotonic() + self.config.request_timeout_s
        while True:
            slot = await self._acquire(deadline)
            lost = False
            try:
                async for piece in self._stream_on(
                    slot, prompt + "".join(pieces), max_tokens - len(pieces), temperature, seed,
                    deadline,
                ):  # fmt: skip
                    pieces.append(piece)
                    yield piece
                return
            except _Lost as e:
                lost = True
                tries += 1
                self._lose(slot, str(e))
                if tries > self.config.max_retries:
                    raise Unavailable(f"the stream's replica failed {tries} times") from None
                self.retried += 1
                logger.warning("raymesh.serve: a stream's replica was lost; continuing elsewhere")
            finally:
                if not lost:
                    self._release(slot)

    async def _stream_on(
        self,
        slot: _Slot,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int,
        deadline: float,
    ) -> AsyncIterator[str]:
        port, receiver = Channel[tuple[str, Any]].open()
        call = slot.replica.actor.generate.call_one(prompt, max_tokens, temperature, seed, port)
        call_done = asyncio.ensure_future(_wait(call))
        try:
            while True:
                recv = asyncio.ensure_future(_wait(receiver.recv()))
                while not recv.done():
                    waiting = {recv} if call_done.done() else {recv, call_done}
                    left = deadline - time.monotonic()
                    done, _ = await asyncio.wait(
                        waiting, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED
                    )
                    if not done:
                        recv.cancel()
                        raise TimeoutError("the stream did not finish within request_timeout_s")
                    error = call_done.exception() if call_done in done else None
                    if isinstance(error, ActorError):  # the endpoint itself failed
                        recv.cancel()
                        raise ModelError(*_type(error))
                    if error is not None:  # SupervisionError: the replica is gone
                        recv.cancel()
                        raise _Lost(str(error).splitlines()[0][:200])
                kind, value = recv.result()
                if kind == "text":
                    yield value
                elif kind == "end":
                    return
                else:
                    raise ModelError(*value)
        finally:
            if not call_done.done():
                call_done.cancel()

    # ---- dispatch --------------------------------------------------------------------------
    def _free(self) -> _Slot | None:
        for slot in self.slots:
            if not (slot.busy or slot.held):
                return slot
        return None

    def _pump(self) -> None:
        """Send what may leave now to the free replicas; called whenever that can change (a
        request in, a replica free or added, a batch's wait over), so nothing polls."""
        now = time.monotonic()
        while (slot := self._free()) is not None:
            if self._streams:  # token streams waiting for a replica go first
                waiter = self._streams.popleft()
                if not waiter.done():
                    slot.busy = True
                    waiter.set_result(slot)
                continue
            if not self.queue.ready(now, idle=not any(s.busy for s in self.slots)):
                break
            batch = [r for r in self.queue.take(now) if not r.future.done()]
            if batch:
                self._send(slot, batch)
        self.metrics.queue_depth.set(len(self.queue))
        deadline = self.queue.deadline()
        if deadline is not None and self._free() is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_later(max(0.0, deadline - now), self._pump)

    def _send(self, slot: _Slot, batch: list[_Request]) -> None:
        slot.busy = True
        self.batch_sizes[len(batch)] += 1
        self.metrics.batch_size.observe(len(batch))
        future = slot.replica.actor.predict.call_one([r.x for r in batch])
        self._spawn(self._finish(slot, batch, future, time.monotonic()))

    async def _finish(
        self, slot: _Slot, batch: list[_Request], future: Future[Any], sent: float
    ) -> None:
        # A batch past request_timeout_s means a hung replica: kill it, which fails the await.
        hung = self._loop.call_later(self.config.request_timeout_s, self._hung, slot)
        try:
            values, errors, _ = await future
        except ActorError as e:  # the endpoint itself failed (not the model: see predict)
            values, errors = [None] * len(batch), dict.fromkeys(range(len(batch)), _type(e))
        except Exception as e:  # SupervisionError: the replica's proc is gone
            self._lose(slot, str(e).splitlines()[0][:200])
            self._resend(batch)
            return
        finally:
            hung.cancel()
        now = time.monotonic()
        self._window.busy_s += now - sent
        for i, r in enumerate(batch):
            self._window.latencies.append(now - r.arrived)
            if not r.future.done():
                error = errors.get(i) if errors else None
                r.future.set_result(Outcome(values[i], error))
        self._release(slot)

    def _hung(self, slot: _Slot) -> None:
        logger.warning(
            "raymesh.serve: replica %s ran a batch past request_timeout_s=%s: killing it",
            slot.replica.name,
            self.config.request_timeout_s,
        )
        self._loop.run_in_executor(self._pool, slot.replica.procs.kill)

    def _release(self, slot: _Slot) -> None:
        slot.busy = False
        self._pump()

    def _resend(self, batch: list[_Request]) -> None:
        again = []
        for r in batch:
            if r.future.done():
                continue
            r.tries += 1
            if r.tries > self.config.max_retries:
                r.future.set_exception(
                    Unavailable(f"its replica failed {r.tries} times; giving up on it")
                )
            else:
                again.append(r)
        self.retried += len(again)
        self.metrics.retries.inc(len(again))
        self.queue.requeue([(r.arrived, r) for r in again])
        self._pump()

    async def _acquire(self, deadline: float) -> _Slot:
        if self._stopping:
            raise Unavailable("the server is stopping")
        if len(self._streams) + len(self.queue) >= self.config.max_queue:
            raise Overloaded(len(self._streams) + len(self.queue), 1)
        waiter: asyncio.Future[_Slot] = self._loop.create_future()
        self._streams.append(waiter)
        self._pump()
        try:
            return await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError("no replica was free within request_timeout_s") from None

    # ---- replicas --------------------------------------------------------------------------
    def _lose(self, slot: _Slot, why: str) -> None:
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
        self._loop.run_in_executor(self._pool, slot.replica.stop)

    async def _start_one(self, raise_error: bool = False) -> None:
        self._starting += 1
        name = f"replica{next(self._names)}"
        spec = self.spec
        try:
            replica = await self._loop.run_in_executor(
                self._pool,
                functools.partial(
                    self._start_replica,
                    name,
                    spec,
                    cpus=self.config.cpus_per_replica,
                    gpus=self.config.gpus,
                    timeout=self.config.start_timeout_s,
                ),
            )
        except Exception as e:
            self._start_failures += 1
            self._backoff_until = time.monotonic() + min(30.0, 2.0**self._start_failures)
            logger.error("raymesh.serve: replica %s failed to start: %s", name, e)
            if raise_error:
                raise
            return
        finally:
            self._starting -= 1
        self._start_failures = 0
        if self._stopping:
            await self._loop.run_in_executor(self._pool, replica.stop)
            return
        self.info = self.info or replica.info
        slot = _Slot(replica)
        self.slots.append(slot)
        self.metrics.replicas.set(len(self.slots))
        logger.info("raymesh.serve: replica %s ready (pid %d)", name, replica.pid)
        if spec is not self.spec:  # a reload began while it started: bring it up to date
            self._spawn(self._reload_slot(slot, self.spec))
        self._pump()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if (
                now - self._window.start >= self.policy.cooldown_s
                and self.policy.min < self.policy.max
            ):
                self._decide(now)
            live = len([s for s in self.slots if not s.retiring]) + self._starting
            if live < self.target and now >= self._backoff_until:
                for _ in range(self.target - live):
                    self._spawn(self._start_one())
            for slot in [s for s in self.slots if s.retiring and not s.busy]:
                self.slots.remove(slot)
                self.metrics.replicas.set(len(self.slots))
                logger.info("raymesh.serve: replica %s retired", slot.replica.name)
                self._loop.run_in_executor(self._pool, slot.replica.stop)

    def _decide(self, now: float) -> None:
        window, self._window = self._window, _Window(now)
        latencies = sorted(window.latencies)
        p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else None
        replicas = len([s for s in self.slots if not s.retiring]) + self._starting
        decision = self.policy.decide(
            replicas=replicas,
            queue_depth=len(self.queue),
            p99_s=p99,
            busy_replicas=window.busy_s / max(now - window.start, 1e-9),
            since_last_s=now - self._last_decision,
        )
        if decision is None:
            return
        self._last_decision = now
        self.decisions.append(decision)
        self.metrics.scale_decisions.inc()
        logger.info(
            "raymesh.serve: %d -> %d replicas: %s", replicas, decision.replicas, decision.reason
        )
        self.target = decision.replicas
        if decision.replicas < replicas:
            candidates = [s for s in self.slots if not s.retiring]
            # The idle one if any (it stops at once), else the last started.
            victim = min(candidates, key=lambda s: (s.busy, -self.slots.index(s)))
            victim.retiring = victim.held = True

    # ---- reload ----------------------------------------------------------------------------
    async def reload(self, checkpoint: str, root: Path | None = None) -> str:
        """Move every replica to `checkpoint`, one at a time, each out of rotation while it
        loads (the others keep serving). Returns the step folder loaded. Raises ValueError,
        with every replica back on the old weights, if the new checkpoint does not load.

        root: load only from under this folder (HTTP's checkpoint_root): PermissionError,
        before anything is read, for a path outside it, and before anything is loaded when
        the step folder found, or a file in it, links out of it."""
        if self._reloading:
            raise RuntimeError("a reload is already in progress; wait for it")
        self._reloading = True
        try:
            new = await self._loop.run_in_executor(
                self._pool, functools.partial(self._resolve, checkpoint, root)
            )
            old, self.spec = self.spec, new
            done: list[_Slot] = []
            for slot in list(self.slots):
                try:
                    await self._reload_slot(slot, new)
                except ActorError as e:
                    self.spec = old
                    for back in done:
                        await self._reload_slot(back, old)
                    raise ValueError(
                        f"checkpoint={checkpoint!r} did not load ({e.remote_type}: "
                        f"{e.remote_message}); every replica still serves {old.checkpoint}"
                    ) from None
                done.append(slot)
            logger.info("raymesh.serve: %d replica(s) now serve %s", len(done), new.checkpoint)
            return str(new.checkpoint)
        finally:
            self._reloading = False

    def _resolve(self, checkpoint: str, root: Path | None) -> ModelSpec:
        if root is not None:
            checkpoint = str(check_under_root(checkpoint, root))
        new = dataclasses.replace(self.spec, checkpoint=checkpoint).resolved()
        if root is not None and new.checkpoint is not None:
            # The replicas load the real path checked here, not a link that could be moved.
            real = check_under_root(new.checkpoint, root, files=True)
            new = dataclasses.replace(new, checkpoint=str(real))
        return new

    async def _reload_slot(self, slot: _Slot, spec: ModelSpec) -> None:
        slot.held = True
        try:
            # Its batch in flight finishes on the old weights. A replica lost meanwhile leaves
            # the slots with its batch unfinished (resent elsewhere): its replacement starts
            # with the new spec, so there is nothing to wait for.
            while slot.busy and slot in self.slots:
                await asyncio.sleep(0.001)
            if slot not in self.slots:
                return
            info = await asyncio.wait_for(
                _wait(slot.replica.actor.reload.call_one(spec)), self.config.start_timeout_s
            )
            slot.replica.info = info
        except ActorError:
            raise
        except Exception as e:  # lost while loading: the replacement loads `spec`
            self._lose(slot, str(e).splitlines()[0][:200])
        finally:
            slot.held = slot.retiring
            self._pump()

    # ---- what it did -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "replicas": [
                {
                    "name": s.replica.name,
                    "pid": s.replica.pid,
                    "busy": s.busy,
                    "retiring": s.retiring,
                }
                for s in self.slots
            ],
            "starting": self._starting,
            "target": self.target,
            "queue_depth": len(self.queue),
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "retried": self.retried,
            "replaced": self.replaced,
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "checkpoint": self.spec.checkpoint,
        }


def _expire(future: asyncio.Future[Outcome], config: ServeConfig) -> None:
    if not future.done():  # cancelled: a batch that takes it later skips it
        future.set_exception(
            TimeoutError(f"no reply within request_timeout_s={config.request_timeout_s}")
        )


def _type(e: ActorError) -> tuple[str, str]:
    return e.remote_type.rsplit(".", 1)[-1], e.remote_message


class _Lost(Exception):
    """A stream's replica died."""
