"""The inside of a proc: the actors it hosts, message ordering, and its supervision events.

This module is the runtime that enforces what follows; each hosted actor's state, its turn and
its end are `hosted_actor`'s, and the proc's event loop is `proc_loop`.

One `ProcRuntime` lives in each proc process (inside the backend's proc host actor), and one in
the controller for `this_proc()`. It is called from many threads at once (the host's thread pool
delivers messages concurrently) and enforces the actor guarantees itself rather than relying on
the transport's ordering:

- each message carries (sender id, sequence number per sender and actor); a message waits until
  every earlier message of the same sender to the same actor has started, so delivery order is
  FIFO per caller even when the transport hands messages to threads out of order;
- each actor runs one message at a time (its *turn*: a condition variable per actor), while
  actors on the same proc run concurrently. A `@concurrent_endpoint` gives the turn back at its
  first `await`, an `explicit_response_port` endpoint when it returns (its reply may come
  later); every other endpoint when its reply is ready;
- where it runs: every actor has a thread of its own, which runs its constructor and its sync
  endpoints, so thread-local state set in `__init__` (torch's grad mode, a `threading.local`)
  is what its endpoints see. Async endpoints, and `__supervise__`, run on the proc's event loop
  (one per proc, as in Monarch); an actor whose endpoints are all async is constructed there
  too, for the same reason. The delivering thread hands a sync message to the actor's
  thread and waits for it: two thread wake-ups, about 10 us per message on a 2-core machine
  (a call_one costs ~300-400 us);
- `__supervise__` does not take the turn: it runs while an endpoint is running (which may be
  waiting for it), one `__supervise__` at a time per actor;
- an endpoint that raises an `Exception` replies with it (`ActorError`) and the actor serves
  on. Everything else that escapes an endpoint fails the actor, as in Monarch: any other
  `BaseException` (SystemExit, KeyboardInterrupt, a cancellation), an exception from a
  `broadcast` (nobody holds a reply to carry it: "endpoint_error") or from an
  `explicit_response_port` endpoint (its replies can no longer be trusted), and
  `context().actor_instance.abort()`. A failed actor's owner gets the supervision event, the
  call that failed it and every later one raise `SupervisionError`, and messages it has not
  started are refused;
- a `breakpoint()` pauses its endpoint in pdb (`debugger`) with the turn held, so the actor's
  later messages wait in order; an endpoint that raises may pause at the raise (post-mortem)
  before its reply; stopping the actor ends a pause;
- stopping an actor (`stop_actor`, or `stop_all` before its proc is ended) refuses the
  messages it has not started, cancels its running async endpoints and waits for them, stops
  the meshes it owns (`ownership`), then runs its `__cleanup__(None)`, each step bounded. A
  failed actor's `__cleanup__` runs once, with the failure, when it fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from raymesh._src import context as _ctx
from raymesh._src import ownership
from raymesh._src.actor import Actor, ActorStopped, Job
from raymesh._src.debugger import breakpoint as debugger
from raymesh._src.endpoint import Endpoint, endpoints_of
from raymesh._src.errors import MeshFailure, RemoteFailure
from raymesh._src.hosted_actor import HostedActor, refused, stopped
from raymesh._src.logs import name_actors_in_records
from raymesh._src.port import Port, Reply
from raymesh._src.proc_loop import ProcLoop, awaited, guarded
from raymesh._src.shape import Point
from raymesh._src.shared import unshare

logger = logging.getLogger("raymesh")
# How long stopping one actor waits for each of its steps: its async endpoints to end once
# cancelled, and its __cleanup__ (an actor stuck in an endpoint must not block stop() forever).
CLEANUP_TIMEOUT_S = 10.0


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
        self._slots: dict[str, HostedActor] = {}
        # Events not yet watched, by route (None: the proc's owner's; see `spawn`).
        self._events: dict[str | None, list[tuple[str | None, MeshFailure]]] = {}
        self._events_cv = threading.Condition()
        self._closing = False  # its actors are stopped and the proc is about to exit
        self._loop = ProcLoop()
        name_actors_in_records()

    # ---- actors ----------------------------------------------------------------------------
    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        args: tuple,
        kwargs: dict,
        spawner: _ctx.Spawner | None = None,
    ) -> RemoteFailure | None:
        """Construct an actor, on its own thread. Returns the constructor's failure, or None.
        `spawner.route`: who watches its failures (`watch(route=)`), when not the proc's
        owner: the process whose actor spawned it on procs that process does not own."""
        actor_id = _ctx.ActorId(
            _ctx.proc_id(self.proc_mesh_name, self.point), mesh_name, actor_key, point.rank
        )
        info = _ctx.ActorInstance(actor_id, point, f"{cls.__module__}.{cls.__qualname__}")
        slot = HostedActor(
            actor_key, mesh_name, point, info, f"raymesh-actor-{actor_key}", self.proc_mesh_name
        )
        if spawner is not None:
            slot.route = spawner.route
            info.creator, info.proc_mesh = spawner.creator, spawner.proc_mesh
        info._abort = lambda reason: self._fail(slot, f"aborted: {reason or 'no reason provided'}")
        ctx = slot.context()
        endpoints = endpoints_of(cls)
        try:
            if endpoints and all(e.is_async for e in endpoints.values()):
                # An async actor is constructed on the event loop its endpoints run on, so that
                # thread-local state set in __init__ is theirs (as in Monarch).
                slot.instance = self._loop.run(ctx, cls, args, kwargs)
            else:
                slot.instance = slot.thread.call(ctx, cls, args, kwargs)
        except BaseException as exc:  # the spawn reports it
            slot.thread.close()
            return RemoteFailure.from_exception(exc)
        slot.endpoints = endpoints_of(type(slot.instance))
        self._slots[actor_key] = slot
        return None

    def instance(self, actor_key: str) -> Any:
        """The object of an actor hosted here (raymesh's own services read their state)."""
        return self._slots[actor_key].instance

    def stop_actor(self, actor_key: str, timeout: float = CLEANUP_TIMEOUT_S) -> None:
        """Stop one actor (see the module docstring): refuse what it has not started, cancel
        its running async endpoints, stop the meshes it owns, run `__cleanup__(None)`. Returns
        when that is done, or after about 2 x `timeout` for an actor that does not finish."""
        slot = self._slots.pop(actor_key, None)
        if slot is None:
            return
        slot.stopped = True
        debugger.release(actor_key)  # a paused endpoint quits: stop is not held up by a pause
        slot.cancel_tasks(self._loop, timeout)
        ownership.stop_owned(actor_key)
        slot.cleanup(None, timeout, self._loop)
        slot.thread.close()

    def stop_all(self, timeout: float = CLEANUP_TIMEOUT_S) -> None:
        """Stop every actor of this proc, the newest first, before the proc is ended; then
        end the pending `watch` calls (the proc exits once its calls have returned)."""
        for key in reversed(list(self._slots)):
            self.stop_actor(key, timeout)
        with self._events_cv:
            self._closing = True
            self._events_cv.notify_all()

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
            return stopped(actor_key)
        slot.acquire(sender, seq)
        passed = False  # whether the turn went on to the endpoint, which gives it back itself
        ctx = None
        try:
            if slot.stopped:
                return stopped(actor_key)
            if slot.failed is not None:
                return refused(slot)
            if undeliverable is not None:
                raise undeliverable
            spec = slot.endpoints.get(endpoint)
            if spec is None:
                raise TypeError(f"{type(slot.instance).__name__}.{endpoint} is not an endpoint")
            args, kwargs = unshare(args, kwargs)  # read shared values inside the actor's turn
            ctx = slot.context(message_point)
            fn = getattr(slot.instance, endpoint)
            if spec.concurrent or spec.explicit_response_port:
                box = self._start(slot, spec, ctx, fn, args, kwargs, reply)
                passed = True
                return box.wait() if reply else None
            if spec.is_async:
                return self._loop.run(ctx, fn, args, kwargs)
            result = slot.thread.call(ctx, fn, args, kwargs)
            if asyncio.iscoroutine(result):  # a sync method that returned a coroutine
                result = self._loop.run(ctx, awaited, (result,), {})
            return result
        except BaseException as exc:  # each kind is handled below
            debugger.post_mortem(ctx, exc)  # if wanted, pdb at the raise before the reply
            return self._raised(slot, endpoint, exc, reply)
        finally:
            if not passed:
                slot.release()

    def _start(
        self,
        slot: HostedActor,
        spec: Endpoint,
        ctx: _ctx.ActorContext,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        reply: bool,
    ) -> Reply:
        """Start a concurrent or explicit-port endpoint, which gives the actor's turn back by
        itself (at its first await; when it returns). Returns where its reply will be."""
        on_failure = None if reply else (lambda f: self._broadcast_failed(slot, spec.name, f))
        box = Reply(on_failure)
        explicit = spec.explicit_response_port
        if explicit:
            args = (Port(box), *args)

        def finish(ok: bool, value: Any) -> None:  # the body has ended
            if ok:
                if not explicit:
                    box.settle(value)
                return  # explicit: its port replies, or its drop does
            if isinstance(value, asyncio.CancelledError) and slot.stopped:
                box.settle(stopped(slot.key))
                return
            failure = RemoteFailure.from_exception(value)
            if explicit or not isinstance(value, Exception):  # the actor dies (module docstring)
                kind = "escaped its explicit response port" if explicit else "raised"
                self._fail(slot, f"{spec.name} {kind}: {failure.remote_type}: {value}")
                if slot.failed is not None:
                    failure = refused(slot)  # its caller gets SupervisionError
            box.settle(failure)  # unless it replied already

        if not spec.is_async:  # explicit-port sync endpoint: on the actor's thread

            def done(job: Job) -> None:
                error = job.error
                job.error = job.result = None
                finish(error is None, error)
                slot.release()

            slot.thread.submit(ctx, fn, args, kwargs, done)
            return box

        loop = self._loop.get()
        coro = guarded(ctx, fn, args, kwargs)
        del args  # the Port lives in the coroutine only, so that dropping it is seen

        def start() -> None:  # on the event loop
            task = loop.create_task(coro)
            slot.tasks.add(task)
            if spec.concurrent:
                loop.call_soon(slot.release)  # runs after the body's first step

            def done(t: asyncio.Task) -> None:
                slot.tasks.discard(t)
                ok, value = (False, asyncio.CancelledError()) if t.cancelled() else t.result()
                finish(ok, value)
                if not spec.concurrent:
                    slot.release()

            task.add_done_callback(done)

        loop.call_soon_threadsafe(start)
        return box

    def _raised(self, slot: HostedActor, endpoint: str, exc: BaseException, reply: bool) -> Any:
        """The reply for a message whose endpoint raised `exc`."""
        if isinstance(exc, ActorStopped):
            return stopped(slot.key)
        failure = RemoteFailure.from_exception(exc)
        if isinstance(exc, Exception):
            if not reply:  # a broadcast's: the actor dies
                self._broadcast_failed(slot, endpoint, failure)
            return failure  # ActorError at the caller; the actor serves on
        # SystemExit, KeyboardInterrupt, ...: the actor dies, and its caller hears so
        self._fail(slot, f"{endpoint} raised {failure.remote_type}: {failure.remote_message}")
        return refused(slot) if slot.failed is not None else failure

    def _broadcast_failed(self, slot: HostedActor, endpoint: str, failure: RemoteFailure) -> None:
        what = f"{failure.remote_type}: {failure.remote_message}"
        self._fail(slot, f"broadcast to {endpoint} raised {what}", kind="endpoint_error")

    def _fail(self, slot: HostedActor, cause: str, kind: str = "actor_failed") -> None:
        """Mark the actor failed (once) and tell its owner."""
        with slot.cv:
            if slot.failed is not None or slot.stopped:
                return
            slot.failed = failure = MeshFailure(
                mesh_name=slot.mesh_name,
                ranks=(slot.point.rank,),
                kind=kind,
                cause=f"actor {slot.key} failed: {cause}",
                actor=repr(slot.info),
            )
        logger.error("raymesh: %s", failure)
        self.post(slot.key, failure)
        # Its __cleanup__ runs now, with the failure (as in Monarch), on a thread of its own:
        # _fail may run on the actor's thread, which the cleanup needs.
        threading.Thread(
            target=slot.cleanup,
            args=(RuntimeError(failure.cause), CLEANUP_TIMEOUT_S, self._loop),
            name=f"raymesh-cleanup-{slot.key}",
            daemon=True,
        ).start()

    def supervise(self, owner_key: str, failure: MeshFailure) -> bool:
        """Deliver a child mesh's failure to its owner actor's `__supervise__`.

        Runs on the proc's event loop (an async `__supervise__` is awaited there, a sync one
        called there, as in Monarch), without waiting for the owner's running endpoint, one at
        a time per owner. Returns whether the owner handled it. An unhandled failure becomes
        this proc's own event ("child_failed"), which its owner's watcher picks up.
        """
        slot = self._slots.get(owner_key)
        handled = False
        if slot is not None and slot.failed is None:
            hook = getattr(type(slot.instance), "__supervise__", None)
            if hook is not None and hook is not Actor.__supervise__:
                ctx = slot.context()
                with slot.supervising:
                    try:
                        bound = slot.instance.__supervise__
                        handled = self._loop.run(ctx, bound, (failure,), {}) is True
                    except BaseException:
                        logger.exception(
                            "__supervise__ of %s raised; treating as unhandled", owner_key
                        )
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
                    actor=repr(slot.info) if slot else None,
                ),
            )
        return handled

    # ---- supervision events ---------------------------------------------------------------
    def post(self, actor_key: str | None, failure: MeshFailure) -> None:
        """Report a failure of `actor_key` (None: of the proc itself) to whoever watches it:
        the actor's route, else the proc's owner."""
        if self._on_event is not None:
            self._on_event(actor_key, failure)
            return
        slot = self._slots.get(actor_key) if actor_key is not None else None
        route = slot.route if slot is not None else None
        with self._events_cv:
            self._events.setdefault(route, []).append((actor_key, failure))
            self._events_cv.notify_all()

    def watch(
        self, timeout: float, route: str | None = None
    ) -> list[tuple[str | None, MeshFailure]] | None:
        """Block until there are events for `route` (or `timeout`), then hand them all over.
        None once the proc is closing (`stop_all`): there is nothing left to watch."""
        with self._events_cv:
            self._events_cv.wait_for(
                lambda: self._closing or bool(self._events.get(route)), timeout=timeout
            )
            if self._closing and not self._events.get(route):
                return None
            return self._events.pop(route, [])


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
    _ctx.set_proc_point(point, proc_mesh_name)
    debugger.install()
    runtime = ProcRuntime(proc_mesh_name=proc_mesh_name, point=point)
    set_current_runtime(runtime)
    return runtime
