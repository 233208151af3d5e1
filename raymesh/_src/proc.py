"""The inside of a proc: the actors it hosts, message ordering, and its supervision events.

One `ProcRuntime` lives in each proc process (inside the backend's proc host actor), and one in
the controller for `this_proc()`. It is called from many threads at once (the host's thread pool
delivers messages concurrently) and enforces the actor guarantees itself rather than relying on
the transport's ordering:

- each message carries (sender id, sequence number per sender and actor); a message waits until
  every earlier message of the same sender to the same actor has started, so delivery order is
  FIFO per caller even when the transport hands messages to threads out of order;
- each actor runs one message at a time (a condition variable per actor), while actors on the
  same proc run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from raymesh._src import context as _ctx
from raymesh._src.endpoint import endpoint_names
from raymesh._src.errors import MeshFailure, RemoteFailure
from raymesh._src.shape import Point

logger = logging.getLogger("raymesh")

# A message that waits for an earlier sequence number for this long, while its actor is idle,
# is delivered anyway (and logged): an earlier message can only be missing if its sender died
# between numbering and sending it, and one lost sender must not wedge the actor.
_GAP_TIMEOUT_S = 30.0


class _Slot:
    """One hosted actor: its instance plus the turn-taking state."""

    def __init__(self, key: str, mesh_name: str, point: Point, instance: Any) -> None:
        self.key = key
        self.mesh_name = mesh_name
        self.point = point
        self.instance = instance
        self.endpoints = endpoint_names(type(instance))
        self.cv = threading.Condition()
        self.busy = False
        self.expected: dict[str, int] = {}

    def acquire(self, sender: str | None, seq: int) -> None:
        with self.cv:
            if sender is None:
                while self.busy:
                    self.cv.wait()
            else:
                idle_since: float | None = None
                while self.busy or self.expected.get(sender, 0) != seq:
                    if not self.busy and self.expected.get(sender, 0) < seq:
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > _GAP_TIMEOUT_S:
                            logger.warning(
                                "actor %s: message %d from %s never arrived; skipping it",
                                self.key,
                                self.expected.get(sender, 0),
                                sender,
                            )
                            break
                    self.cv.wait(timeout=1.0)
                self.expected[sender] = seq + 1
            self.busy = True

    def release(self) -> None:
        with self.cv:
            self.busy = False
            self.cv.notify_all()


class ProcRuntime:
    """Hosts actors in this process and runs their messages."""

    def __init__(
        self,
        *,
        proc_mesh_name: str,
        point: Point,
        on_event: Callable[[str | None, MeshFailure], None] | None = None,
    ) -> None:
        self.proc_mesh_name = proc_mesh_name
        self.point = point
        # Where events go: by default they queue for the owner's `watch`; an in-process proc
        # (the controller's `this_proc()`) hands them straight to its supervision instead.
        self._on_event = on_event
        self._slots: dict[str, _Slot] = {}
        self._events: list[tuple[str | None, MeshFailure]] = []
        self._events_cv = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    # ---- actors ----------------------------------------------------------------------------
    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        args: tuple,
        kwargs: dict,
    ) -> RemoteFailure | None:
        """Construct an actor. Returns the constructor's failure, or None."""
        ctx = _ctx.ActorContext(point, point, mesh_name, actor_key, self.proc_mesh_name)
        token = _ctx.enter(ctx)
        try:
            instance = cls(*args, **kwargs)
        except BaseException as exc:
            return RemoteFailure.from_exception(exc)
        finally:
            _ctx.leave(token)
        self._slots[actor_key] = _Slot(actor_key, mesh_name, point, instance)
        return None

    def stop_actor(self, actor_key: str) -> None:
        self._slots.pop(actor_key, None)

    def handle(
        self,
        actor_key: str,
        sender: str,
        seq: int,
        endpoint: str,
        args: tuple,
        kwargs: dict,
        message_point: tuple[tuple[str, ...], tuple[int, ...], int],
        reply: bool,
        undeliverable: BaseException | None = None,
    ) -> Any:
        """Run one message; return its result, or a RemoteFailure when the endpoint raised.
        `undeliverable`: why the arguments did not unpickle here; the message still takes its
        turn (later ones from the sender wait for it) and fails with that error."""
        slot = self._slots.get(actor_key)
        if slot is None:
            return RemoteFailure(
                "raymesh.ActorStopped", f"actor {actor_key} is not on this proc (stopped?)", ""
            )
        slot.acquire(sender, seq)
        try:
            if undeliverable is not None:
                raise undeliverable
            if endpoint not in slot.endpoints:
                raise TypeError(f"{type(slot.instance).__name__}.{endpoint} is not an endpoint")
            ctx = _ctx.ActorContext(
                slot.point, message_point, slot.mesh_name, actor_key, self.proc_mesh_name
            )
            return self._run(ctx, getattr(slot.instance, endpoint), args, kwargs)
        except BaseException as exc:
            failure = RemoteFailure.from_exception(exc)
            if not reply:
                self.post(
                    actor_key,
                    MeshFailure(
                        mesh_name=slot.mesh_name,
                        ranks=(slot.point.rank,),
                        kind="endpoint_error",
                        cause=f"broadcast to {endpoint} raised {failure.remote_type}: "
                        f"{failure.remote_message}",
                    ),
                )
            return failure
        finally:
            slot.release()

    def supervise(self, owner_key: str, failure: MeshFailure) -> bool:
        """Deliver a child mesh's failure to its owner actor, in turn with its messages.

        Returns whether the owner handled it. An unhandled failure becomes this proc's own
        event ("child_failed"), which its owner's watcher picks up.
        """
        slot = self._slots.get(owner_key)
        handled = False
        if slot is not None:
            slot.acquire(None, 0)
            try:
                ctx = _ctx.ActorContext(
                    slot.point, slot.point, slot.mesh_name, owner_key, self.proc_mesh_name
                )
                handled = self._run(ctx, slot.instance.__supervise__, (failure,), {}) is True
            except BaseException:
                logger.exception("__supervise__ of %s raised; treating as unhandled", owner_key)
            finally:
                slot.release()
        if not handled:
            mesh_name = slot.mesh_name if slot else self.proc_mesh_name
            rank = slot.point.rank if slot else self.point.rank
            self.post(
                owner_key if slot else None,
                MeshFailure(
                    mesh_name=mesh_name,
                    ranks=(rank,),
                    kind="child_failed",
                    cause=f"a mesh it owns failed and {owner_key} did not handle it",
                    child=failure,
                ),
            )
        return handled

    def _run(self, ctx: _ctx.ActorContext, fn: Callable, args: tuple, kwargs: dict) -> Any:
        token = _ctx.enter(ctx)
        try:
            result = fn(*args, **kwargs)
        finally:
            _ctx.leave(token)
        if asyncio.iscoroutine(result):
            result = self._await(ctx, result)
        return result

    def _await(self, ctx: _ctx.ActorContext, coro: Coroutine) -> Any:
        async def with_context() -> Any:
            token = _ctx.enter(ctx)
            try:
                return await coro
            finally:
                _ctx.leave(token)

        return asyncio.run_coroutine_threadsafe(with_context(), self._event_loop()).result()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="raymesh-async", daemon=True).start()
                self._loop = loop
            return self._loop

    # ---- supervision events ---------------------------------------------------------------
    def post(self, actor_key: str | None, failure: MeshFailure) -> None:
        """Report a failure of `actor_key` (None: of the proc itself) to the proc's owner."""
        if self._on_event is not None:
            self._on_event(actor_key, failure)
            return
        with self._events_cv:
            self._events.append((actor_key, failure))
            self._events_cv.notify_all()

    def watch(self, timeout: float) -> list[tuple[str | None, MeshFailure]]:
        """Block until there are events (or `timeout`), then hand them all over."""
        with self._events_cv:
            self._events_cv.wait_for(lambda: bool(self._events), timeout=timeout)
            events, self._events = self._events, []
        return events


_current_runtime: ProcRuntime | None = None


def set_current_runtime(rt: ProcRuntime) -> None:
    global _current_runtime
    _current_runtime = rt


def current_runtime() -> ProcRuntime | None:
    """The runtime of the proc this code runs in; None in the controller."""
    return _current_runtime


def start_proc_runtime(proc_mesh_name: str, point: Point) -> ProcRuntime:
    """Make this process the proc at `point` of `proc_mesh_name`: its rank, and the runtime that
    hosts its actors. The backend's proc host calls it (`create_procs(start_runtime=...)`), so
    that the backend, a layer below this module, never imports it."""
    _ctx.set_proc_point(point)
    runtime = ProcRuntime(proc_mesh_name=proc_mesh_name, point=point)
    set_current_runtime(runtime)
    return runtime
