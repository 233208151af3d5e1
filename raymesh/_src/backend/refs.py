"""Waiting on results, with Ray's errors turned into raymesh's.

A pending result is a Ray object ref (a call through Ray) or a `concurrent.futures.Future` (a
call over a channel, or to an actor in this process); one list may hold both.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raymesh._src.backend import runtime
from raymesh._src.backend.channel import ChannelFailed


class ProcGone(Exception):
    """The proc that was to produce a result is gone. `index` is the position in the list."""

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(detail)
        self.index = index
        self.detail = detail


def is_ref(x: Any) -> bool:
    return isinstance(x, ray.ObjectRef)


def put(value: Any) -> Any:
    return ray.put(value)


def get(refs: list, timeout: float | None) -> list:
    """All results, in order. Raises ProcGone for the first item whose proc died, TimeoutError,
    and `RuntimeLostError` once the local runtime this program attached to is gone."""
    if not all(isinstance(r, ray.ObjectRef) for r in refs):
        return _get_futures(refs, timeout)
    try:
        return _in_slices(lambda t: ray.get(refs, timeout=t), timeout)
    except GetTimeoutError:
        raise TimeoutError from None
    except (RayActorError, RayTaskError):
        pass
    # Find which one failed (the slow path, only after a failure).
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError from None
        except RayActorError as e:
            raise ProcGone(i, _first_line(e)) from None
        except RayTaskError as e:
            raise ProcGone(i, _first_line(e)) from None
    raise AssertionError("ray.get failed, yet every ref resolves")


_SLICE_S = 1.0  # attached to a runtime, a wait looks at it this often


def _in_slices(wait: Callable[[float | None], Any], timeout: float | None) -> Any:
    """`wait(timeout)`; attached to a local runtime, as waits of at most `_SLICE_S` that check
    the runtime between them: with the runtime gone, Ray's own wait would not return (its GCS
    client blocks for 60 s, then ends the process). `wait` raises GetTimeoutError."""
    if runtime.attached() is None:
        return wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        runtime.check_runtime()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return wait(_SLICE_S if left is None else min(left, _SLICE_S))
        except GetTimeoutError:
            if left is not None and left <= _SLICE_S:
                raise


def _get_futures(items: list, timeout: float | None) -> list:
    futures = [_future(x) for x in items]

    def wait(t: float | None) -> set:
        done, pending = concurrent.futures.wait(
            futures, t, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        if pending and not any(f.exception() for f in done):
            raise GetTimeoutError
        return pending

    try:
        pending = _in_slices(wait, timeout)
    except GetTimeoutError:
        pending = {f for f in futures if not f.done()}
    for i, f in enumerate(futures):  # a dead proc first, even while others are pending
        error = f.exception() if f.done() else None
        if isinstance(error, (RayActorError, RayTaskError, ChannelFailed)):
            raise ProcGone(i, _first_line(error)) from None
    if pending:
        raise TimeoutError
    return [f.result() for f in futures]


def _future(x: Any) -> concurrent.futures.Future:
    return x.future() if isinstance(x, ray.ObjectRef) else x


def wait(refs: list, num_returns: int, timeout: float | None) -> tuple[list, list]:
    return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=False)


def done(items: list) -> list[bool]:
    """Which of `items` have their result (or failure), without waiting."""
    refs = [x for x in items if isinstance(x, ray.ObjectRef)]
    ready = (
        set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0])
        if refs
        else set()
    )
    return [x in ready if isinstance(x, ray.ObjectRef) else x.done() for x in items]


def arrivals(items: list) -> list[concurrent.futures.Future]:
    """One future per item, in order of arrival: the k-th resolves with the index (in `items`)
    of the k-th item whose result (or failure) came in. Never waits, never fails."""
    slots: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in items]
    arrived = itertools.count()
    lock = threading.Lock()

    def done(index: int, _: concurrent.futures.Future) -> None:
        with lock:
            slot = slots[next(arrived)]
        slot.set_result(index)

    for i, x in enumerate(items):
        _future(x).add_done_callback(functools.partial(done, i))
    return slots


def when_done(items: list, fn: Callable[[], object]) -> None:
    """Call `fn()` once every item's result (or failure) is in, on whichever thread saw the
    last one arrive (keep `fn` short: hand real work to a thread of your own)."""
    left = [len(items)]
    lock = threading.Lock()

    def arrived(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    if not items:
        fn()
    for x in items:
        _future(x).add_done_callback(arrived)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "Worker exit detail" in line or "actor is dead" in line.lower():
            return line.strip()[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


def by_value(module_name: str) -> None:
    """Pickle what module `module_name` defines by value, as cloudpickle does `__main__`'s: a
    `multiprocessing` child's main module (`__mp_main__`) exists in no proc to import from."""
    module = sys.modules.get(module_name)
    if module is not None:
        ray.cloudpickle.register_pickle_by_value(module)


def roundtrip(value: Any) -> Any:
    """A copy of `value` as the wire would make it (for in-process actors)."""
    return pickle.loads(ray.cloudpickle.dumps(value))


def describe_unpicklable(args: tuple, kwargs: dict) -> str | None:
    """Name the first argument that cannot be pickled, with why; None if all can."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in named:
        try:
            ray.cloudpickle.dumps(value)
        except Exception as e:
            return f"{label} ({type(value).__name__}: {str(value)[:60]!r}) cannot be pickled: {e}"
    return None
