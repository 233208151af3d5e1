"""`Server`: raymesh's own backend, the `App` that `deploy` returns for backend="raymesh".

The HTTP front (uvicorn, Starlette) and the router run on one event loop, on a thread of the
calling process (the controller): a request reaches a replica in one actor call, with no proxy
between. `Server` methods may be called from any thread.

Each room is handed its section of the config and nothing else: the router its
`RouterConfig` and the batcher's `BatchConfig`, the front its `FrontConfig`; the server reads
the front's address and connection limits for uvicorn, and the replicas' start bound for how
long starting and reloading may take.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from raymesh._common import ServerThread, url_of
from raymesh.serve.app import App, Endpoint, Reply
from raymesh.serve.batching import BatchConfig
from raymesh.serve.http.front import make_app
from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelSpec
from raymesh.serve.routing.replica import ReplicaProc, spawn_replica
from raymesh.serve.routing.router import Router
from raymesh.serve.sections import FrontConfig, RouterConfig

__all__ = ["Server"]

logger = logging.getLogger("raymesh.serve")


class Server(App):
    """Serves `spec` from the router's replicas behind raymesh's front; `start()` binds it.

    start_replica: how a replica starts, `spawn_replica`'s signature (tests pass a fake)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        router: RouterConfig,
        batch: BatchConfig,
        front: FrontConfig,
        start_replica: Callable[..., ReplicaProc] = spawn_replica,
    ) -> None:
        self.front = front
        self.metrics = Metrics(batch.max_batch_size)
        self.router = Router(spec, router, batch, self.metrics, start_replica=start_replica)
        self.predict = Endpoint(self._predict)
        self.generate = Endpoint(self._generate)
        self.port = front.port
        self._start_timeout_s = router.replicas.start_timeout_s
        self._server: ServerThread | None = None

    @property
    def url(self) -> str:
        return url_of(self.front.host, self.port, tls=self.front.tls is not None)

    def start(self) -> Server:
        """Start `min` replicas and bind the front; returns once it serves (or raises what
        stopped a replica)."""
        # The HTTP front and the router share the server's loop: the router starts there
        # before the server binds and stops there after it closes.
        front = self.front
        self._server = ServerThread(
            make_app(self.router, front, self.metrics),
            host=front.host,
            port=front.port,
            name="raymesh-serve",
            start_timeout_s=self._start_timeout_s + 30,
            graceful_s=5,  # open streams get this long, then the loop ends
            before=self.router.start,
            after=self.router.stop,
            uvloop=True,
            tls=front.tls,
            max_connections=front.max_connections,
            keep_alive_s=front.keep_alive_s,
            head_timeout_s=front.head_timeout_s,
            # The guard answers a slow body first, in the error shape; this is the backstop.
            body_timeout_s=front.body_timeout_s + 1.0,
            authenticated=front.token is not None,
            exposure_fix="set token= or $RAYMESH_SERVE_TOKEN, and tls=",
        )
        self.port = self._server.port
        logger.info("raymesh.serve: %s with %d replica(s)", self.url, len(self.router.slots))
        return self

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        if self._server is None:
            coro.close()
            raise RuntimeError("the server has not started")
        return self._server.submit(coro)

    def _predict(self, x: Any) -> Reply:
        return Reply(self._submit(self.router.predict(x)))

    def _generate(self, *args: Any, **kwargs: Any) -> Reply:
        return Reply(self._submit(_collect(self.router.stream(*args, **kwargs))))

    def reload(self, checkpoint: str) -> str:
        """Move every replica to `checkpoint` with no failed request (see Router.reload);
        returns the step folder now served. From Python, the process's owner speaks:
        `checkpoint_root` and the admin token guard POST /admin/reload only."""
        future = self._submit(self.router.reload(checkpoint))
        return str(future.result(self._start_timeout_s * max(1, len(self.router.slots))))

    def replica_pids(self) -> list[int]:
        return [s.replica.pid for s in self.router.slots]

    def stats(self) -> dict[str, Any]:
        """Replicas, batch sizes, resends, scaling decisions (read on the server's loop)."""
        return dict(self._submit(_value(self.router.stats)).result(10))

    def stop(self) -> None:
        """Stop serving: waiting requests fail with 503, replicas stop. Idempotent."""
        if self._server is not None:
            self._server.stop(timeout=60)


async def _collect(pieces: Any) -> str:
    return "".join([p async for p in pieces])


async def _value(fn: Callable[[], Any]) -> Any:
    return fn()
