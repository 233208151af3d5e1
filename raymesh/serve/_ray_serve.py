"""Ray Serve: a model served as a Ray Serve deployment (`raymesh serve --backend ray-serve`),
for users who already run Serve; `deploy` returns it as a `RayServeApp`, an `App` as raymesh's
own server is. Ray Serve owns the HTTP proxy, the replicas and the batching
(`@serve.batch`); raymesh gives it the model loader, the request guard (raymesh.serve's
`Guard`) and POST /v1/predict's contract (`front.answer_predict`), so it answers the same
requests as raymesh's own front, the same way: {"x": ...} -> {"y": ...}, 401 without the
bearer token (when one is set), 400 for malformed JSON or a number that is not finite, 408 for
a body not in within its deadline, 413 for a body over the limit, 422 for a wrong input, 500
with the model's error type.

What it enforces is enforced in the deployment's replica, after Serve's proxy has passed the
request on: the proxy's connections, keep-alive and TLS are Serve's own settings, which is why
ServeConfig refuses raymesh's for this backend.

This module and raymesh.data's `_ray_data` are the only ones outside the core's backend that
import Ray (tests/unit/test_layers.py holds every module to that).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from raymesh._common import HTTPError, error_json, free_port
from raymesh.serve.app import App, Endpoint, Reply
from raymesh.serve.batching import BatchConfig
from raymesh.serve.http.front import answer_predict, guard_of
from raymesh.serve.http.guard import Guard
from raymesh.serve.model import LoadedModel, ModelInfo, ModelSpec
from raymesh.serve.routing.dispatcher import ModelError
from raymesh.serve.sections import FrontConfig, ReplicaConfig

__all__ = ["RayServeApp", "deploy"]

APP_NAME = "raymesh"
log = logging.getLogger("raymesh.serve")


class _Response:
    """A DeploymentResponse with a concurrent future's `result(timeout)` / `done()`, for
    `raymesh._common.Pending`."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._done = False

    def result(self, timeout: float | None = None) -> Any:
        value = self._response.result(timeout_s=timeout)
        self._done = True
        return value

    def done(self) -> bool:
        return self._done


class RayServeApp(App):
    """The model as the Ray Serve app "raymesh": `url`, `predict.call_one(x)` and `stop()`.
    Ray Serve does the batching, routing and replicas: reload, /v1/generate, statistics and
    replica processes are Serve's business, and raise NotImplementedError saying so."""

    def __init__(self, handle: Any, host: str, port: int, started_serve: bool) -> None:
        self._handle = handle
        self._host = host
        self.port = port
        self._started_serve = started_serve
        self.predict = Endpoint(self._predict)
        self.generate = Endpoint(self._generate)

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def _predict(self, x: Any) -> Reply:
        return Reply(_Response(self._handle.predict_one.remote(x)))

    def _generate(self, *args: Any, **kwargs: Any) -> Reply:
        raise _not_served("/v1/generate")

    def reload(self, checkpoint: str) -> str:
        raise _not_served("reload")

    def replica_pids(self) -> list[int]:
        raise _not_served("replica_pids()")

    def stats(self) -> dict[str, Any]:
        raise _not_served("stats()")

    def stop(self) -> None:
        try:
            serve.delete(APP_NAME)
        finally:
            if self._started_serve:
                serve.shutdown()


def _not_served(what: str) -> NotImplementedError:
    return NotImplementedError(
        f'{what} is not served with backend="ray-serve": Ray Serve runs the deployment (its '
        'own APIs update and inspect it); deploy with backend="raymesh" for it'
    )


def deploy(
    spec: ModelSpec, *, replicas: ReplicaConfig, batch: BatchConfig, front: FrontConfig
) -> RayServeApp:
    """Deploy `spec`'s model (loaded by each replica as raymesh's replicas load it) as the
    Serve app "raymesh" on route prefix "/v1" (so it sits beside apps on "/"), with
    `replicas.replicas.min` replicas; returns once it answers, or raises TimeoutError after
    `replicas.start_timeout_s`. Starts Serve's HTTP proxy on the front's host and port (port 0:
    a free one) unless Serve is already running, whose proxy is then used as it is.

    Every request passes the front's guard first (raymesh.serve.http.guard.Guard: its token, body
    limit, body deadline and finite numbers), as on raymesh's own front."""
    deployment = _deployment(spec, replicas, batch, guard_of(front))
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running (raymesh starts it before this)")
    port, started_serve = _start_serve(front.host, front.port)
    handle = _run(deployment, replicas.start_timeout_s, started_serve)
    return RayServeApp(handle, front.host, port, started_serve)


def _deployment(spec: ModelSpec, replicas: ReplicaConfig, batch: BatchConfig, guard: Guard) -> Any:
    """The Serve deployment (not yet bound) whose replicas each load `spec`'s model, batch its
    inputs by `batch` and answer requests past `guard`. A class made here, not at the module's
    top, because Serve's decorators take the sizes and batching as they are given."""
    cpus, gpus = replicas.cpus, replicas.gpus

    @serve.deployment(
        num_replicas=replicas.replicas.min,
        ray_actor_options={"num_cpus": cpus, "num_gpus": 1 if gpus else 0},
    )
    class RaymeshModel:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(max(1, int(cpus)))
            cuda = gpus and torch.cuda.is_available()
            self.model = LoadedModel(spec, torch.device("cuda" if cuda else "cpu"))
            self.info = self.model.info

        @serve.batch(
            max_batch_size=batch.max_batch_size, batch_wait_timeout_s=batch.batch_wait_ms / 1000
        )
        async def predict_batch(self, inputs: list[Any]) -> list[tuple[Any, Any]]:
            values, errors = self.model.predict(inputs)
            return [(v, errors.get(i)) for i, v in enumerate(values)]

        async def predict(self, x: Any) -> Any:
            value, error = await self.predict_batch(x)
            if error is not None:
                raise ModelError(*error)  # answered here, as a 500 naming the model's error
            return value

        async def predict_one(self, x: Any) -> Any:
            try:
                return await self.predict(x)
            except ModelError as e:  # to a Python caller, through Ray: a plain RuntimeError
                raise RuntimeError(str(e)) from None

        async def __call__(self, request: Request) -> Any:
            return await _respond(request, guard, self.info, self.predict)

    return RaymeshModel


async def _respond(
    request: Request,
    guard: Guard,
    info: ModelInfo | None,
    predict: Callable[[Any], Awaitable[Any]],
) -> Response:
    """A replica's answer to an HTTP request: POST /v1/predict past `guard`, as raymesh's front
    answers it; any other route a 404."""
    if not request.url.path.rstrip("/").endswith("/predict") or request.method != "POST":
        return _answer(HTTPError(404, "NotFound", "POST /v1/predict is the route served"))
    try:
        guard.authorize(request.scope)
    except HTTPError as e:
        return _answer(e)
    status, data, headers = await answer_predict(
        request.scope, request.receive, guard.read_json, info, predict
    )
    return Response(data, status, headers=headers, media_type="application/json")


def _answer(error: HTTPError) -> Response:
    return Response(
        error_json(error), error.status, headers=error.headers, media_type="application/json"
    )


def _start_serve(host: str, port: int) -> tuple[int, bool]:
    """Serve's proxy port, and whether Serve was started here (so `stop` shuts it down): Serve
    is started on `host` and `port` (0: a free one) unless it runs already, whose proxy serves
    this app too, on its own port."""
    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    if client is None:
        port = port or free_port(host)
        serve.start(http_options={"host": host, "port": port})
        return port, True
    running = int(client.http_config.port)
    if port not in (0, running):
        log.warning("Ray Serve already runs on port %d: port=%d is not used", running, port)
    return running, False


def _run(deployment: Any, timeout: float, started_serve: bool) -> Any:
    """The app's handle once `deployment` runs as the app "raymesh". If it does not start
    within `timeout` (TimeoutError) or fails to, the app is deleted, and Serve shut down when
    it was started for it, before the error is raised."""
    # serve.run waits for the app without a bound: wait for it on a thread, up to `timeout`.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raymesh-ray-serve")
    starting = pool.submit(
        serve.run,
        deployment.bind(),
        name=APP_NAME,
        route_prefix="/v1",
        logging_config={"enable_access_log": False},
    )
    pool.shutdown(wait=False)
    try:
        return starting.result(timeout=timeout)
    except BaseException as e:
        try:
            serve.delete(APP_NAME, _blocking=False)
        finally:
            if started_serve:
                serve.shutdown()
        if isinstance(e, concurrent.futures.TimeoutError):
            raise TimeoutError(
                f"the Ray Serve app did not start within start_timeout_s={timeout}"
            ) from None
        raise
