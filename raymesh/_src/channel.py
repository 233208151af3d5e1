"""`Channel`: a `Port` that can be sent to any actor and sent on any number of times, and the
`PortReceiver` that reads what arrives (Monarch's low-level messaging).

    port, receiver = Channel.open()     # in the controller or in an actor
    workers.produce.broadcast(port)     # each worker calls port.send(value), as often as it likes
    value = receiver.recv().get()       # or `await receiver.recv()`

It rides on the endpoints' path, not beside it: each process that opens channels has one
*mailbox*, an actor spawned on first use, on the process's own proc in an actor's process, and
on a proc of its own in the controller (no other process can message the controller).
`port.send(v)` is a `broadcast` to the mailbox's `put`, so it keeps the endpoints' guarantees:
FIFO per sender, small values over the host's channel, large ones through the object store,
fire-and-forget. A receiver in the mailbox's process reads its queue directly; one elsewhere
(the controller) calls the mailbox's `take`, which waits for the next value.

Guarantees: the values one sender sends arrive in the order sent (several senders interleave);
`recv()` futures resolve in the order they were made, each with the next value;
`port.exception(e)` makes the matching `recv()` raise ActorError. A `once` channel's port sends
one value (a second send raises RuntimeError). A send to a mailbox whose proc died is lost and
reported to the sender's supervision, as any broadcast; a `recv()` that nothing answers waits
until its `get(timeout)`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections import deque
from typing import Any, Generic, TypeVar

from raymesh._src.actor import Actor
from raymesh._src.context import current_actor_context
from raymesh._src.endpoint import endpoint
from raymesh._src.errors import ActorError, MeshFailure, RemoteFailure, SupervisionError
from raymesh._src.future import Future
from raymesh._src.port import Port

R = TypeVar("R")

__all__ = ["Channel", "PortReceiver"]

_Item = tuple[int, Any]  # (rank of the sender or -1, value or RemoteFailure)


class _Inbox:
    """One channel's values not yet received, and the receives waiting for a value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[_Item] = deque()
        self._waiting: deque[concurrent.futures.Future] = deque()

    def put(self, item: _Item) -> None:
        with self._lock:
            while self._waiting:
                waiter = self._waiting.popleft()
                if waiter.set_running_or_notify_cancel():
                    break
            else:
                self._items.append(item)
                return
        waiter.set_result(item)

    def take(self) -> concurrent.futures.Future:
        """A future of the next value (already resolved when one is waiting)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._items:
                self._waiting.append(future)
                return future
            item = self._items.popleft()
        future.set_running_or_notify_cancel()
        future.set_result(item)
        return future


class Mailbox(Actor):
    """A process's mailbox: the inboxes of the channels opened there (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, _Inbox] = {}

    def inbox(self, channel: str) -> _Inbox:
        with self._lock:
            return self._inboxes.setdefault(channel, _Inbox())

    # Both sync (an actor's endpoints are one kind), so that it never needs the proc's event
    # loop: a channel opened inside an async endpoint spawns the mailbox on that proc while
    # the endpoint holds the loop. `take` replies through its port once a value is there.
    @endpoint
    def put(self, channel: str, item: _Item) -> None:
        self.inbox(channel).put(item)

    @endpoint(explicit_response_port=True)
    def take(self, port: Port[_Item], channel: str) -> None:
        self.inbox(channel).take().add_done_callback(lambda f: port.send(f.result()))


class _Mailboxes:
    """This process's mailbox: the actor mesh senders message, and the instance when it lives
    in this process (None in the controller, whose mailbox is on a proc of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.mesh: Any = None
        self.local: Mailbox | None = None

    def get(self) -> tuple[Any, Mailbox | None]:
        with self._lock:
            if self.mesh is None:
                self.mesh, self.local = _spawn_mailbox()
            return self.mesh, self.local


def _spawn_mailbox() -> tuple[Any, Mailbox | None]:
    from raymesh._src.actor_mesh import spawn_actors
    from raymesh._src.host_mesh import this_host
    from raymesh._src.local_proc import this_proc
    from raymesh._src.proc import current_runtime

    runtime = current_runtime()
    if runtime is None:  # the controller: a proc of its own, which ends with the controller
        procs = this_host().spawn_procs(name="raymesh-mailbox", cpus_per_proc=0)
        return procs.spawn("mailbox", Mailbox), None
    # An actor's process: on its own proc, owned by nobody (all the process's actors share it).
    mesh = spawn_actors(this_proc(), "mailbox", Mailbox, (), {}, owned=False)
    return mesh, runtime.instance(mesh._state.key)


_mailboxes = _Mailboxes()


class _ChannelSink:
    """Where a channel's `Port` sends: the opener's mailbox and the channel's id. Pickled
    with the port, so that a port sent to another actor sends from there."""

    def __init__(self, mailbox: Any, channel: str, once: bool) -> None:
        self.mailbox = mailbox
        self.channel = channel
        self.once = once
        self.sent = False

    def settle(self, value: Any) -> bool:
        if self.once:
            if self.sent:
                return False
            self.sent = True
        ctx = current_actor_context()
        rank = ctx.rank.rank if ctx is not None else -1
        self.mailbox.put.broadcast(self.channel, (rank, value))
        return True

    def dropped(self) -> None:  # a channel's port may be dropped: the receiver waits on
        pass

    def __reduce__(self) -> Any:
        return (_ChannelSink, (self.mailbox, self.channel, self.once))


class PortReceiver(Generic[R]):
    """The receiving end of a `Channel`: `recv()` gives a `Future` of the next value. Stays in
    the process that opened the channel (it cannot be sent)."""

    def __init__(self, mailbox: Any, local: Mailbox | None, channel: str) -> None:
        self._mailbox = mailbox
        self._local = local
        self._channel = channel

    def recv(self) -> Future[R]:
        """A future of the next value; raises ActorError if the sender sent an exception."""
        return self._recv(lambda item: item[1])

    def ranked(self) -> RankedPortReceiver[R]:
        """A receiver of `(rank of the sending actor, value)` pairs (-1: the controller)."""
        return RankedPortReceiver(self._mailbox, self._local, self._channel)

    def _recv(self, shape: Any) -> Future[Any]:
        what = f"recv on channel {self._channel}"
        if self._local is not None:
            pending = [self._local.inbox(self._channel).take()]
        else:
            pending = self._mailbox.take.call_one(self._channel)._items
        return Future(pending, lambda raws: shape(_value(raws[0], what)), _gone(what), what)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a PortReceiver reads in the process that opened its channel and cannot be sent; "
            "send the Port instead"
        )


class RankedPortReceiver(PortReceiver[R]):
    """A `PortReceiver` whose values come with the rank of the actor that sent them."""

    def recv(self) -> Future[tuple[int, R]]:  # type: ignore[override]
        return self._recv(lambda item: item)


def _value(item: _Item, what: str) -> _Item:
    rank, value = item
    if isinstance(value, RemoteFailure):
        raise ActorError(
            mesh_name="channel",
            rank=rank,
            endpoint=what,
            remote_type=value.remote_type,
            remote_message=value.remote_message,
            remote_traceback=value.remote_traceback,
        )
    return item


def _gone(what: str) -> Any:
    def gone(index: int, detail: str) -> BaseException:
        failure = MeshFailure("raymesh-mailbox", (0,), "proc_died", f"{what}: {detail}")
        return SupervisionError(failure)

    return gone


class Channel(Generic[R]):
    """Opens channels: `port, receiver = Channel.open()` (also `Channel[int].open()`)."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        """A new channel: its `Port` (send it anywhere; `send(v)`, `exception(e)`) and its
        `PortReceiver` (here). `once`: the port sends one value."""
        mesh, local = _mailboxes.get()
        channel = uuid.uuid4().hex
        return Port(_ChannelSink(mesh, channel, once)), PortReceiver(mesh, local, channel)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], RankedPortReceiver[R]]:
        """`open()`, with a receiver of (sender rank, value) pairs."""
        port, receiver = Channel[R].open(once)
        return port, receiver.ranked()
