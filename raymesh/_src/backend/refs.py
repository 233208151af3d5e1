"""Waiting on results: Ray object refs, with Ray's errors turned into raymesh's."""

from __future__ import annotations

import pickle
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError


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
    """All results, in order. Raises ProcGone for the first ref whose proc died, TimeoutError."""
    try:
        return ray.get(refs, timeout=timeout)
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


def wait(refs: list, num_returns: int, timeout: float | None) -> tuple[list, list]:
    return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=False)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "Worker exit detail" in line or "actor is dead" in line.lower():
            return line.strip()[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


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
