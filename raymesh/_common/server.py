"""An ASGI app served by uvicorn on a thread of the calling process, with an event loop of its
own.

raymesh.serve's front, raymesh.federated's edge server and raymesh.dashboard all start the
same way: `ServerThread` binds (loopback unless told otherwise), returns once the port is
known or raises what stopped it (OSError when the port is taken), and `stop()` ends the
server and its loop. uvicorn is imported here, when a server starts, so that importing raymesh
needs none of the HTTP extras.

Every server gets the same limits against slow or greedy clients, whatever its app does:
- at most `max_connections` open at once (uvicorn answers 503 beyond);
- a request's head and body have deadlines (`head_timeout_s`, `body_timeout_s`: 408, see
  `connection`), however the client paces its bytes: a client that connects and says nothing,
  or trickles a byte at a time, holds a slot for a bounded time only, so such clients cannot
  fill the cap and turn every later request away;
- an idle keep-alive connection is closed after `keep_alive_s`;
- an answer given before the body was read (413, 429) reaches a client still sending it
  (`connection`'s lingering close).
Bound beyond loopback without a token, or with one over plain HTTP, it logs a warning once
(`exposure`). Bound to loopback without a token (`authenticated=False`), it answers only
requests whose `Host` is localhost, 127.0.0.1 or [::1] (any port: an SSH tunnel's port
differs), 421 otherwise: a web page whose name was rebound to 127.0.0.1 (DNS rebinding)
reaches nothing. With a token (`authenticated=True`) the app checks who asks, by any name.
With `tls` (a certificate and key file, as `Tls`) it serves HTTPS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from raymesh._common.connection import MAX_HEAD_BYTES, protocol_class
from raymesh._common.http_error import HTTPError, RefusalLog
from raymesh._common.tls import Tls

__all__ = ["ServerThread", "exposure", "free_port", "is_loopback", "url_of"]

logger = logging.getLogger("raymesh")

# The names a loopback server without a token answers to (DNS rebinding: see the docstring).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ("": on every interface). Another process may take it
    before the caller binds it: use it where the caller cannot bind port 0 itself."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only ("localhost", 127.x.x.x, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure(host: str, *, token: bool, tls: bool) -> str | None:
    """Why a server bound to `host` is exposed, in words (None: it is not). The one wording
    of the warning every raymesh server gives when it is reachable from other machines with no
    token, or with one that crosses the network in the clear."""
    if is_loopback(host):
        return None
    if not token:
        return (
            f"{host} is reachable from other machines and no token is set: anyone who "
            "reaches it is served"
        )
    if not tls:
        return (
            f"{host} is reachable from other machines over plain HTTP: the token crosses the "
            "network in the clear"
        )
    return None


def url_of(host: str, port: int, *, tls: bool = False) -> str:
    """The URL a local client reaches `host:port` at (a wildcard bind is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class ServerThread:
    """`app` under uvicorn on a daemon thread named `name` (see the module docstring).

    before / after: coroutines run on the server's loop before it binds and after it stops
        (raymesh.serve's router starts and stops there, on the loop its requests run on).
    graceful_s: how long open requests (streams) get at `stop()` before the loop ends.
    uvloop: run on uvloop when it is installed (the serving path; others need no speed).
    tls: serve HTTPS with this certificate and key.
    max_connections: connections open at once; uvicorn answers 503 to more.
    keep_alive_s: an idle keep-alive connection is closed after this long.
    head_timeout_s, body_timeout_s: the deadlines of a request's head and of its body (408).
    authenticated: the app checks a token itself; False on a loopback bind: the Host check.
    exposure_fix: what the warning logged once a server is exposed (`exposure`) tells the user
        to do, e.g. "set token= and tls=".
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str,
        port: int,
        name: str,
        start_timeout_s: float = 60.0,
        graceful_s: int = 2,
        before: Callable[[], Awaitable[None]] | None = None,
        after: Callable[[], Awaitable[None]] | None = None,
        uvloop: bool = False,
        tls: Tls | None = None,
        max_connections: int = 1024,
        keep_alive_s: float = 5.0,
        head_timeout_s: float = 10.0,
        body_timeout_s: float = 60.0,
        authenticated: bool = False,
        exposure_fix: str = "give it a token and tls",
    ) -> None:
        self.host = host
        self.tls = tls
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._uvloop = uvloop
        if not authenticated and is_loopback(host):
            app = LoopbackHosts(app, RefusalLog(logger, name))
        self._args = (app, host, port, graceful_s, before, after)
        self._limits: dict[str, Any] = {
            "limit_concurrency": max_connections,
            "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
            "http": protocol_class(head_timeout_s, body_timeout_s),
        }
        if tls is not None:
            self._limits.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        try:
            self.port = started.result(timeout=start_timeout_s)
        except BaseException:
            self.stop()
            raise
        # Said here, once per server, so that no way of starting one goes without it.
        if (risk := exposure(host, token=authenticated, tls=tls is not None)) is not None:
            logger.warning("%s: %s (%s)", name, risk, exposure_fix)

    @property
    def url(self) -> str:
        return url_of(self.host, self.port, tls=self.tls is not None)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the server's loop; RuntimeError once the server has stopped."""
        if self.loop is None or self.loop.is_closed():
            coro.close()
            raise RuntimeError("the server has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop serving and wait up to `timeout` for the thread to end. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _run(self, started: concurrent.futures.Future[int]) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        if self._uvloop:
            try:
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:
                pass
        self.loop = loop = loop or asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(started))
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
        finally:
            loop.close()

    async def _main(self, started: concurrent.futures.Future[int]) -> None:
        import uvicorn

        app, host, port, graceful_s, before, after = self._args
        if before is not None:
            await before()
        try:
            config = uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=graceful_s,
                **self._limits,
            )
            self._server = server = uvicorn.Server(config)
            serving = asyncio.ensure_future(server.serve())
            while not server.started:
                if serving.done():  # it could not bind (the port is taken)
                    await serving
                    raise OSError(f"cannot serve on {host}:{port}")
                await asyncio.sleep(0.01)
            started.set_result(server.servers[0].sockets[0].getsockname()[1])
            await serving
        finally:
            if after is not None:
                await after()


class LoopbackHosts:
    """ASGI middleware: a request whose `Host` names anything but this machine's loopback is
    refused (421), and logged through `log`. A request with no Host (HTTP/1.0) passes: a
    browser always sends one."""

    def __init__(self, app: Any, log: Callable[[Any, HTTPError], None]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v for k, v in scope["headers"] if k == b"host"), b"")
            name = host.decode("latin-1").strip().lower()
            name = name[: name.index("]") + 1] if name.startswith("[") and "]" in name else name
            name = name.rpartition(":")[0] if name.count(":") == 1 else name
            if host and name not in LOOPBACK_NAMES:
                error = HTTPError(
                    421,
                    "MisdirectedRequest",
                    "this server is bound to loopback without a token and answers only "
                    "Host: localhost, 127.0.0.1 or [::1] (a page rebinding its name to "
                    "127.0.0.1 reaches nothing); give the server a token to reach it by "
                    "another name",
                    field="Host",
                    headers={"Connection": "close"},
                )
                self.log(scope, error)
                if scope["type"] == "http":
                    await error.send(send)
                return
        await self.app(scope, receive, send)
