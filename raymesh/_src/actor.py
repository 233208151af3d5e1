"""`Actor`: the base class of user actors.

Guarantees (the same for every actor, on every proc):
- One message at a time: an actor runs one endpoint (or its constructor) at a time; several
  actors on the same proc run concurrently with each other. Two exceptions, both asked for:
  a `@concurrent_endpoint` lets the next message in at its first `await`, and
  `__supervise__` runs without waiting for the running endpoint (below).
- FIFO per caller: messages from one caller (the controller, or one actor's process) to one
  actor start in the order they were sent. Messages from different callers interleave.
- One thread: the constructor and every sync endpoint run on the actor's own thread, so
  thread-local state set in `__init__` (e.g. `torch.set_grad_enabled(False)`) holds in its
  endpoints. Async endpoints run on the proc's event loop, still one message at a time per
  actor: an `await` inside an endpoint does not let the next message of the same actor start
  (use `@concurrent_endpoint` for that). Inside an async endpoint, wait on other meshes with
  `await future`, not `future.get()`.
- An `Exception` in an endpoint is returned to the caller as `ActorError`; the actor keeps
  serving. In a `broadcast` (nobody waits for the reply) it goes to the mesh owner's
  supervision instead. A `BaseException` that is not an `Exception` (SystemExit,
  KeyboardInterrupt) fails the actor, as does `context().actor_instance.abort(reason)`: the
  owner gets a `MeshFailure` of kind "actor_failed", and later calls raise
  `SupervisionError` (in the owner, once the failure has reached it; messages that reach the
  actor after it failed are refused with ActorError `raymesh.ActorFailed`).
- Arguments arrive as copies (pickled; CPU tensors through Ray's shared-memory object store,
  zero-copy, as read-only views: `clone()` a received tensor before changing it in place).

Supervision: an actor that spawns meshes owns them. When one fails, the owner's
`__supervise__(failure)` runs on the proc's event loop (`def` or `async def`), as in Monarch:
not in turn with the endpoints, so an endpoint that awaits what `__supervise__` sets (an
`asyncio.Event`) is woken; one `__supervise__` at a time. Guard state it shares with sync
endpoints with a lock. Return True to handle it; anything else passes it up to the owner's own
owner, and at the controller to `raymesh.unhandled_fault_hook`.

Stopping: `__cleanup__(exc)` runs once when the actor stops or fails (see its docstring).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from raymesh._src import context as _ctx
from raymesh._src.errors import MeshFailure

__all__ = ["Actor", "ActorStopped", "ActorThread", "Job"]

logger = logging.getLogger("raymesh")


class Actor:
    """Subclass this and mark remotely callable methods with `@endpoint`."""

    @functools.cached_property
    def logger(self) -> logging.Logger:
        """A logger named after the actor's class (Monarch's `self.logger`), at DEBUG: what it
        prints depends on the proc's handlers (`ProcMesh.logging_option(level=...)`)."""
        lgr = logging.getLogger(type(self).__name__)
        lgr.setLevel(logging.DEBUG)
        return lgr

    def __supervise__(self, failure: MeshFailure) -> bool:
        """Called when a mesh this actor spawned fails (on the proc's event loop; may be
        `async def`). Return True to handle it."""
        return False

    def __cleanup__(self, exc: Exception | None) -> Awaitable[None] | None:
        """Called once when the actor stops (may be `async def`): by `stop()` of its actor
        mesh or its proc mesh, with `exc` None, or when it failed (an endpoint raised a
        `BaseException`, `abort()`), with `exc` saying why. By then the meshes it spawned are
        stopped and its running async endpoints cancelled. A sync one runs on the actor's
        thread, an async one on the proc's event loop; each gets 10 s, then stop() goes on.
        Not called when its proc dies (SIGKILL, a crash). For what the actor holds itself:
        files, connections, threads."""


class ActorStopped(Exception):
    """The actor was stopped before this message ran."""


class Job:
    """One piece of an actor's work for its thread: the call, and what came of it."""

    __slots__ = ("args", "ctx", "done", "error", "fn", "kwargs", "on_done", "result")

    def __init__(
        self,
        ctx: _ctx.ActorContext,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[Job], None] | None,
    ) -> None:
        self.ctx = ctx
        self.fn: Callable | None = fn
        self.args: tuple | None = args
        self.kwargs: dict | None = kwargs
        self.on_done = on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self.done: Any = None


class ActorThread:
    """One actor's own thread, which runs its constructor and its sync endpoints one after
    another (the proc's delivering threads hand them over and wait), so that thread-local state
    set in `__init__` is what every sync endpoint sees."""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def call(
        self,
        ctx: _ctx.ActorContext,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        timeout: float | None = None,
    ) -> Any:
        """Run `fn(*args, **kwargs)` on this thread and return (or raise) what it did;
        TimeoutError after `timeout` seconds (the call still runs)."""
        job = Job(ctx, fn, args, kwargs, None)
        job.done = threading.Lock()
        job.done.acquire()
        self._put(job)
        # released by the actor's thread
        if not job.done.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"{fn!r} did not return within {timeout}s")
        if job.error is not None:
            raise job.error
        return job.result

    def submit(
        self,
        ctx: _ctx.ActorContext,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[Job], None],
    ) -> None:
        """Run `fn` on this thread later; then `on_done(job)`, on this thread."""
        self._put(Job(ctx, fn, args, kwargs, on_done))

    def close(self) -> None:
        """End the thread once the jobs already given have run."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(None)

    def _put(self, job: Job) -> None:
        with self._lock:  # nothing may follow the end marker: it would never run
            if self._closed:
                raise ActorStopped
            self._inbox.put(job)

    def _loop(self) -> None:
        get = self._inbox.get
        while True:
            job = get()
            if job is None:
                return
            token = _ctx.enter(job.ctx)
            try:
                job.result = job.fn(*job.args, **job.kwargs)  # type: ignore[misc, arg-type]
            except BaseException as e:  # the thread serves on; the caller decides
                job.error = e
            finally:
                _ctx.leave(token)
            job.fn = job.args = job.kwargs = None  # drop what the call was given (a Port)
            if job.on_done is None:
                job.done.release()
            else:
                try:
                    job.on_done(job)
                except BaseException:
                    logger.exception("raymesh: completing a message on %s failed", self)
            job = None  # hold nothing while idle
