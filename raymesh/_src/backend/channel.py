"""Channels: the fast path for small messages to a proc on the caller's own host, beside Ray's
actor calls. ZeroMQ (pyzmq) over a Unix socket.

Why: a Ray actor call costs about 1.3 ms round trip on this project's 2-core machines (task
submission, the raylet's bookkeeping, gRPC), where a Unix socket round trip costs 0.04 ms.
A message goes over a channel when its arguments pickle small (under 1 MiB) and hold no Ray
object (an actor handle or object ref, which Ray must count). Everything else stays on Ray:
large buffers (put once in the object store, mapped zero-copy by the proc), Ray objects, and
procs on other hosts. Ordering does not depend on the transport: `ProcRuntime` orders each
caller's messages by sequence number, so the two paths mix freely.

This module is the two ends (`Server` in a proc, the caller's `client()`) and what decides the
path (`enabled`, `dumps`); the key and each frame's MAC are `channel_auth`, the socket
directory and the sockets `channel_sockets`.

Guarantees:
- A proc's channel listens on a Unix socket in a directory only this user can enter, never on
  a network port: `$XDG_RUNTIME_DIR/raymesh` (else `raymesh-<uid>` in the temp dir), created
  with mode 0700 and refused (PermissionError naming it and the fix) when it is a symbolic link,
  not this user's, or open to its group or others.
- Only frames from processes of this Ray cluster are unpickled: every frame (message and reply)
  carries an HMAC-SHA256 of its parts under the cluster's channel key, and one whose MAC is
  missing or wrong is dropped unread (counted, and logged at most once a minute). The key is 32
  random bytes made by the first raymesh process that needs it and kept in Ray's GCS key-value
  store: processes learn it from Ray, as they learn a proc's address, so it never appears in a
  log, a URL, a command line or an environment. (Whoever can read Ray's GCS can already run
  code on the cluster; what the key keeps out is any other process, of this user or another,
  that can reach the socket.)
- A proc that dies fails every call pending on its channel within milliseconds: the kernel
  closes its socket, ZeroMQ reports the disconnect, and calls sent after that fail at once. Each
  fails with `ChannelFailed`, which `refs.get` turns into `ProcGone` like Ray's dead-actor error.
- A reply that pickles large or holds a Ray object is not sent over the channel: the proc keeps
  it and the caller fetches it through Ray (`take_reply`), so it travels the object store.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import ray
import zmq
from zmq.utils.monitor import recv_monitor_message

from raymesh._src.backend.channel_auth import (
    REPLY,
    REQUEST,
    Drops,
    Mac,
    current_mac,
    runtime_mac,
    signed,
    verified,
)
from raymesh._src.backend.channel_sockets import listen, new_address, push
from raymesh._src.backend.switches import switch

# Messages and replies that pickle to more than this go through Ray's object store instead.
LARGE_BYTES = 1 << 20

VALUE, FETCH = b"v", b"f"  # reply kinds: the pickled value, or "fetch it through Ray"
_DEAD_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED

logger = logging.getLogger("raymesh")


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
    return switch(
        "RAYMESH_CHANNELS",
        True,
        on="small messages to procs on this host take a Unix socket",
        off="every message goes through Ray",
    )


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
        self._mac = runtime_mac()
        self._ctx: zmq.Context = zmq.Context.instance()
        self.address = new_address("proc")
        self.drops = Drops(f"the proc channel {self.address}")
        self._requests = listen(self._ctx, self.address)
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
            # Checked on the pool's thread: a large message's MAC (about 0.6 ms a MiB) must not
            # hold up the small ones behind it.
            self._pool.submit(self._run, frames)

    def _run(self, frames: list[bytes]) -> None:
        parts = verified(self._mac, REQUEST, frames, 4)
        if parts is None:  # not from this cluster: nothing of it is unpickled, nor answered
            self.drops.add(frames)
            return
        reply_to, msgid, header, data = parts
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
            reply = [msgid, FETCH, b""]
        else:
            reply = [msgid, VALUE, payload]
        try:
            push(self._local, self._ctx, reply_to).send_multipart(
                signed(self._mac, REPLY, reply), zmq.NOBLOCK
            )
        except zmq.Again:
            pass  # the caller is gone


class _Pending:
    __slots__ = ("address", "fetch", "future", "mac")

    def __init__(
        self, address: bytes, future: concurrent.futures.Future, fetch: Any, mac: Mac
    ) -> None:
        self.address = address
        self.future = future
        self.fetch = fetch
        self.mac = mac  # the reply's MAC is checked with the key the message was sent with


class _Client:
    """This process's end of its channels. Callers send on their own thread's sockets; one I/O
    thread receives every reply (on this process's reply socket) and watches each proc it has
    messaged for the disconnect that says its process is gone."""

    def __init__(self) -> None:
        self._ctx: zmq.Context = zmq.Context.instance()
        self._reply_to = new_address("caller")
        self.drops = Drops(f"the reply socket {self._reply_to}")
        self._replies = listen(self._ctx, self._reply_to)
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
        try:
            mac = runtime_mac()
        except Exception as e:  # Ray's GCS did not answer: Ray's path reports what is wrong
            logger.debug("raymesh: no channel key (%s): the message goes through Ray", e)
            return None
        future: concurrent.futures.Future = concurrent.futures.Future()
        msgid = next(self._ids).to_bytes(8, "little") if reply else b""
        with self._lock:
            cause = self._dead.get(addr)
            registered = cause is None and reply
            if registered:
                self._pending[msgid] = _Pending(addr, future, fetch, mac)
            watch = addr not in self._watched
            self._watched.add(addr)
        if watch:  # the I/O thread starts watching this proc
            push(self._local, self._ctx, self._wake_address.encode()).send(addr)
        if cause is None:
            try:
                parts = [self._reply_to.encode(), msgid, pickle.dumps(header, 5), data]
                push(self._local, self._ctx, addr).send_multipart(
                    signed(mac, REQUEST, parts), zmq.NOBLOCK
                )
            except zmq.Again:  # no connection left to the proc: it is gone
                cause = "its process exited (its channel closed)"
        if cause is not None:
            with self._lock:
                # The I/O thread may have failed this call already (close() pops what it fails).
                owned = not registered or self._pending.pop(msgid, None) is not None
            if owned:
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
                    self._receive(sock.recv_multipart())
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

    def _receive(self, frames: list[bytes]) -> None:
        """A reply: checked before anything of it is used (a forged one must not even take a
        pending call's place), then matched to its call."""
        msgid = frames[1] if len(frames) == 4 else b""
        with self._lock:
            pending = self._pending.get(msgid)
        # A reply to no pending call (its proc was declared gone first) is checked too, with
        # the key this process sends with now, only so that a forged one is counted.
        mac = pending.mac if pending is not None else current_mac()
        parts = verified(mac, REPLY, frames, 3) if mac is not None else None
        if parts is None:
            self.drops.add(frames)
            return
        with self._lock:
            pending = self._pending.pop(msgid, None)
        if pending is not None:
            self._resolve(pending, msgid, parts[1], parts[2])

    def _resolve(self, pending: _Pending, msgid: bytes, kind: bytes, data: bytes) -> None:
        future = pending.future
        if kind == VALUE:
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
