"""Actor meshes and the adverbs that message them.

One module of about 400 lines on purpose: the mesh and its adverbs are one concept (Monarch's
`ActorMesh` and its `EndpointRef`), sharing one send path: per-sender sequence numbers, one put
of a large argument, a slice's ranks.

`mesh.incr` is an `EndpointRef`:
- `call(*args)` -> `Future[ValueMesh]`: every actor of the mesh (or slice), replies gathered.
- `call_one(*args)` -> `Future[value]`: the mesh must hold exactly one actor.
- `choose(*args)` -> `Future[value]`: one live actor, the one with the fewest of this caller's
  `choose` calls still running (an idle one when there is one); never one whose proc is known
  to be dead while a live one is left.
- `stream(*args)` -> iterator of `Future[value]`, one per actor, in order of arrival.
- `broadcast(*args)` -> None: fire-and-forget; an exception goes to the mesh owner's supervision.
- `send(endpoint, args, kwargs, port)` (Monarch's): fire-and-forget, each reply sent on `port`.

Each message goes to its proc over the proc's channel (small messages from the proc's host)
or as a Ray actor task (see `backend.channel`). A call whose arguments hold a large buffer (a
tensor, array or bytes of 1 MiB or more) puts the arguments in the object store once and sends
every actor a reference, so N actors cost one copy, not N.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from raymesh._src import backend, ownership, supervision
from raymesh._src.context import Spawner, actor_label, current_actor_context, current_instance
from raymesh._src.endpoint import check_one_kind, endpoint_names
from raymesh._src.errors import ActorError, MeshFailure, RemoteFailure, SupervisionError
from raymesh._src.future import Future
from raymesh._src.port import Port
from raymesh._src.shape import MeshTrait, Shape
from raymesh._src.supervision import dispatch
from raymesh._src.value_mesh import ValueMesh

T = TypeVar("T")

logger = logging.getLogger("raymesh")

__all__ = ["ActorMesh", "EndpointRef", "send"]

_LARGE_BYTES = 1 << 20
# How long `spawn` waits for the constructors (a model loaded in `__init__` may take long).
SPAWN_TIMEOUT_ENV = "RAYMESH_SPAWN_TIMEOUT_S"
_SPAWN_TIMEOUT_S = 300.0


class _Sender:
    """This process's identity as a caller, and its per-actor sequence numbers."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:16]
        self.lock = threading.Lock()
        self.seqs: dict[tuple[str, int], int] = {}
        self.chosen: dict[tuple[str, int], list[Any]] = {}  # choose() calls in flight
        self.round_robin = itertools.count()


_sender = _Sender()


class _ActorMeshState:
    """What all views of one actor mesh share."""

    def __init__(self, key: str, name: str, cls: type, proc_state: Any, shape: Shape) -> None:
        self.key = key
        self.name = name
        self.cls = cls
        self.endpoints = endpoint_names(cls)
        self.proc_state = proc_state
        self.shape = shape  # every actor of the mesh, as spawned
        ctx = current_actor_context()  # the actor spawning it, which owns it; None: controller
        self.owner_key = ctx.actor_key if ctx is not None else None


def spawn_actors(
    proc_mesh: Any, name: str, cls: type, args: tuple, kwargs: dict, *, owned: bool = True
) -> ActorMesh:
    """`ProcMesh.spawn`. owned=False: the spawning actor does not own the mesh (it is not
    stopped with it), for raymesh's own per-process services (a channel's mailbox)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"spawn(name={name!r}): give the actor mesh a non-empty name")
    if not isinstance(cls, type):
        raise TypeError(f"spawn({name!r}, {cls!r}): pass the actor class, not an instance")
    check_one_kind(cls)
    if cls.__module__ == "__mp_main__":  # a multiprocessing child's script: sent by value
        backend.by_value("__mp_main__")
    pstate, shape = proc_mesh._state, proc_mesh._shape
    error = pstate.check(shape.ranks, None)
    if error is not None:
        raise error
    state = _ActorMeshState(f"{name}-{uuid.uuid4().hex[:8]}", name, cls, pstate, shape)
    class_name = f"{cls.__module__}.{cls.__qualname__}"
    with pstate.lock:
        pstate.actors[state.key] = (class_name, name, shape)
    supervision.register(state)
    # On procs this process does not own, the actors' events are kept for this process (their
    # owner is here), and watched from here.
    routed = not pstate.owned and not getattr(pstate.procs[0], "in_process", False)
    route = supervision.ROUTE if routed else None
    spawner = Spawner(route, current_instance(), proc_mesh)
    payload = _payload(args, kwargs)
    pending = [
        pstate.procs[rank].spawn(state.key, name, point, cls, payload, spawner)
        for point, rank in shape.points()
    ]
    if routed:
        supervision.supervisor().watch_routed(pstate, list(shape.ranks))
    mesh: ActorMesh = ActorMesh(state, shape)
    if owned:
        ownership.own(state.owner_key, state, name, mesh.stop)
    timeout = _spawn_timeout()
    try:
        replies = Future(pending, list, mesh._gone, f"spawn of {name!r}").get(timeout)
    except TimeoutError:
        # A constructor that never returns: the mesh is failed (its calls raise), and the
        # spawn says which actor and what to do, rather than a bare wait that timed out.
        cause = (
            f"{cls.__name__}.__init__ did not return within {timeout:g}s; its procs still run "
            f"it. Stop them (ProcMesh.stop()), or give slow constructors longer with "
            f"{SPAWN_TIMEOUT_ENV}"
        )
        failure = MeshFailure(
            name, tuple(shape.ranks), "init_error", cause, actor=f"<{class_name} {name}>"
        )
        dispatch(pstate, state.key, failure)
        raise SupervisionError(failure) from None
    # A constructor that raised fails the actor mesh, as in Monarch: the mesh is returned, each
    # failed rank goes to supervision (the owner's __supervise__, at the top the fault hook),
    # and calls on the mesh raise SupervisionError naming the constructor's exception.
    for (point, _), reply in zip(shape.points(), replies):
        if isinstance(reply, RemoteFailure):
            cause = f"{cls.__name__}.__init__ raised {reply.remote_type}: {reply.remote_message}"
            failure = MeshFailure(
                name, (point.rank,), "init_error", cause, actor=actor_label(class_name, name, point)
            )
            dispatch(pstate, state.key, failure)
    return mesh


def _spawn_timeout() -> float:
    raw = os.environ.get(SPAWN_TIMEOUT_ENV, "").strip()
    if not raw:
        return _SPAWN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{SPAWN_TIMEOUT_ENV}={raw!r}: give the seconds spawn waits for constructors as a "
            f"positive number (default {_SPAWN_TIMEOUT_S:g})"
        )
    return value


def _payload(args: tuple, kwargs: dict) -> Any:
    payload = (args, kwargs)
    if _has_large(args, kwargs):
        # Put once, send references (nested in a list, so Ray does not resolve them in
        # transit): one copy for N actors, and the receiver maps it from shared memory.
        return [backend.put(payload)]
    return payload


def _has_large(args: tuple, kwargs: dict) -> bool:
    def large(x: Any) -> bool:
        if isinstance(x, (bytes, bytearray, memoryview)):
            return len(x) >= _LARGE_BYTES
        return getattr(x, "nbytes", 0) >= _LARGE_BYTES if hasattr(x, "nbytes") else False

    for x in itertools.chain(args, kwargs.values()):
        if large(x):
            return True
        if isinstance(x, (list, tuple)) and any(large(y) for y in x):
            return True
        if isinstance(x, dict) and any(large(y) for y in x.values()):
            return True
    return False


class ActorMesh(MeshTrait, Generic[T]):
    """One actor per proc of a proc mesh (or of a slice of one). Picklable: send it to another
    actor and call it from there; supervision still goes to the mesh's owner."""

    def __init__(self, state: _ActorMeshState, shape: Shape) -> None:
        self._state = state
        self._shape = shape

    def __getattr__(self, name: str) -> EndpointRef:
        state = self.__dict__.get("_state")
        if state is None or name.startswith("__"):
            raise AttributeError(name)
        if name in state.endpoints:
            return EndpointRef(self, name)
        if hasattr(state.cls, name):
            raise TypeError(
                f"{state.cls.__name__}.{name} is not an endpoint: add @endpoint to it to call "
                "it remotely"
            )
        raise AttributeError(
            f"{state.cls.__name__} has no endpoint {name!r}; its endpoints are "
            f"{sorted(state.endpoints)}"
        )

    @property
    def name(self) -> str:
        return self._state.name

    def _new_with_shape(self, shape: Shape) -> ActorMesh[T]:
        return ActorMesh(self._state, shape)

    def stop(self) -> Future[None]:
        """Remove every actor of this mesh (all of it, even when called on a slice) from its
        proc; the procs keep running. Returns once they are gone, with a resolved Future (as
        Monarch's `stop()` returns one: `await mesh.stop()` works too). Later calls on the mesh
        raise SupervisionError ("stopped")."""
        state = self._state
        pstate = state.proc_state
        stopped = MeshFailure(
            state.name, tuple(state.shape.ranks), "stopped", "the actor mesh was stopped"
        )
        pstate.record(state.key, stopped)
        with pstate.lock:
            pstate.actors.pop(state.key, None)
        ownership.disown(state.owner_key, state)
        backend_refs = [pstate.procs[r].stop_actor(state.key) for r in state.shape.ranks]
        refs = [r for r in backend_refs if backend.is_ref(r)]
        if refs:  # each actor's stop is bounded (its __cleanup__ gets 10 s); a dead proc fails
            backend.wait(refs, len(refs), 30.0)
        return Future.resolved(None, f"stop of {state.name!r}")

    def __repr__(self) -> str:
        return f"ActorMesh({self._state.name!r}, {self._state.cls.__name__}, {self._shape})"

    def __getstate__(self) -> dict:
        return {"_state": self._state, "_shape": self._shape}

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)

    # ---- messaging -------------------------------------------------------------------------
    def _gone(self, index: int, detail: str, shape: Shape | None = None) -> SupervisionError:
        rank = (shape or self._shape).ranks[index]
        return SupervisionError(self._state.proc_state.proc_gone(rank, detail))

    def _send(self, shape: Shape, endpoint: str, args: tuple, kwargs: dict, reply: bool) -> list:
        state = self._state
        pstate = state.proc_state
        error = pstate.check(shape.ranks, state.key)
        if error is not None:
            raise error
        payload = _payload(args, kwargs)
        labels, sizes = shape.extent.labels, shape.extent.sizes
        pending = []
        with _sender.lock:
            for i, rank in enumerate(shape.ranks):
                key = (state.key, rank)
                seq = _sender.seqs.get(key, 0)
                try:
                    pending.append(
                        pstate.procs[rank].submit(
                            state.key, _sender.id, seq, endpoint, payload, (labels, sizes, i), reply
                        )
                    )
                except Exception as e:
                    problem = backend.describe_unpicklable(args, kwargs)
                    if problem is None:
                        raise
                    raise TypeError(
                        f"{state.cls.__name__}.{endpoint}: {problem}. Fix: pass picklable "
                        "values (plain data, tensors, arrays), or build the object inside the "
                        "actor"
                    ) from e
                _sender.seqs[key] = seq + 1
        return pending


class EndpointRef(Generic[T]):
    """An endpoint of an actor mesh, with the adverbs to send it messages."""

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name

    def _what(self, shape: Shape) -> str:
        return f"{self._mesh._state.cls.__name__}.{self._name} on {self._mesh.name!r}{shape}"

    def _future(
        self, shape: Shape, pending: list, single: bool, rank: int | None = None
    ) -> Future[Any]:
        """`rank`: the sender's view's rank of a single reply (stream), for its error."""
        mesh_name, endpoint = self._mesh.name, self._name

        def resolve(raws: list[Any]) -> Any:
            for (point, _), raw in zip(shape.points(), raws):
                if isinstance(raw, RemoteFailure):
                    where = point.rank if rank is None else rank
                    if raw.remote_type == "raymesh.ActorFailed":  # the actor is gone, not an error
                        failure = MeshFailure(
                            mesh_name, (where,), "actor_failed", raw.remote_message
                        )
                        raise SupervisionError(failure)
                    raise raw.to_error(mesh_name=mesh_name, rank=where, endpoint=endpoint)
            return raws[0] if single else ValueMesh(shape, raws)

        return Future(
            pending, resolve, lambda i, d: self._mesh._gone(i, d, shape), self._what(shape)
        )

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Send to every actor of the mesh; the future gives a ValueMesh of their replies."""
        shape = self._mesh._shape
        try:
            pending = self._mesh._send(shape, self._name, args, kwargs, True)
        except SupervisionError as e:
            return Future.failed(e)
        return self._future(shape, pending, single=False)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send to the only actor of a mesh of one; the future gives its reply."""
        shape = self._mesh._shape
        if len(shape) != 1:
            raise ValueError(
                f"call_one on {self._mesh.name!r} of size {len(shape)} {shape.sizes}: call_one "
                "needs a mesh of one actor; slice it first (e.g. mesh.slice(procs=0)), or use "
                "call() or choose()"
            )
        try:
            pending = self._mesh._send(shape, self._name, args, kwargs, True)
        except SupervisionError as e:
            return Future.failed(e)
        return self._future(shape, pending, single=True)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Send to one live actor, preferring one with none of this caller's choose() calls
        running.

        An actor whose proc is known to be dead is never chosen while a live one is left (as in
        Monarch, a partly failed mesh stays usable through its live ranks; supervision reports
        the dead ones). When every actor's proc is dead, the future fails at once with a
        SupervisionError that says none is left and how the first one ended.
        """
        shape = self._mesh._shape
        key = self._mesh._state.key
        pstate = self._mesh._state.proc_state
        with pstate.lock:
            dead = {r: pstate.dead[r] for r in shape.ranks if r in pstate.dead}
        if len(dead) == len(shape.ranks):
            first = next(iter(dead.values()))
            failure = MeshFailure(
                self._mesh.name,
                tuple(dead),
                first.kind,
                f"no live actor left to choose from: all {len(dead)} procs are dead (rank "
                f"{first.ranks[0]}: {first.cause})",
                exit_code=first.exit_code,
                signal=first.signal,
                actor=first.actor,
            )
            return Future.failed(SupervisionError(failure))
        with _sender.lock:
            inflight = {r: _sender.chosen.get((key, r), []) for r in shape.ranks if r not in dead}
            done = _finished([p for ps in inflight.values() for p in ps])
            load = {}
            for rank, ps in inflight.items():
                _sender.chosen[(key, rank)] = [p for p in ps if id(p) not in done]
                load[rank] = len(_sender.chosen[(key, rank)])
            least = min(load.values())
            candidates = [i for i, r in enumerate(shape.ranks) if load.get(r) == least]
            index = candidates[next(_sender.round_robin) % len(candidates)]
        one = _index_shape(shape, index)
        try:
            pending = self._mesh._send(one, self._name, args, kwargs, True)
        except SupervisionError as e:
            return Future.failed(e)
        with _sender.lock:
            _sender.chosen.setdefault((key, shape.ranks[index]), []).extend(pending)
        return self._future(one, pending, single=True)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Send to every actor now; returns one future per actor at once, in order of
        arrival: the k-th resolves with the k-th reply to come in (or raises its error).
        Iterating never waits, so `for f in ep.stream(): await f` keeps an event loop free."""
        shape = self._mesh._shape
        try:
            pending = self._mesh._send(shape, self._name, args, kwargs, True)
        except SupervisionError as e:
            return iter([Future.failed(e)])
        replies = [
            self._future(_index_shape(shape, i), [p], single=True, rank=i)
            for i, p in enumerate(pending)
        ]
        what = f"stream of {self._name}"
        return iter(
            Future([slot], lambda raw: replies[raw[0]].get(), _never_gone, what)
            for slot in backend.arrivals(pending)
        )

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting; failures go to the mesh owner's supervision."""
        self._mesh._send(self._mesh._shape, self._name, args, kwargs, False)


# Forwards `send`'s replies to their ports: one thread, so replies go on in order of arrival,
# and never on the thread that saw them arrive (a Ray or channel I/O thread).
_forwarder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raymesh-send")


def send(
    endpoint: EndpointRef[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    port: Port[Any] | None = None,
    selection: str = "all",
) -> None:
    """Monarch's `send`: message every actor of `endpoint`'s mesh (`selection="all"`) or one
    of them (`"choose"`) without waiting. With a `port` (a `Channel`'s), each actor's reply is
    sent on it as it arrives, and an error as `port.exception(...)` (the receiver's `recv()`
    raises ActorError); without one, a failure goes to the mesh owner's supervision, as for
    `broadcast`."""
    if not isinstance(endpoint, EndpointRef):
        raise TypeError(f"send(endpoint={endpoint!r}): give an actor mesh's endpoint (mesh.method)")
    if selection not in ("all", "choose"):
        raise ValueError(f"send(selection={selection!r}): give 'all' or 'choose'")
    if port is None:
        mesh = endpoint._mesh
        shape = mesh._shape
        if selection == "choose":
            shape = _index_shape(shape, random.randrange(len(shape)))
        mesh._send(shape, endpoint._name, tuple(args), dict(kwargs), False)
        return
    replies = (
        endpoint.stream(*args, **kwargs)
        if selection == "all"
        else iter([endpoint.choose(*args, **kwargs)])
    )
    for reply in replies:
        backend.when_done(reply._items, functools.partial(_forwarder.submit, _forward, reply, port))


def _forward(reply: Future[Any], port: Port[Any]) -> None:
    try:
        try:
            value = reply.get(timeout=0)
        except (ActorError, SupervisionError) as e:
            port.exception(e)
        else:
            port.send(value)
    except RuntimeError:  # a `once` port took its one value already
        logger.warning("raymesh: send() dropped a reply: its port took no more values")


def _never_gone(index: int, detail: str) -> BaseException:  # an arrival slot never fails
    return RuntimeError(detail)


def _index_shape(shape: Shape, index: int) -> Shape:
    """The element at row-major `index` of `shape`, as a mesh of one with no axes."""
    return Shape(Shape.of({}).extent, (shape.ranks[index],))


def _finished(pending: list[Any]) -> set[int]:
    """The ids of the calls in `pending` that have completed, without waiting."""
    return {id(p) for p, done in zip(pending, backend.done(pending)) if done}
