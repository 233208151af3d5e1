"""`Shared`: a value stored once in the object store and passed by reference.

A large argument is already stored once per call (one copy for a whole mesh). A value sent to
several meshes, or returned by one actor and handed on to others (a policy's weights, from the
learner to every generator), would still be copied once per call and through every hop.
`Shared(value)` stores it once, where it is made; what travels is a reference.

Guarantees:
- An endpoint that receives a `Shared` as an argument (top level, or an item of a list, tuple
  or dict argument) gets the value itself, read from the object store on its host (tensors
  zero-copy and read-only, as large arguments are: `clone()` one before changing it in place).
- Returned from an endpoint, it stays a reference: the caller can pass it on without reading
  it, and `get()` reads it.
- The value lives while a `Shared` that refers to it does, anywhere in the cluster; the
  process that made it must live too (the object store's owner rule): when it has died,
  reading raises an error naming the value as lost.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from raymesh._src import backend

__all__ = ["Shared", "unshare"]

T = TypeVar("T")


class Shared(Generic[T]):
    """A value stored once in the object store (see the module)."""

    __slots__ = ("_ref",)

    def __init__(self, value: T) -> None:
        self._ref = backend.put(value)

    def get(self, timeout: float | None = None) -> T:
        """The value (read-only tensors: see the module); TimeoutError after `timeout` s."""
        value: T = backend.get([self._ref], timeout)[0]
        return value

    def __repr__(self) -> str:
        return f"Shared({self._ref!r})"


def unshare(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """`args` and `kwargs` with each `Shared` (at the top level, or an item of a list, tuple or
    dict) replaced by its value."""

    def one(x: Any) -> Any:
        if isinstance(x, Shared):
            return x.get()
        if type(x) in (list, tuple):
            return type(x)(y.get() if isinstance(y, Shared) else y for y in x)
        if type(x) is dict:
            return {k: v.get() if isinstance(v, Shared) else v for k, v in x.items()}
        return x

    if not any(_holds_shared(x) for x in (*args, *kwargs.values())):
        return args, kwargs
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _holds_shared(x: Any) -> bool:
    if isinstance(x, Shared):
        return True
    if type(x) in (list, tuple):
        return any(isinstance(y, Shared) for y in x)
    if type(x) is dict:
        return any(isinstance(v, Shared) for v in x.values())
    return False
