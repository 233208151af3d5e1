"""`@endpoint`: marks the methods of an `Actor` that may be called remotely.

Inside the actor an endpoint is an ordinary method (`self.incr(1)` runs it locally). On an
`ActorMesh`, `mesh.incr` is an `EndpointRef` with the adverbs `call`, `call_one`, `choose`,
`stream` and `broadcast` (see `raymesh._src.actor_mesh`). Typed with ParamSpec, so a checker sees
the endpoint's own parameters on every adverb.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["Endpoint", "endpoint", "endpoint_names"]


class Endpoint(Generic[P, R]):
    """A method that may be called remotely. A descriptor: on an instance it is the bound method."""

    def __init__(self, fn: Callable[Concatenate[Any, P], R]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    def __repr__(self) -> str:
        return f"<endpoint {self.name}>"


def endpoint(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]:
    """Mark an actor method as remotely callable. Works on `def` and `async def` methods."""
    if isinstance(fn, Endpoint):
        return fn
    if not callable(fn):
        raise TypeError(f"@endpoint decorates methods, not {type(fn).__name__}")
    return Endpoint(fn)


def endpoint_names(cls: type) -> frozenset[str]:
    """The names of the endpoints a class (and its bases) declares."""
    names = set()
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                names.add(name)
            elif name in names:  # overridden by a plain method: no longer an endpoint
                names.discard(name)
    return frozenset(names)
