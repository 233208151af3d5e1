"""Where am I? `current_rank()`, `current_size()` and `context()` for code running in an actor.

The proc sets an `ActorContext` while it runs an actor's constructor or endpoint (a contextvar,
so async endpoints and threads started with `contextvars.copy_context()` see it too). Code that
runs in a proc but outside any message (a thread the user started) sees the proc's own rank.
The controller is a mesh of one: rank 0 with no axes.
"""

from __future__ import annotations

import contextvars

from raymesh._src import backend
from raymesh._src.shape import Extent, Point

__all__ = ["ActorContext", "context", "current_rank", "current_size"]

_CONTROLLER_POINT = Point((), Extent((), ()))


class ActorContext:
    """The calling actor and the message being handled.

    rank: this actor's point in its mesh (`current_rank()`).
    message_rank: this actor's point within the slice the current message was sent to; equal to
        `rank` for a call on the whole mesh, rank 0 of an extent with no axes for
        `call_one`/`choose`.
    mesh_name: the actor mesh's name; actor_key: this actor instance's unique id.
    """

    __slots__ = ("_message", "_message_rank", "actor_key", "mesh_name", "proc_mesh_name", "rank")

    def __init__(
        self,
        rank: Point,
        message: Point | tuple[tuple[str, ...], tuple[int, ...], int],
        mesh_name: str,
        actor_key: str,
        proc_mesh_name: str,
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

    @property
    def message_rank(self) -> Point:
        if self._message_rank is None:
            labels, sizes, index = self._message
            self._message_rank = Extent(labels, sizes).point(index)
        return self._message_rank

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
# The proc's own rank, for code in a proc that runs outside a message.
_proc_point: Point | None = None


def set_proc_point(point: Point) -> None:
    global _proc_point
    _proc_point = point


def enter(ctx: ActorContext) -> contextvars.Token:
    return _current.set(ctx)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)


def current_actor_context() -> ActorContext | None:
    return _current.get()


def context() -> ActorContext:
    """The current actor's context. Raises RuntimeError outside an actor's endpoint."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "raymesh.context() is only defined inside an actor's endpoint or constructor; "
            "use current_rank() for a rank that is also defined in the controller"
        )
    return ctx


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
