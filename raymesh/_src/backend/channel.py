"""Channels: the fast path for small messages to a proc on the caller's own host, beside Ray's
actor calls. ZeroMQ (pyzmq) over a Unix socket.

Why: a Ray actor call costs about 1.3 ms round trip on this project's 2-core machines (task
submission, the raylet's bookkeeping, gRPC), where a Unix socket round trip costs 0.04 ms.
A message goes over a channel when its arguments pickle small (under 1 MiB) and hold no Ray
object (an actor handle or object ref, which Ray must count). Everything else stays on Ray:
large buffers (put once in the object store, mapped zero-copy by the proc), Ray objects, and
procs on other hosts. Ordering does not depend on the transport: `ProcRuntime` orders each
caller's messages by sequence number, so the two paths mix freely.

Guarantees:
- A proc's channel listens on a Unix socket in a directory only this user can enter, never on
  a network port.
- A proc that dies fails every call pending on its channel within milliseconds: the kernel
  closes its socket, ZeroMQ reports the disconnect, and calls sent after that fail at once. Each
  fails with `ChannelFailed`, which `refs.get` turns into `ProcGone` like Ray's dead-actor error.
- A reply that pickles large or holds a Ray object is not sent over the channel: the proc keeps
  it and the caller fetches it through Ray (`take_reply`), so it travels the object store.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import os
import pickle
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any

import ray
import zmq
from zmq.utils.monitor import recv_monitor_message

# Messages and replies that pickle to more than this go through Ray's object store instead.
LARGE_BYTES = 1 << 20

_LINGER_MS = 60_000  # how long a closed socket keeps trying to deliver what it has queued
_VALUE, _FETCH = b"v", b"f"  # reply kinds: the pickled value, or "fetch it through Ray"
_DEAD_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED


class ChannelFailed(Exception):
    """A call over a channel will never be answered: its proc is gone."""


class _NeedsRay(Exception):
    pass


class _Pickler(ray.cloudpickle.CloudPickler):
    """cloudpickle (lambdas and classes defined in __main__ work, as on Ray), refusing Ray
    objects: those must travel through Ray so that it counts their references."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
            raise _NeedsRay
        return super().reducer_override(obj)


def dumps(value: Any) -> bytes | None:
    """`value` pickled for a channel; None when it must go through Ray instead (large, holds
    a Ray object, or cannot be pickled here: Ray's path then reports why)."""
    import io

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:
        return None
    data = buf.getvalue()
    return data if len(data) <= LARGE_BYTES else None


def enabled() -> bool:
    """Whether small messages may take channels: `RAYMESH_CHANNELS` is 1 (the default) or 0."""
    value = os.environ.get("RAYMESH_CHANNELS", "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"RAYMESH_CHANNELS={value!r}: use 1 (small messages to procs on this host take a "
            "Unix socket; the default) or 0 (every message goes through Ray)"
        )
    return value == "1"


def socket_dir() -> str:
    """Where this user's procs put their sockets: private to the user (mode 0700)."""
    path = os.path.join(tempfile.gettempdir(), f"raymesh-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must belong to this user with mode 0700 (it holds the procs' sockets); "
            "remove it or fix its owner and mode"
        )
    global _swept
    if not _swept:
        _swept = True
        _sweep(path)
    return path


_swept = False


def _address(role: str) -> str:
    """A new socket address for this process in `role` ("proc", "caller"): unique to the
    process, not just its pid, because pids wrap and the other end remembers addresses (a caller
    refuses those of dead procs; a proc keeps a socket per caller it has replied to)."""
    name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
    return f"ipc://{os.path.join(socket_dir(), name)}"


def _listen(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A socket receiving at `address`, whose file goes with this process."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    atexit.register(_unlink, address)
    return sock


def _unlink(address: str) -> None:
    try:
        os.unlink(address.removeprefix("ipc://"))
    except OSError:
        pass


def _sweep(path: str) -> None:
    """Remove the sockets of processes that are gone (a SIGKILLed proc leaves its file)."""
    for name in os.listdir(path):
        pid = name.split("-")[1].split(".")[0] if name.count("-") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _unlink(os.path.join(path, name))


def _push(local: threading.local, ctx: zmq.Context, address: bytes) -> zmq.Socket:
    """This thread's sending socket to `address` (ZeroMQ sockets are single-threaded, so each
    thread sends on its own: no lock, no hand-off to another thread)."""
    pushes = local.__dict__.setdefault("pushes", {})
    sock = pushes.get(address)
    if sock is None:
        sock = pushes[address] = ctx.socket(zmq.PUSH)
        # When the thread ends, its sockets close with it: what is still queued (the connection
        # may not even be up yet) must still go out, or the proc waits for a lost message.
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 0)  # queue like Ray does; never block a sender
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # the other end never comes back
        sock.connect(address.decode())
    return sock


class Server:
    """A proc's end: one I/O thread receives messages and runs each on a thread of a pool (a
    message may wait for its turn, so one thread each), which sends its reply straight to the
    caller's reply socket."""

    def __init__(
        self,
        handler: Callable[[tuple, Any, BaseException | None], Any],
        failed: Callable[[BaseException], Any],
        threads: int,
    ) -> None:
        """`handler(header, payload, error)` -> the reply, where `error` is why the payload
        did not unpickle here (then `payload` is None): the header always does, so the message
        still takes its turn. `failed(error)` -> the reply when `handler` itself raised."""
        self._handler = handler
        self._failed = failed
        self._ctx: zmq.Context = zmq.Context.instance()
        self.address = _address("proc")
        self._requests = _listen(self._ctx, self.address)
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "raymesh-message")
        self._kept: dict[bytes, Any] = {}  # replies waiting for take_reply
        threading.Thread(target=self._loop, name="raymesh-channel", daemon=True).start()

    def take_reply(self, msgid: bytes) -> Any:
        """A kept reply (once). One whose caller died before asking stays until the proc ends."""
        return self._kept.pop(msgid)

    def _loop(self) -> None:
        while True:
            frames = self._requests.recv_multipart()
            self._pool.submit(self._run, *frames)

    def _run(self, reply_to: bytes, msgid: bytes, header: bytes, data: bytes) -> None:
        payload, error = None, None
        try:
            payload = pickle.loads(data)
        except BaseException as e:
            error = e
        try:
            result = self._handler(pickle.loads(header), payload, error)
        except BaseException as e:
            result = self._failed(e)
        if not msgid:  # no reply wanted (broadcast)
            return
        payload = dumps(result)
        if payload is None:
            self._kept[msgid] = result
            frames = [msgid, _FETCH, b""]
        else:
            frames = [msgid, _VALUE, payload]
        try:
            _push(self._local, self._ctx, reply_to).send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the caller is gone


class _Pending:
    __slots__ = ("address", "fetch", "future")

    def __init__(self, address: bytes, future: concurrent.futures.Future, fetch: Any) -> None:
        self.address = address
        self.future = future
        self.fetch = fetch


class _Client:
    """This process's end of its channels. Callers send on their own thread's sockets; one I/O
    thread receives every reply (on this process's reply socket) and watches each proc it has
    messaged for the disconnect that says its process is gone."""

    def __init__(self) -> None:
        self._ctx: zmq.Context = zmq.Context.instance()
        self._reply_to = _address("caller")
        self._replies = _listen(self._ctx, self._reply_to)
        self._wake_address = f"inproc://raymesh-watch-{id(self):x}"
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[bytes, _Pending] = {}
        self._dead: dict[bytes, str] = {}
        self._watched: set[bytes] = set()
        self._elsewhere: set[bytes] = set()  # procs whose socket this process cannot see
        threading.Thread(target=self._loop, name="raymesh-channels", daemon=True).start()

    def call(
        self,
        address: str,
        header: tuple,
        payload: Any,
        reply: bool,
        fetch: Callable[[bytes], Any],
    ) -> concurrent.futures.Future | None:
        """Send a message: `header` (plain data: it must unpickle anywhere) and `payload`; None
        when the payload must go through Ray. `fetch(msgid)` -> an object ref of a reply the
        proc kept. Without `reply`, the future is done at once."""
        addr = address.encode()
        if addr in self._elsewhere:
            return None
        if addr not in self._watched and not os.path.exists(address.removeprefix("ipc://")):
            # Same host, but another file system (the proc runs in a container of its own):
            # Ray still reaches it.
            self._elsewhere.add(addr)
            return None
        data = dumps(payload)
        if data is None:
            return None
        future: concurrent.futures.Future = concurrent.futures.Future()
        msgid = next(self._ids).to_bytes(8, "little") if reply else b""
        with self._lock:
            cause = self._dead.get(addr)
            if cause is None and reply:
                self._pending[msgid] = _Pending(addr, future, fetch)
            watch = addr not in self._watched
            self._watched.add(addr)
        if watch:  # the I/O thread starts watching this proc
            _push(self._local, self._ctx, self._wake_address.encode()).send(addr)
        if cause is None:
            try:
                _push(self._local, self._ctx, addr).send_multipart(
                    [self._reply_to.encode(), msgid, pickle.dumps(header, 5), data], zmq.NOBLOCK
                )
            except zmq.Again:  # no connection left to the proc: it is gone
                cause = "its process exited (its channel closed)"
        if cause is not None:
            with self._lock:
                self._pending.pop(msgid, None)
            future.set_exception(ChannelFailed(cause))
        elif not reply:
            future.set_result(None)
        return future

    def close(self, address: bytes, cause: str) -> None:
        """The proc at `address` is gone: fail its pending calls, refuse new ones."""
        with self._lock:
            if address in self._dead:
                return
            self._dead[address] = cause
            lost = [m for m, p in self._pending.items() if p.address == address]
            futures = [self._pending.pop(m).future for m in lost]
        for f in futures:
            f.set_exception(ChannelFailed(cause))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        # One idle connection per proc, only to hear of its end: ZeroMQ reports the disconnect
        # (or a refused connect, for a proc already gone) on its monitor socket.
        monitors: dict[zmq.Socket, tuple[bytes, zmq.Socket]] = {}
        while True:
            for sock, _ in poller.poll():
                if sock is self._replies:
                    msgid, kind, data = sock.recv_multipart()
                    with self._lock:
                        pending = self._pending.pop(msgid, None)
                    if pending is not None:
                        self._resolve(pending, msgid, kind, data)
                elif sock is self._wake:
                    addr = sock.recv()
                    watcher = self._ctx.socket(zmq.PUSH)  # never sends
                    watcher.setsockopt(zmq.LINGER, 0)
                    watcher.setsockopt(zmq.RECONNECT_IVL, -1)
                    monitor = watcher.get_monitor_socket(_DEAD_EVENTS)
                    monitors[monitor] = (addr, watcher)
                    poller.register(monitor, zmq.POLLIN)
                    watcher.connect(addr.decode())
                else:
                    recv_monitor_message(sock)
                    addr, watcher = monitors.pop(sock)
                    poller.unregister(sock)
                    watcher.disable_monitor()
                    sock.close(0)
                    watcher.close(0)
                    self.close(addr, "its process exited (its channel closed)")

    def _resolve(self, pending: _Pending, msgid: bytes, kind: bytes, data: bytes) -> None:
        future = pending.future
        if kind == _VALUE:
            try:
                future.set_result(pickle.loads(data))
            except Exception as e:
                future.set_exception(e)
            return
        fetched = pending.fetch(msgid).future()  # the reply travels through Ray

        def done(f: concurrent.futures.Future) -> None:
            error = f.exception()
            if error is None:
                future.set_result(f.result())
            else:
                future.set_exception(ChannelFailed(str(error).splitlines()[0][:300]))

        fetched.add_done_callback(done)


_client: _Client | None = None
_client_lock = threading.Lock()


def client() -> _Client:
    global _client
    with _client_lock:
        if _client is None:
            _client = _Client()
        return _client
