"""One actor hosted by a proc: its instance, its thread, its turn, and its end.

The turn is what orders a proc's messages (see `proc`'s docstring): each message of a sender
waits for that sender's earlier ones, and an actor runs one message at a time. The end is how
a stopped or failed actor goes: its running async endpoints cancelled, then its
`__cleanup__` run once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import Any

from raymesh._src import context as _ctx
from raymesh._src.actor import Actor, ActorStopped, ActorThread
from raymesh._src.endpoint import Endpoint
from raymesh._src.errors import MeshFailure, RemoteFailure
from raymesh._src.proc_loop import ProcLoop
from raymesh._src.shape import Point

__all__ = ["HostedActor", "refused", "stopped"]

logger = logging.getLogger("raymesh")

# A message that waits for an earlier sequence number for this long, while its actor is idle,
# is delivered anyway (and logged): an earlier message can only be missing if its sender died
# between numbering and sending it, and one lost sender must not wedge the actor.
_GAP_TIMEOUT_S = 30.0


class HostedActor:
    """One hosted actor: its instance, its thread and the turn-taking state."""

    def __init__(
        self,
        key: str,
        mesh_name: str,
        point: Point,
        info: _ctx.ActorInstance,
        thread_name: str,
        proc_mesh_name: str,
    ) -> None:
        self.key = key
        self.mesh_name = mesh_name
        self.point = point
        self.info = info
        self.proc_mesh_name = proc_mesh_name
        self.instance: Any = None
        self.endpoints: dict[str, Endpoint] = {}
        self.thread = ActorThread(thread_name)
        self.cv = threading.Condition()
        self.busy = False
        self.expected: dict[str, int] = {}
        self.failed: MeshFailure | None = None
        self.stopped = False
        self.supervising = threading.Lock()  # one __supervise__ at a time
        self.tasks: set[asyncio.Task] = set()  # async endpoints started as tasks (loop thread)
        self.cleaned = False  # __cleanup__ ran (or was started): it runs once
        self.route: str | None = None  # who watches its failures (`ProcRuntime.spawn`)

    def context(self, message_point: Any = None) -> _ctx.ActorContext:
        """The context its code runs in; `message_point`: the point a message was sent to
        (default: the actor's own)."""
        return _ctx.ActorContext(
            self.point,
            self.point if message_point is None else message_point,
            self.mesh_name,
            self.key,
            self.proc_mesh_name,
            self.info,
        )

    def acquire(self, sender: str, seq: int) -> None:
        """Take the actor's turn for message `seq` of `sender`, after its earlier ones."""
        with self.cv:
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

    def cancel_tasks(self, loop: ProcLoop, timeout: float) -> None:
        """Cancel the actor's running async endpoint tasks and wait (bounded) until they have
        ended, so their `finally` blocks run before `__cleanup__` (as in Monarch)."""
        running = loop.started
        if running is None:
            return

        async def cancel() -> None:
            tasks = list(self.tasks)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), running).result(timeout + 1.0)
        except Exception:
            logger.warning("raymesh: endpoints of %s did not end when cancelled", self.key)

    def cleanup(self, exc: Exception | None, timeout: float, loop: ProcLoop) -> None:
        """Run the actor's `__cleanup__(exc)` once (a sync one on its thread, an async one on
        the event loop), waiting at most `timeout`. What it raises is logged: its mesh is
        stopped or already failed, so there is nobody left to tell."""
        method = getattr(type(self.instance), "__cleanup__", None)
        if method is None or method is Actor.__cleanup__ or self.cleaned:
            return
        self.cleaned = True
        run = loop.run if inspect.iscoroutinefunction(method) else self.thread.call
        try:
            run(self.context(), self.instance.__cleanup__, (exc,), {}, timeout)
        except (TimeoutError, ActorStopped):
            logger.warning("raymesh: __cleanup__ of %s did not end within %ss", self.key, timeout)
        except BaseException as e:  # whatever it raised: logged, the stop goes on
            logger.error("raymesh: __cleanup__ of %s raised", self.key, exc_info=e)


def stopped(actor_key: str) -> RemoteFailure:
    """The reply to a message for an actor that is not (or no longer) here."""
    return RemoteFailure(
        "raymesh.ActorStopped", f"actor {actor_key} is not on this proc (stopped?)", ""
    )


def refused(actor: HostedActor) -> RemoteFailure:
    """The reply to a message for an actor that failed."""
    return RemoteFailure(
        "raymesh.ActorFailed",
        f"{actor.failed}; it takes no more messages (its owner got the supervision event)",
        "",
    )
