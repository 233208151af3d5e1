"""`@endpoint`, `@concurrent_endpoint` and `Port`: the methods of an `Actor` that may be called
remotely, and how they reply.

Inside the actor an endpoint is an ordinary method (`self.incr(1)` runs it locally). On an
`ActorMesh`, `mesh.incr` is an `EndpointRef` with the adverbs `call`, `call_one`, `choose`,
`stream` and `broadcast` (see `raymesh._src.actor_mesh`). Typed with ParamSpec, so a checker sees
the endpoint's own parameters on every adverb.

Options, as in Monarch's `@endpoint(propagate=..., explicit_response_port=..., instrument=...)`:
- `explicit_response_port=True`: the method receives a `Port` as its first argument (after
  `self`) and replies with `port.send(value)` or `port.exception(error)`, at any time and from
  any thread of its proc; what it returns is ignored. The reply travels back exactly as a
  returned value would. The actor's turn ends when the method returns, not when it replies, so
  an endpoint may reply early and keep working (later messages wait for the method), or
  return at once and reply later from a thread or task it started (later messages run
  meanwhile). An exception that escapes the method, rather than going through
  `port.exception`, fails the actor (supervision runs), as in Monarch. A port that is dropped
  without a reply fails the call with `ActorError` (`raymesh.PortDropped`) instead of leaving
  the caller waiting. A port replies once (a second reply raises RuntimeError) and stays in
  its proc (it cannot be pickled and sent to another actor).
- `propagate`: Monarch's tensor engine uses it to infer the shapes an endpoint returns for
  `rref` without running it. raymesh has no tensor engine and no `rref`: the value is checked
  (None, "cached", "inspect", "mocked" or a callable, else ValueError) and kept on the
  endpoint as `Endpoint.propagate`, and nothing else reads it.
- `instrument`: in Monarch, each call runs in a tracing span named for the method. raymesh has
  no tracing: the flag is kept on the endpoint as `Endpoint.instrument`, and has no effect.

`@concurrent_endpoint` (async methods only, as in Monarch; same options): the message starts in
its turn, FIFO with the caller's other messages, but the actor's turn ends at the body's first
`await` instead of its end, so the actor's next messages run while it is suspended. An
exception it raises still reaches the caller as `ActorError`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import (
    Any,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from raymesh._src.port import Port

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["Endpoint", "concurrent_endpoint", "endpoint", "endpoint_names"]

# Monarch's tensor engine's shape propagation: accepted and kept, unused (see the module doc).
Propagator = None | Literal["cached", "inspect", "mocked"] | Callable[..., Any]


class Endpoint(Generic[P, R]):
    """A method that may be called remotely. A descriptor: on an instance it is the bound method.

    Attributes: `name`, `fn`, `is_async`, and the options it was declared with:
    `explicit_response_port`, `concurrent`, `propagate`, `instrument`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        propagate: Propagator = None,
        explicit_response_port: bool = False,
        instrument: bool = True,
        concurrent: bool = False,
    ) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.propagate = propagate
        self.explicit_response_port = explicit_response_port
        self.instrument = instrument
        self.concurrent = concurrent
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
        kind = "concurrent_endpoint" if self.concurrent else "endpoint"
        return f"<{kind} {self.name}>"


def _check_options(propagate: Any, explicit_response_port: Any, instrument: Any) -> None:
    if not (
        propagate is None or propagate in ("cached", "inspect", "mocked") or callable(propagate)
    ):
        raise ValueError(
            f"@endpoint(propagate={propagate!r}): use None, 'cached', 'inspect', 'mocked' or a "
            "function (raymesh keeps it for Monarch compatibility and does not use it)"
        )
    for name, value in (
        ("explicit_response_port", explicit_response_port),
        ("instrument", instrument),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"@endpoint({name}={value!r}): pass True or False")


def _check_method(fn: Any, decorator: str) -> None:
    if not callable(fn):
        raise TypeError(f"@{decorator} decorates methods, not {type(fn).__name__}")


class _Decorator(Protocol):
    def __call__(self, fn: Callable[Concatenate[Any, P], R], /) -> Endpoint[P, R]: ...


class _PortedDecorator(Protocol):
    def __call__(self, fn: Callable[Concatenate[Any, Port[R], P], Any], /) -> Endpoint[P, R]: ...


@overload
def endpoint(
    method: Callable[Concatenate[Any, P], R],
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[False] = False,
    instrument: bool = True,
) -> Endpoint[P, R]: ...
@overload
def endpoint(
    method: Callable[Concatenate[Any, Port[R], P], Any],
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[True],
    instrument: bool = True,
) -> Endpoint[P, R]: ...
@overload
def endpoint(
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[False] = False,
    instrument: bool = True,
) -> _Decorator: ...
@overload
def endpoint(
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[True],
    instrument: bool = True,
) -> _PortedDecorator: ...
def endpoint(
    method: Any = None,
    *,
    propagate: Propagator = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """Mark an actor method as remotely callable. Works on `def` and `async def` methods, bare
    (`@endpoint`) or with Monarch's options (`@endpoint(explicit_response_port=True)`; see the
    module docstring for what each option does here)."""
    _check_options(propagate, explicit_response_port, instrument)
    if method is None:
        return functools.partial(
            endpoint,
            propagate=propagate,
            explicit_response_port=explicit_response_port,
            instrument=instrument,
        )
    if isinstance(method, Endpoint):
        return method
    _check_method(method, "endpoint")
    return Endpoint(
        method,
        propagate=propagate,
        explicit_response_port=explicit_response_port,
        instrument=instrument,
    )


@overload
def concurrent_endpoint(
    method: Callable[Concatenate[Any, P], R],
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[False] = False,
    instrument: bool = True,
) -> Endpoint[P, R]: ...
@overload
def concurrent_endpoint(
    method: Callable[Concatenate[Any, Port[R], P], Any],
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[True],
    instrument: bool = True,
) -> Endpoint[P, R]: ...
@overload
def concurrent_endpoint(
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[False] = False,
    instrument: bool = True,
) -> _Decorator: ...
@overload
def concurrent_endpoint(
    *,
    propagate: Propagator = None,
    explicit_response_port: Literal[True],
    instrument: bool = True,
) -> _PortedDecorator: ...
def concurrent_endpoint(
    method: Any = None,
    *,
    propagate: Propagator = None,
    explicit_response_port: bool = False,
    instrument: bool = True,
) -> Any:
    """An async endpoint that does not hold the actor's turn while it is suspended.

    Its messages start in turn (FIFO per caller, after the actor's previous message), and the
    body runs until its first `await`; then the actor takes its next message while the body
    goes on as a task on the proc's event loop. So other endpoints of the same actor, and
    further concurrent calls, run while it waits (one may set an `asyncio.Event` it awaits).
    Its result or `Exception` goes to the caller as for `@endpoint` (`ActorError`); with
    `explicit_response_port=True` it replies through its `Port`, and an exception that escapes
    it fails the actor, as in Monarch. `async def` only (ValueError otherwise, as in Monarch):
    a sync method has no point at which to let the next message in.
    """
    _check_options(propagate, explicit_response_port, instrument)
    if method is None:
        return functools.partial(
            concurrent_endpoint,
            propagate=propagate,
            explicit_response_port=explicit_response_port,
            instrument=instrument,
        )
    if isinstance(method, Endpoint):
        raise ValueError(
            "concurrent_endpoint does not wrap @endpoint: use @concurrent_endpoint alone and "
            "pass the endpoint's options to it (@concurrent_endpoint(explicit_response_port=True))"
        )
    _check_method(method, "concurrent_endpoint")
    if not inspect.iscoroutinefunction(method):
        raise ValueError(
            f"concurrent_endpoint can only wrap async endpoints: make {method.__name__} an "
            "`async def`, or use @endpoint (a sync endpoint holds the actor's turn until it "
            "returns)"
        )
    return Endpoint(
        method,
        propagate=propagate,
        explicit_response_port=explicit_response_port,
        instrument=instrument,
        concurrent=True,
    )


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


def endpoints_of(cls: type) -> dict[str, Endpoint]:
    """Each endpoint of a class (and its bases), by name."""
    return {name: getattr(cls, name) for name in endpoint_names(cls)}


def check_one_kind(cls: type) -> None:
    """Refuse an actor class whose endpoints mix `def` and `async def` (or whose `__cleanup__`
    is async beside sync endpoints), as Monarch does at spawn: raymesh runs an actor's sync
    endpoints on the actor's own thread and its async ones on the proc's event loop, so state
    an endpoint leaves in its thread (torch's grad mode, a CUDA device, a `threading.local`)
    would hold for one kind and not the other, and a sync endpoint that waits on the loop
    deadlocks it in Monarch. Raises ValueError naming both lists and the fix."""
    eps = endpoints_of(cls)
    sync = sorted(n for n, e in eps.items() if not e.is_async)
    async_ = sorted(n for n, e in eps.items() if e.is_async)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if sync and async_:
        raise ValueError(
            f"{name} mixes both async and sync endpoints (sync: {sync}, async: {async_}): an "
            "actor's endpoints are all `def` or all `async def`, as in Monarch. Make them all "
            "`async def` (run blocking work with `await asyncio.to_thread(...)`), or all `def`"
        )
    if sync and inspect.iscoroutinefunction(getattr(cls, "__cleanup__", None)):
        raise ValueError(
            f"{name} has sync endpoints ({sync}) but an async __cleanup__: make __cleanup__ a "
            "plain `def` too, as in Monarch"
        )
