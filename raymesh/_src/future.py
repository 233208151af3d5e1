"""`Future`: the pending result of a call. `get(timeout=...)` blocks; `await future` does not.

A future resolves to a value, or raises:
- `ActorError` when the endpoint raised (the actor lives on);
- `SupervisionError` when a proc that was to answer is gone (promptly: Ray reports a dead actor
  on every pending ref within milliseconds; the future never waits for a dead proc);
- `TimeoutError` when `timeout` seconds pass first. The call itself is not cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from raymesh._src import backend

R = TypeVar("R")

__all__ = ["Future"]

_UNSET: Any = object()


class Future(Generic[R]):
    """The pending result of one call: one actor's reply (`call_one`, `choose`) or a mesh's
    (`call`: a ValueMesh of every actor's reply, in rank order).

    Guarantees:
    - `get(timeout=None)` blocks until the result is in and returns it, or raises: `ActorError`
      when the endpoint raised (for a mesh call, the first failing actor in rank order; the
      actors live on), `SupervisionError` when a proc that was to answer is gone (promptly,
      as the module docstring says: it never waits for a dead proc), `TimeoutError` when
      `timeout` seconds pass first. A timeout cancels nothing and settles nothing: the call
      runs on, and `get()` may be called again.
    - Settled once: after `get()` has returned or raised ActorError/SupervisionError, every
      later `get()` returns the same value or raises the same exception object, at once.
    - `await future` is `get()` without a timeout that never blocks the event loop: the loop is
      woken when the result (or a proc's death) is in, holding no thread while it waits; it
      returns or raises exactly what `get()` would.
    - `done()` never blocks: True once every reply (or a proc's death) is in, or once the future
      has settled; a result it reports done is returned by `get()` without waiting.
    - A call refused before it was sent (its mesh already failed) gives a future that is
      already settled with that error (`Future.failed`).
    """

    def __init__(
        self,
        items: list[Any],
        resolve: Callable[[list[Any]], R],
        on_gone: Callable[[int, str], BaseException],
        what: str,
    ) -> None:
        self._items = items  # pending results (see `backend.refs`)
        self._resolve = resolve  # raw replies -> value; raises ActorError
        self._on_gone = on_gone  # (index of the dead item, detail) -> exception to raise
        self._what = what
        self._value: Any = _UNSET
        self._error: BaseException | None = None

    @staticmethod
    def resolved(value: R, what: str = "") -> Future[R]:
        """A future that already holds `value` (e.g. what a blocking `stop()` returns)."""
        return Future([], lambda _: value, lambda i, d: RuntimeError(d), what)

    @staticmethod
    def failed(error: BaseException) -> Future[Any]:
        fut: Future[Any] = Future([], _identity, lambda i, d: error, "")
        fut._error = error
        return fut

    def get(self, timeout: float | None = None) -> R:
        """The result; waits at most `timeout` seconds (None: until it is ready or fails)."""
        if self._error is not None:
            raise self._error
        if self._value is not _UNSET:
            return self._value
        try:
            raws = backend.get(self._items, timeout) if self._items else []
        except TimeoutError:
            raise TimeoutError(
                f"{self._what} did not reply within {timeout}s (the call is still running; "
                "pass a larger timeout to get())"
            ) from None
        except backend.ProcGone as gone:
            self._error = self._on_gone(gone.index, gone.detail)
            raise self._error from None
        try:
            self._value = self._resolve(raws)
        except BaseException as e:
            self._error = e
            raise
        return self._value

    def done(self) -> bool:
        """Whether the result (or failure) is available without waiting."""
        if self._error is not None or self._value is not _UNSET:
            return True
        return all(backend.done(self._items))

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call `fn()` once `done()` is True: at once (on this thread) if it is already, else
        on whichever thread saw the last reply (or a proc's death) arrive, so keep `fn` short
        (set an event, hand real work to a thread of your own). Called once."""
        if self._error is not None or self._value is not _UNSET:
            fn()
        else:
            backend.when_done(self._items, fn)

    def __await__(self) -> Generator[Any, None, R]:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # on whichever thread saw the result arrive
            try:
                loop.call_soon_threadsafe(_set_done, waiter)
            except RuntimeError:  # the loop closed while this waited: nobody is waiting
                pass

        self.add_done_callback(wake)
        yield from waiter.__await__()
        return self.get(timeout=None)  # every item is in: this does not wait

    def __repr__(self) -> str:
        return f"<Future {self._what}{' done' if self.done() else ''}>"


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a cancelled await leaves a cancelled waiter
        waiter.set_result(None)


def _identity(x: Any) -> Any:
    return x
