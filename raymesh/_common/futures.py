"""`Pending`: a result on its way, read the way a raymesh `Future` is read."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Pending"]

T = TypeVar("T")


class _FutureLike(Protocol):
    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


class Pending(Generic[T]):
    """A `concurrent.futures.Future` (or anything with its `result(timeout)` and `done()`) as
    `get(timeout)` / `done()`. `get` raises TimeoutError after `timeout` seconds; the work goes
    on, unless `cancel_on_timeout`, which cancels it (a late result is then refused)."""

    def __init__(self, future: _FutureLike, *, cancel_on_timeout: bool = False) -> None:
        self._future = future
        self._cancel = cancel_on_timeout

    def get(self, timeout: float | None = None) -> T:
        """The result (or the exception the work raised)."""
        try:
            return self._future.result(timeout)
        except (concurrent.futures.TimeoutError, TimeoutError):
            if self._future.done():
                raise  # the work's own TimeoutError, not this wait's
            if self._cancel:
                cancel = getattr(self._future, "cancel", None)
                if cancel is not None:
                    cancel()
            raise TimeoutError(f"no reply within {timeout:g} s") from None

    def done(self) -> bool:
        """Whether the result (or a failure) is in; never blocks."""
        return self._future.done()
