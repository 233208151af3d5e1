"""The proc's event loop: one per proc (as in Monarch), started on a thread of its own when
first needed. Async endpoints, async constructors and `__cleanup__`s, and `__supervise__` run
there (see `proc`'s docstring); whatever they raise comes back as a value, never out of the
loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from raymesh._src import context as _ctx

__all__ = ["ProcLoop", "awaited", "guarded"]


async def guarded(ctx: _ctx.ActorContext, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` (awaited if it gives an awaitable) as (ok, result or exception).
    Never raises: asyncio re-raises a task's SystemExit or KeyboardInterrupt out of the event
    loop, which would end the loop of every actor on the proc."""
    token = _ctx.enter(ctx)
    try:
        result = fn(*args, **kwargs)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        return True, result
    except BaseException as e:
        return False, e
    finally:
        _ctx.leave(token)


def awaited(coro: Coroutine) -> Coroutine:
    return coro


class ProcLoop:
    """The event loop of one proc, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> asyncio.AbstractEventLoop | None:
        """The loop if it runs already, None otherwise (nothing to cancel on it then)."""
        return self._loop

    def get(self) -> asyncio.AbstractEventLoop:
        """The loop, started on a daemon thread the first time."""
        loop = self._loop
        if loop is not None:
            return loop
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="raymesh-async", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(
        self,
        ctx: _ctx.ActorContext,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        timeout: float | None = None,
    ) -> Any:
        """Run `fn` on the event loop (awaiting what it returns) and wait for it here, at most
        `timeout` seconds (TimeoutError; it still runs)."""
        future = asyncio.run_coroutine_threadsafe(guarded(ctx, fn, args, kwargs), self.get())
        ok, value = future.result(timeout)
        if not ok:
            raise value
        return value
