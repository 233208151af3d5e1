"""An ASGI app served by uvicorn on a thread of the calling process, with an event loop of its
own.

raymesh.serve's front, raymesh.federated's edge server and raymesh.dashboard all start the
same way: `ServerThread` binds (loopback unless told otherwise), returns once the port is
known or raises what stopped it (OSError when the port is taken), and `stop()` ends the
server and its loop. uvicorn is imported here, when a server starts, so that importing raymesh
needs none of the HTTP extras.

Every server gets the same limits against slow or greedy clients: at most `max_connections`
open at once (uvicorn answers 503 beyond), idle keep-alive connections closed after
`keep_alive_s`, and a request's headers bounded by h11's incomplete-event size. With `tls`
(a certificate and key file, as `Tls`) it serves HTTPS.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from raymesh._common.tls import Tls

__all__ = ["ServerThread", "free_port", "url_of"]


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ("": on every interface). Another process may take it
    before the caller binds it: use it where the caller cannot bind port 0 itself."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    ) -> None:
        self.host = host
        self.tls = tls
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._uvloop = uvloop
        self._args = (app, host, port, graceful_s, before, after)
        self._limits: dict[str, Any] = {
            "limit_concurrency": max_connections,
            "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": 64 * 1024,
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
