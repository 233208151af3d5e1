"""The dispatcher: requests in, batches out to the pool's free replicas, results back to each
caller; token streams to the replicas with room for them.

- The `BatchQueue` decides when a batch leaves for a free replica: when it is full, when its
  oldest request has waited `batch_wait_ms`, or at once when no batch is being computed anywhere
  (an idle server has nothing to gain by waiting). Token streams waiting for a replica go first.
- A replica holds up to its `max_streams` token streams at once (one, where its model cannot
  batch its decoding), decoded as one batch they join and leave between tokens; a stream goes
  to the replica with room that holds the fewest. A replica holding streams takes no batch
  until they have all ended, and one computing a batch takes no stream.
- A batch whose replica dies, or runs past `request_timeout_s` (the replica is killed), loses
  the replica; its requests go back to the front of the queue and are sent again, at most
  `max_retries` times each (then Unavailable). So a replica SIGKILLed under load fails no
  request. A stream whose replica dies continues on another from the text already sent (each
  of the streams it held: they are resent one by one).
- Every wait is bounded: a request that nothing answers in `request_timeout_s` is a
  TimeoutError (HTTP 504).
- A stream that ends before its replica does (its deadline passed, or its client left and the
  front cancelled it) tells the replica to stop it (`cancel`, taken between two tokens: the
  other streams of its batch go on untouched); its place on the replica stays taken until its
  generation has ended, and a replica that does not end it within `request_timeout_s` more is
  killed and replaced, as a hung batch's is (its other streams continue elsewhere). However
  the stream's generator is closed (cancelled inside it, or closed from outside at a token),
  its place is freed once, and only once the replica has stopped it: a replica never runs more
  than its `max_streams` streams.

Nothing polls: `pump` runs whenever what may leave can change (a request in, a replica free or
added, a batch's wait over).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from raymesh.actor import ActorError, Channel, Future
from raymesh.serve.batching import BatchConfig, BatchQueue, Overloaded
from raymesh.serve.metrics import Metrics
from raymesh.serve.routing.pool import ReplicaPool, Slot, wait_reply

logger = logging.getLogger("raymesh.serve")

__all__ = ["Dispatcher", "ModelError", "Outcome", "Unavailable"]


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


class Dispatcher:
    """batch: the batcher's config (its `max_queue` bounds the streams waiting too);
    request_timeout_s and max_retries: each request's bounds; observe(sent, answered,
    arrivals): sees each batch answered (the autoscaler's measurements); spawn: runs a
    coroutine as a task of the server's."""

    def __init__(
        self,
        pool: ReplicaPool,
        batch: BatchConfig,
        metrics: Metrics,
        *,
        request_timeout_s: float,
        max_retries: int,
        observe: Callable[[float, float, Sequence[float]], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.queue: BatchQueue[_Request] = BatchQueue(batch)
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.retried = 0  # requests resent after their replica died
        self._observe = observe
        self._spawn = spawn
        self._streams: collections.deque[asyncio.Future[Slot]] = collections.deque()
        self._stopping = False
        self.stopped_streams = 0  # streams whose replica was told to stop early
        # How a stream's tokens come back: a Channel (tests put an in-process one here).
        self.open_channel: Callable[[], tuple[Any, Any]] = Channel[tuple[str, Any]].open

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop (before any request)."""
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None

    def stop(self) -> None:
        """Refuse new requests, fail the waiting ones (Unavailable)."""
        self._stopping = True
        for r in self.queue.take_all():
            if not r.future.done():
                r.future.set_exception(Unavailable("the server is stopping"))
        for waiter in self._streams:
            waiter.cancel()

    # ---- requests --------------------------------------------------------------------------
    def submit(self, x: Any) -> asyncio.Future[Outcome]:
        """Queue one input; its future resolves with its Outcome, or raises Unavailable.
        Raises Overloaded when the queue is full."""
        if self._stopping:
            raise Unavailable("the server is stopping")
        now = time.monotonic()
        request = _Request(x, self._loop.create_future(), now)
        self.queue.put(request, now)
        self.pump()
        return request.future

    async def predict(self, x: Any) -> Any:
        """The output for `x`, within `request_timeout_s` (TimeoutError), or ModelError."""
        future = self.submit(x)
        expire = self._loop.call_later(self.timeout_s, _expire, future, self.timeout_s)
        try:
            outcome = await future
        finally:
            expire.cancel()
        if outcome.error is not None:
            raise ModelError(*outcome.error)
        return outcome.value

    async def stream(
        self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, seed: int = 0
    ) -> AsyncGenerator[str, None]:
        """The generated text, a token at a time. A replica lost mid-stream is replaced by
        another that continues from the text already sent (the prompt plus it), so the caller
        sees one unbroken stream."""
        info = self.pool.info
        if info is not None and not info.generates:
            raise ModelError("ValueError", "this model has no generate function")
        pieces: list[str] = []
        tries = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            slot = await self._acquire(deadline)
            call = _StreamCall(slot)
            turn = self._stream_on(
                call, prompt + "".join(pieces), max_tokens - len(pieces), temperature, seed,
                deadline,
            )  # fmt: skip
            try:
                # Closed here, not whenever it is collected: when this generator is closed from
                # outside (the front's task cancelled while it waited in send()), the turn's own
                # end runs first and hands the slot to `_stop_stream` before `owns_slot` is read
                # below, so a replica still generating is never freed here.
                async with contextlib.aclosing(turn):
                    async for piece in turn:
                        pieces.append(piece)
                        yield piece
                return
            except _Lost as e:
                call.owns_slot = False
                tries += 1
                self.pool.lose(slot, str(e))
                if tries > self.max_retries:
                    raise Unavailable(f"the stream's replica failed {tries} times") from None
                self.retried += 1
                logger.warning("raymesh.serve: a stream's replica was lost; continuing elsewhere")
            finally:
                if call.owns_slot:
                    self.release(slot, call)

    async def _stream_on(
        self,
        call: _StreamCall,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int,
        deadline: float,
    ) -> AsyncGenerator[str, None]:
        port, receiver = self.open_channel()
        stream_id = uuid.uuid4().hex
        generate = call.slot.replica.actor.generate
        call_done = asyncio.ensure_future(
            wait_reply(generate.call_one(prompt, max_tokens, temperature, seed, port, stream_id))
        )
        ended = False  # the replica said it has finished ("end" or "error")
        try:
            while True:
                recv = asyncio.ensure_future(wait_reply(receiver.recv()))
                try:
                    while not recv.done():
                        waiting = {recv} if call_done.done() else {recv, call_done}
                        left = deadline - time.monotonic()
                        done, _ = await asyncio.wait(
                            waiting, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED
                        )
                        if not done:
                            raise TimeoutError("the stream did not finish within request_timeout_s")
                        error = call_done.exception() if call_done in done else None
                        if isinstance(error, ActorError):  # the endpoint itself failed
                            ended = True
                            raise ModelError(*_type(error))
                        if error is not None:  # SupervisionError: the replica is gone
                            ended = True
                            raise _Lost(str(error).splitlines()[0][:200])
                finally:
                    if not recv.done():
                        recv.cancel()
                kind, value = recv.result()
                if kind == "text":
                    yield value
                    continue
                if kind == "texts":  # the pieces made since the replica's last send
                    for piece in value:
                        yield piece
                    continue
                ended = True
                if kind == "end":
                    return
                raise ModelError(*value)
        finally:
            if not ended and not call_done.done():
                # Ended early (a deadline, or the client left and this task was cancelled):
                # the replica is told to stop, and keeps its slot busy until it has.
                call.owns_slot = False
                self.stopped_streams += 1
                self._spawn(self._stop_stream(call, stream_id, call_done))
            elif not call_done.done():
                call_done.cancel()

    async def _stop_stream(
        self, call: _StreamCall, stream_id: str, call_done: asyncio.Future[Any]
    ) -> None:
        """Tell `call`'s replica to stop stream `stream_id`; free the slot once its generate
        call has returned, or kill the replica if that takes past `request_timeout_s`."""
        slot = call.slot

        async def stopped() -> None:
            await wait_reply(slot.replica.actor.cancel.call_one(stream_id))
            await call_done  # the generate call returns once its thread has stopped

        try:
            await asyncio.wait_for(stopped(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self._hung(slot)
            self.pool.lose(slot, "a cancelled stream did not stop within request_timeout_s")
            self.pump()
            return
        except ActorError:
            pass  # the endpoint failed: the replica itself is fine
        except Exception as e:  # SupervisionError: the replica is gone
            self.pool.lose(slot, str(e).splitlines()[0][:200])
            self.pump()
            return
        self.release(slot, call)

    # ---- dispatch --------------------------------------------------------------------------
    def pump(self) -> None:
        """Send what may leave now to the free replicas; called whenever that can change (a
        request in, a replica free or added, a batch's wait over), so nothing polls."""
        now = time.monotonic()
        # Token streams waiting for a replica go first: every free replica has room for one.
        while self._streams and (slot := self.pool.for_stream()) is not None:
            waiter = self._streams.popleft()
            if not waiter.done():
                slot.streams += 1
                waiter.set_result(slot)
        while (slot := self.pool.free()) is not None:
            if not self.queue.ready(now, idle=self.pool.idle()):
                break
            batch = [r for r in self.queue.take(now) if not r.future.done()]
            if batch:
                self._send(slot, batch)
        self.metrics.queue_depth.set(len(self.queue))
        deadline = self.queue.deadline()
        if deadline is not None and self.pool.free() is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_later(max(0.0, deadline - now), self.pump)

    def _send(self, slot: Slot, batch: list[_Request]) -> None:
        slot.busy = True
        self.batch_sizes[len(batch)] += 1
        self.metrics.batch_size.observe(len(batch))
        future = slot.replica.actor.predict.call_one([r.x for r in batch])
        self._spawn(self._finish(slot, batch, future, time.monotonic()))

    async def _finish(
        self, slot: Slot, batch: list[_Request], future: Future[Any], sent: float
    ) -> None:
        # A batch past request_timeout_s means a hung replica: kill it, which fails the await.
        hung = self._loop.call_later(self.timeout_s, self._hung, slot)
        try:
            values, errors, _ = await future
        except ActorError as e:  # the endpoint itself failed (not the model: see predict)
            values, errors = [None] * len(batch), dict.fromkeys(range(len(batch)), _type(e))
        except Exception as e:  # SupervisionError: the replica's proc is gone
            self.pool.lose(slot, str(e).splitlines()[0][:200])
            self._resend(batch)
            return
        finally:
            hung.cancel()
        now = time.monotonic()
        self._observe(sent, now, [r.arrived for r in batch])
        for i, r in enumerate(batch):
            if not r.future.done():
                error = errors.get(i) if errors else None
                r.future.set_result(Outcome(values[i], error))
        self.release(slot)

    def _hung(self, slot: Slot) -> None:
        logger.warning(
            "raymesh.serve: replica %s ran a batch past request_timeout_s=%s: killing it",
            slot.replica.name,
            self.timeout_s,
        )
        self.pool.kill(slot)

    def release(self, slot: Slot, call: _StreamCall | None = None) -> None:
        """`slot` has finished its batch, or a stream: it may take the next. A stream's turn
        (`call`) frees its place at most once: a second release for the same turn is ignored,
        as the place may by then be another request's."""
        if call is None:
            slot.busy = False
        elif call.released:
            return
        else:
            call.released = True
            slot.streams -= 1
        self.pump()

    def _resend(self, batch: list[_Request]) -> None:
        again = []
        for r in batch:
            if r.future.done():
                continue
            r.tries += 1
            if r.tries > self.max_retries:
                r.future.set_exception(
                    Unavailable(f"its replica failed {r.tries} times; giving up on it")
                )
            else:
                again.append(r)
        self.retried += len(again)
        self.metrics.retries.inc(len(again))
        self.queue.requeue([(r.arrived, r) for r in again])
        self.pump()

    async def _acquire(self, deadline: float) -> Slot:
        if self._stopping:
            raise Unavailable("the server is stopping")
        if len(self._streams) + len(self.queue) >= self.queue.config.max_queue:
            raise Overloaded(len(self._streams) + len(self.queue), 1)
        waiter: asyncio.Future[Slot] = self._loop.create_future()
        self._streams.append(waiter)
        self.pump()
        try:
            return await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError("no replica was free within request_timeout_s") from None


def _expire(future: asyncio.Future[Outcome], timeout_s: float) -> None:
    if not future.done():  # cancelled: a batch that takes it later skips it
        future.set_exception(TimeoutError(f"no reply within request_timeout_s={timeout_s}"))


def _type(e: ActorError) -> tuple[str, str]:
    return e.remote_type.rsplit(".", 1)[-1], e.remote_message


class _Lost(Exception):
    """A stream's replica died."""


@dataclass(eq=False)
class _StreamCall:
    """One stream's turn on a replica; `owns_slot` False once the slot is lost, or handed to
    `_stop_stream` (which frees it when the replica has stopped)."""

    slot: Slot
    owns_slot: bool = True
    released: bool = False  # `release` has freed the slot for this turn
