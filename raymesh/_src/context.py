"""Where am I? `current_rank()`, `current_size()`, `current_actor_name()` and `context()` for
code running in an actor.

The proc sets an `ActorContext` while it runs an actor's constructor, endpoint or
`__supervise__` (a contextvar, so async endpoints and threads started with
`contextvars.copy_context()` see it too). Code that runs in a proc but outside any message (a
thread the user started) sees the proc's own rank. The controller is a mesh of one: rank 0 with
no axes, and its actor name is `controller,root[0]` (Monarch's root client, `<root>`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raymesh._src import backend
from raymesh._src.shape import Extent, Point

__all__ = [
    "ActorContext",
    "ActorId",
    "ActorInstance",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
]

_CONTROLLER_POINT = Point((), Extent((), ()))


@dataclass(frozen=True)
class ActorId:
    """Names one actor. `str(actor_id)` is `"<proc_id>,<uid>[<rank>]"`, unique per actor.

    proc_id: the proc it lives in, `"<proc mesh name>[<axis>=<coord>,...]"` (`"controller"`
        for the controller's own process).
    actor_name: the name its actor mesh was spawned with (Monarch's `actor_name`).
    uid: its actor mesh's unique id (the same on every rank of the mesh).
    rank: its linear rank in its actor mesh.
    """

    proc_id: str
    actor_name: str
    uid: str
    rank: int

    def __str__(self) -> str:
        return f"{self.proc_id},{self.uid}[{self.rank}]"


def proc_id(proc_mesh_name: str, point: Point) -> str:
    """A proc's id: its mesh's name and its coordinates (`procs[hosts=0,procs=1]`)."""
    if not len(point):
        return proc_mesh_name
    return proc_mesh_name + "[" + ",".join(f"{k}={v}" for k, v in point.items()) + "]"


class ActorInstance:
    """The running actor, as Monarch's `context().actor_instance`: the same for every message.

    rank: its point in its mesh (the `current_rank()` of its constructor).
    actor_id: its `ActorId`; `proc_id` the id of its proc.
    name: the name its mesh was spawned with; class_name: `module.QualifiedName` of its class.
    proc: its own proc as a mesh of one (`this_proc()` seen from the actor).
    abort(reason): fail this actor (see `abort`).

    proc_mesh: the proc mesh (the view) the actor was spawned on; creator: the actor that
    spawned it (the controller's is `<root>`, named "root"). None where unknown.
    """

    __slots__ = ("_abort", "actor_id", "class_name", "creator", "name", "proc_mesh", "rank")

    def __init__(
        self,
        actor_id: ActorId,
        rank: Point,
        class_name: str,
        abort: Callable[[str | None], None] | None = None,
    ) -> None:
        self.actor_id = actor_id
        self.rank = rank
        self.name = actor_id.actor_name
        self.class_name = class_name
        self._abort = abort
        self.creator: ActorInstance | None = None
        self.proc_mesh: Any = None

    @property
    def proc_id(self) -> str:
        return self.actor_id.proc_id

    @property
    def proc(self) -> Any:
        """This actor's proc as a proc mesh of one: spawn helpers beside the actor on it."""
        if _this_proc is None:
            raise RuntimeError(
                "import raymesh first: it provides `this_proc` (see provide_this_proc)"
            )
        return _this_proc()

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor now, as Monarch's `Instance.abort`: its supervision event goes to
        the mesh's owner (`__supervise__`, at the top the fault hook; `kind="actor_failed"`),
        and messages it has not started fail from now on. The endpoint that calls it runs to
        its end, and its reply still goes back."""
        if self._abort is None:
            raise RuntimeError(f"{self} is not an actor on a proc: there is nothing to abort")
        self._abort(reason)

    def __repr__(self) -> str:
        if not self.class_name:  # the root client, as Monarch names it
            return f"<{self.name}>"
        return actor_label(self.class_name, self.name, self.rank)

    def __reduce__(self) -> Any:  # its identity travels; abort, creator and mesh stay here
        return (ActorInstance, (self.actor_id, self.rank, self.class_name))


@dataclass(frozen=True)
class Spawner:
    """What a spawn tells the proc about where its actors come from.

    route: who watches their failures when not the procs' owner (see `supervision`);
    creator: the spawning actor (`ActorInstance.creator`); proc_mesh: the view spawned on.
    """

    route: str | None
    creator: ActorInstance
    proc_mesh: Any


def actor_label(class_name: str, name: str, rank: Point) -> str:
    """An actor as Monarch names it: `<module.Class name{'procs': 1/2}>` (no braces when its
    mesh has no axes)."""
    return f"<{class_name} {name}{rank if len(rank) else ''}>"


_ROOT_ID = ActorId("controller", "root", "root", 0)

# Makes this process's proc as a proc mesh of one (`this_proc`). The module that builds it
# (`raymesh._src.local_proc`) sits above this one and gives it here when imported; the `raymesh`
# package imports it, and Python imports a package before any of its modules, so it is in
# place before any actor can ask.
_this_proc: Callable[[], Any] | None = None


def provide_this_proc(make: Callable[[], Any]) -> None:
    """Set what `ActorInstance.proc` returns, called by the module that builds procs."""
    global _this_proc
    _this_proc = make


class ActorContext:
    """The calling actor and the message being handled.

    rank: this actor's point in its mesh (`current_rank()`).
    message_rank: this actor's point within the slice the current message was sent to; equal to
        `rank` for a call on the whole mesh, rank 0 of an extent with no axes for
        `call_one`/`choose`.
    actor_instance: the running actor (`ActorInstance`: `actor_id`, `rank`, `name`, `proc`,
        `abort()`), as in Monarch.
    mesh_name: the actor mesh's name; actor_key: this actor mesh's unique id.
    """

    __slots__ = (
        "_instance",
        "_message",
        "_message_rank",
        "actor_key",
        "mesh_name",
        "proc_mesh_name",
        "rank",
    )

    def __init__(
        self,
        rank: Point,
        message: Point | tuple[tuple[str, ...], tuple[int, ...], int],
        mesh_name: str,
        actor_key: str,
        proc_mesh_name: str,
        instance: ActorInstance | None = None,
    ) -> None:
        self.rank = rank
        # (labels, sizes, index) as it came off the wire; made a Point only when asked for,
        # since most endpoints never look at it.
        self._message_rank: Point | None = None
        self._message: tuple[tuple[str, ...], tuple[int, ...], int] = ((), (), 0)
        if isinstance(message, Point):
            self._message_rank = message
        else:
            self._message = message
        self.mesh_name = mesh_name
        self.actor_key = actor_key
        self.proc_mesh_name = proc_mesh_name
        self._instance = instance

    @property
    def message_rank(self) -> Point:
        if self._message_rank is None:
            labels, sizes, index = self._message
            self._message_rank = Extent(labels, sizes).point(index)
        return self._message_rank

    @property
    def actor_instance(self) -> ActorInstance:
        if self._instance is None:
            actor_id = ActorId(
                proc_id(self.proc_mesh_name, _proc_point or _CONTROLLER_POINT),
                self.mesh_name,
                self.actor_key,
                self.rank.rank,
            )
            self._instance = ActorInstance(actor_id, self.rank, "")
        return self._instance

    @property
    def gpu_ids(self) -> list:
        """The GPUs this actor's proc was given (empty on a CPU proc and in the controller,
        even where the machine has GPUs)."""
        return backend.gpu_ids()

    def __repr__(self) -> str:
        return (
            f"ActorContext({self.mesh_name!r}, rank={self.rank}, message_rank={self.message_rank})"
        )


_current: contextvars.ContextVar[ActorContext | None] = contextvars.ContextVar(
    "raymesh_actor_context", default=None
)
# The proc's own rank and mesh name, for code in a proc that runs outside a message.
_proc_point: Point | None = None
_proc_mesh_name: str | None = None


def set_proc_point(point: Point, proc_mesh_name: str | None = None) -> None:
    global _proc_point, _proc_mesh_name
    _proc_point = point
    _proc_mesh_name = proc_mesh_name


def proc_rank() -> int:
    """This process's rank in its proc mesh (0 in the controller)."""
    return _proc_point.rank if _proc_point is not None else 0


def enter(ctx: ActorContext) -> contextvars.Token:
    return _current.set(ctx)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)


def current_actor_context() -> ActorContext | None:
    return _current.get()


def context() -> ActorContext:
    """The current actor's context; outside any actor (the controller's script, a thread a
    proc's user started), the root client's, as in Monarch: `actor_instance` is `<root>`."""
    ctx = _current.get()
    if ctx is None:
        return _root_context()
    return ctx


def current_instance() -> ActorInstance:
    """The spawning identity of the caller: its actor, else the root client."""
    return context().actor_instance


def _root_context() -> ActorContext:
    """The root client's context: the controller's, or a proc's own outside any message."""
    if _proc_point is not None and _proc_mesh_name is not None:
        point, mesh = _proc_point, _proc_mesh_name
        actor_id = ActorId(proc_id(mesh, point), "root", "root", 0)
    else:
        point, mesh, actor_id = _CONTROLLER_POINT, "controller", _ROOT_ID
    return ActorContext(point, point, "root", "root", mesh, ActorInstance(actor_id, point, ""))


def current_rank() -> Point:
    """This actor's point in its mesh: `.rank` is the linear rank, `point["procs"]` a coordinate.

    A Mapping, so `other_mesh.slice(**current_rank())` picks the peer at the same coordinates.
    In the controller: rank 0 of an extent with no axes.
    """
    ctx = _current.get()
    if ctx is not None:
        return ctx.rank
    return _proc_point if _proc_point is not None else _CONTROLLER_POINT


def current_size() -> dict[str, int]:
    """The sizes of the current actor's mesh axes (`{}` in the controller)."""
    return dict(current_rank().extent)


def current_actor_name() -> str:
    """The current actor's id as a string (`str(context().actor_instance.actor_id)`, as in
    Monarch): `"<proc mesh>[<coords>],<actor mesh id>[<rank>]"`. Unique per actor, stable for
    its life. In the controller `"controller,root[0]"`; in a proc outside any message (a thread
    the user started), `"<proc mesh>[<coords>],root[0]"`."""
    return str(context().actor_instance.actor_id)
