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
    - `await future` is `get()` without a timeout, run on the event loop's default executor so
      the loop keeps running; it returns or raises exactly what `get()` would.
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

    def __await__(self) -> Generator[Any, None, R]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.get).__await__()

    def __repr__(self) -> str:
        return f"<Future {self._what}{' done' if self.done() else ''}>"


def _identity(x: Any) -> Any:
    return x
