"""Ray Serve: a model served as a Ray Serve deployment (`raymesh serve --backend ray-serve`),
for users who already run Serve. Ray Serve owns the HTTP proxy, the replicas and the batching
(`@serve.batch`); raymesh gives it the model loader, the input check and the request guard
(raymesh.serve's `Guard`), so it answers the same requests as raymesh's own front: POST
/v1/predict {"x": ...} -> {"y": ...}, 401 without the bearer token (when one is set), 400 for
malformed JSON or a number that is not finite, 408 for a body not in within its deadline, 413
for a body over the limit, 422 for a wrong input, 500 with the model's error type.

What it enforces is enforced in the deployment's replica, after Serve's proxy has passed the
request on: the proxy's connections, keep-alive and TLS are Serve's own settings, which is why
ServeConfig refuses raymesh's for this backend."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

__all__ = ["RayServeHandle", "deploy"]

APP_NAME = "raymesh"
log = logging.getLogger("raymesh.serve")


class _Pending:
    """A DeploymentResponse as `result(timeout)` / `done()`."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._done = False

    def result(self, timeout: float | None = None) -> Any:
        value = self._response.result(timeout_s=timeout)
        self._done = True
        return value

    def done(self) -> bool:
        return self._done


class RayServeHandle:
    def __init__(self, handle: Any, port: int, started_serve: bool) -> None:
        self._handle = handle
        self.port = port
        self._started_serve = started_serve

    def call(self, x: Any) -> _Pending:
        return _Pending(self._handle.predict_one.remote(x))

    def stop(self) -> None:
        try:
            serve.delete(APP_NAME)
        finally:
            if self._started_serve:
                serve.shutdown()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def deploy(
    load: Callable[[Any], Any],
    check: Callable[[Any, Any, bool], str | None],
    guard: Any,
    *,
    host: str,
    port: int,
    max_batch_size: int,
    batch_wait_s: float,
    replicas: int,
    cpus: float,
    gpus: bool,
    timeout: float,
) -> RayServeHandle:
    """Deploy `load(device)` (a raymesh.serve LoadedModel) as the Serve app "raymesh" on
    route prefix "/v1" (so it sits beside apps on "/"); returns once it answers. Starts Serve's
    HTTP proxy on host:port (port 0: a free one) unless Serve is already running, whose proxy
    is then used as it is.

    guard: every request passes `guard.authorize(scope)` and `await guard.read_json(scope,
    receive)` first (raymesh.serve.guard.Guard), whose refusals carry `status`, `body` and
    `headers`."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @serve.deployment(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": 1 if gpus else 0},
    )
    class RaymeshModel:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(max(1, int(cpus)))
            cuda = gpus and torch.cuda.is_available()
            self.model = load(torch.device("cuda" if cuda else "cpu"))
            self.info = self.model.info

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_s)
        async def predict_batch(self, inputs: list[Any]) -> list[tuple[Any, Any]]:
            values, errors = self.model.predict(inputs)
            return [(v, errors.get(i)) for i, v in enumerate(values)]

        async def predict_one(self, x: Any) -> Any:
            value, error = await self.predict_batch(x)
            if error is not None:
                raise RuntimeError(f"{error[0]}: {error[1]}")
            return value

        async def __call__(self, request: Request) -> Any:
            if not request.url.path.rstrip("/").endswith("/predict") or request.method != "POST":
                return _error(404, "NotFound", "POST /v1/predict is the route served")
            try:
                guard.authorize(request.scope)
                body = await guard.read_json(request.scope, request.receive)
            except Exception as e:
                refusal: Any = e
                if not isinstance(getattr(refusal, "status", None), int):
                    raise  # not a refusal: Serve answers 500
                return JSONResponse(
                    {"error": refusal.body}, refusal.status, headers=refusal.headers
                )
            if "x" not in body:
                return _error(422, "ValidationError", 'x: missing; send {"x": <one input>}', "x")
            why = check(body["x"], self.info.input_shape, self.info.input_dtype == "int64")
            if why is not None:
                return _error(422, "ValidationError", why, why.split(":", 1)[0])
            value, error = await self.predict_batch(body["x"])
            if error is not None:
                return _error(500, error[0], error[1])
            return JSONResponse({"y": value})

    def _error(status: int, kind: str, message: str, field: str | None = None) -> Any:
        body: dict[str, Any] = {"type": kind, "message": message}
        if field is not None:
            body["field"] = field
        return JSONResponse({"error": body}, status)

    if not ray.is_initialized():
        raise RuntimeError("Ray is not running (raymesh starts it before this)")
    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    started_serve = client is None
    if started_serve:
        port = port or _free_port(host)
        serve.start(http_options={"host": host, "port": port})
    else:  # Serve already runs: its proxy serves this app too, on its own port
        running = int(client.http_config.port)  # type: ignore[union-attr]
        if port not in (0, running):
            log.warning("Ray Serve already runs on port %d: port=%d is not used", running, port)
        port = running
    # serve.run waits for the app without a bound: wait for it on a thread, up to `timeout`.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raymesh-ray-serve")
    starting = pool.submit(
        serve.run,
        RaymeshModel.bind(),  # type: ignore[attr-defined]
        name=APP_NAME,
        route_prefix="/v1",
        logging_config={"enable_access_log": False},
    )
    pool.shutdown(wait=False)
    try:
        handle = starting.result(timeout=timeout)
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
    return RayServeHandle(handle, port, started_serve)
