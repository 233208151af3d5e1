"""`deploy`: serve a model from a mesh of replicas, over HTTP and from Python; `App` is the
running server.

The HTTP front (uvicorn, Starlette) and the router run on one event loop, on a thread of the
calling process (the controller): a request reaches a replica in one actor call, with no proxy
between. `App` methods may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import Any

from raymesh._common import Pending, ServerThread, url_of
from raymesh.actor import host_mesh
from raymesh.serve.config import ServeConfig
from raymesh.serve.front import guard_of, make_app
from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelSpec
from raymesh.serve.replica import ReplicaProc, spawn_replica
from raymesh.serve.router import Router
from raymesh.serve.sections import FrontConfig

__all__ = ["App", "Reply", "deploy"]

logger = logging.getLogger("raymesh.serve")


def deploy(
    model: Any = None,
    *,
    build: Any = None,
    checkpoint: str | None = None,
    generate: Any = None,
    input_shape: tuple[int, ...] | None = None,
    input_dtype: str | None = None,
    seed: int = 0,
    config: ServeConfig | None = None,
    **fields: Any,
) -> App:
    """Serve `model` and return once `min` replicas are ready (or raise what stopped them).

    model: an nn.Module or a `predict(batch) -> outputs` function; or give `build=` (a
        raymesh.train build function, "pkg.module:build" or the function) to build the model
        as training did. checkpoint: a raymesh.train checkpoint folder (its newest committed
        step) or one step's folder, loaded into the module. generate: a function serving
        POST /v1/generate (see `raymesh.serve.model`). input_shape / input_dtype: one
        request's input, checked by the front (422 when wrong; from the task's first sample
        when a build function is given).
    config, or its fields as keywords (replicas=(1, 4), max_batch_size=32, batch_wait_ms=5,
        port=0, host, token, admin_token, checkpoint_root, tls, ...): see `ServeConfig`.
        backend="ray-serve" deploys the same model as a Ray Serve deployment instead.
    Raises ValueError for a bad argument (naming it) before starting anything.
    """
    if config is not None and fields:
        raise ValueError(f"give config= or its fields {sorted(fields)} as keywords, not both")
    config = config or ServeConfig(**fields)
    # The tokens are settled here, once (an admin token from the environment that cannot be
    # used is a ValueError now, before anything starts).
    front = config.front
    spec = ModelSpec(
        model=model,
        build=build,
        checkpoint=checkpoint,
        generate=generate,
        input_shape=input_shape,
        input_dtype=input_dtype,
        seed=seed,
    ).resolved()
    # Start (or join) Ray here, on the caller's thread: Ray ties the life of the processes it
    # starts to the thread that started them, and the server's thread ends with `stop()`.
    host_mesh()
    if config.backend == "ray-serve":
        from raymesh.serve import _ray_serve  # imports Ray Serve: only for this backend
        from raymesh.serve.model import LoadedModel

        handle = _ray_serve.deploy(
            functools.partial(LoadedModel, spec),
            guard_of(front),  # the same token check and body limits as raymesh's front
            host=front.host,
            port=front.port,
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000.0,
            replicas=config.min_replicas,
            cpus=config.cpus_per_replica,
            gpus=config.gpus,
            timeout=config.start_timeout_s,
        )
        return RayServeApp(handle, config)  # type: ignore[return-value]
    app = App(spec, config, front)
    app._start()
    return app


# The pending answer to a Python call: `get(timeout)` blocks for it (TimeoutError after
# `timeout` seconds; the call goes on), `done()` never blocks.
Reply = Pending


class _Endpoint:
    def __init__(self, app: App, name: str) -> None:
        self._app, self._name = app, name

    def call_one(self, *args: Any, **kwargs: Any) -> Reply:
        """Send through the same queue and batching as HTTP requests."""
        return self._app._call(self._name, args, kwargs)


class App:
    """A running server: `url`, `predict.call_one(x)`, `generate.call_one(prompt,
    max_tokens, temperature, seed)` (the whole text),
    `reload(checkpoint)`, `stats()`, `stop()`; a context manager that stops it."""

    def __init__(
        self,
        spec: ModelSpec,
        config: ServeConfig,
        front: FrontConfig,
        *,
        start_replica: Callable[..., ReplicaProc] = spawn_replica,
    ) -> None:
        self.spec = spec
        self.config = config
        self.front = front
        self.metrics = Metrics(config.max_batch_size)
        self.router = Router(
            spec, config.router, config.batch, self.metrics, start_replica=start_replica
        )
        self.predict = _Endpoint(self, "predict")
        self.generate = _Endpoint(self, "generate")
        self._server: ServerThread | None = None
        self.port = config.port

    @property
    def url(self) -> str:
        return url_of(self.config.host, self.port, tls=self.config.tls is not None)

    def _start(self) -> None:
        # The HTTP front and the router share the server's loop: the router starts there
        # before the server binds and stops there after it closes.
        self._server = ServerThread(
            make_app(self.router, self.front, self.metrics),
            host=self.config.host,
            port=self.config.port,
            name="raymesh-serve",
            start_timeout_s=self.config.start_timeout_s + 30,
            graceful_s=5,  # open streams get this long, then the loop ends
            before=self.router.start,
            after=self.router.stop,
            uvloop=True,
            tls=self.config.tls,
            max_connections=self.config.max_connections,
            keep_alive_s=self.config.keep_alive_s,
        )
        self.port = self._server.port
        logger.info("raymesh.serve: %s with %d replica(s)", self.url, len(self.router.slots))

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        if self._server is None:
            coro.close()
            raise RuntimeError("the server has not started")
        return self._server.submit(coro)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        if name == "predict":
            return Reply(self._submit(self.router.predict(*args, **kwargs)))
        return Reply(self._submit(_collect(self.router.stream(*args, **kwargs))))

    def reload(self, checkpoint: str) -> str:
        """Move every replica to `checkpoint` with no failed request (see Router.reload);
        returns the step folder now served. From Python, the process's owner speaks:
        `checkpoint_root` and the admin token guard POST /admin/reload only."""
        future = self._submit(self.router.reload(checkpoint))
        return str(future.result(self.config.start_timeout_s * max(1, len(self.router.slots))))

    def replica_pids(self) -> list[int]:
        return [s.replica.pid for s in self.router.slots]

    def stats(self) -> dict[str, Any]:
        """Replicas, batch sizes, resends, scaling decisions (read on the server's loop)."""
        return dict(self._submit(_value(self.router.stats)).result(10))

    def stop(self) -> None:
        """Stop serving: waiting requests fail with 503, replicas stop. Idempotent."""
        if self._server is not None:
            self._server.stop(timeout=60)

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<raymesh.serve.App {self.url}>"


async def _collect(pieces: Any) -> str:
    return "".join([p async for p in pieces])


async def _value(fn: Callable[[], Any]) -> Any:
    return fn()


class RayServeApp:
    """The same model as a Ray Serve deployment (backend="ray-serve"): `url`,
    `predict.call_one(x)` and `stop()`; Ray Serve does the batching, routing and replicas."""

    def __init__(self, handle: Any, config: ServeConfig) -> None:
        self._handle = handle
        self.config = config
        self.predict = self
        self.port = handle.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def call_one(self, x: Any) -> Reply:
        return Reply(self._handle.call(x))

    def stop(self) -> None:
        self._handle.stop()

    def __enter__(self) -> RayServeApp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
