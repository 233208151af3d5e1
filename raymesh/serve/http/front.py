"""The HTTP front: a Starlette app (run by uvicorn) over a `Router`.

    POST /v1/predict    {"x": <one input>}                 -> {"y": <its output>}
    POST /v1/generate   {"prompt": "def ", "max_tokens": 64, "temperature": 0.0, "seed": 0,
                         "stream": false}                  -> {"text": ..., "tokens": n}
                        with "stream": true (or Accept: text/event-stream): server-sent events,
                        `data: {"text": piece}` per token, then `data: [DONE]`
    GET  /healthz       200 while the server runs
    GET  /readyz        200 once a replica is ready, else 503
    GET  /metrics       Prometheus text format
    POST /admin/reload  {"checkpoint": "runs/job"}         -> {"checkpoint": <step folder>}
                        with the admin token only (none set: 403, the route is off), and only
                        from under `checkpoint_root` (403 naming it otherwise)

Errors are JSON, `{"error": {"type": ..., "message": ..., "field": ...}}`: 400 malformed JSON
(NaN, Infinity and numbers that overflow to it included, nesting past 64 levels), 400
`OutOfRange` a number the model's dtype cannot hold (3.5e38 for float32; temperature and seed
likewise; named), 400 `PromptTooLong` a prompt over the model's context, 401 missing or wrong
bearer token
(when one is set; /healthz and /readyz need none), 403 reload off or outside the root, 408 body
not in within `body_timeout_s`, 413 body over `max_body_bytes`, 422 a field of the wrong kind
or shape (named), 500 the model raised (its exception's type; the replica keeps serving), 503
queue full or no replica (with Retry-After), 504 not answered within `request_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from raymesh._common import BearerAuth, RefusalLog, is_int
from raymesh.serve.batching import Overloaded
from raymesh.serve.http.guard import Guard, HTTPError
from raymesh.serve.http.inputs import LARGEST, check_input, check_range
from raymesh.serve.metrics import Metrics
from raymesh.serve.model import ModelInfo, PromptTooLong
from raymesh.serve.routing.dispatcher import ModelError, Unavailable
from raymesh.serve.routing.router import Router
from raymesh.serve.sections import FrontConfig

__all__ = ["GenerateArgs", "answer_predict", "generate_args", "guard_of", "make_app", "reload_args"]

logger = logging.getLogger("raymesh.serve")


def _field_error(message: str) -> HTTPError:
    field = message.split(":", 1)[0]
    return HTTPError(422, "ValidationError", message, field=field)


def _out_of_range(message: str) -> HTTPError:
    return HTTPError(400, "OutOfRange", message, field=message.split(":", 1)[0])


def _as_http(e: Exception) -> HTTPError:
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, ModelError) and e.type_name == PromptTooLong.__name__:
        return HTTPError(400, e.type_name, e.message, field="prompt")
    if isinstance(e, Overloaded):
        return HTTPError(503, "Overloaded", str(e), headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, Unavailable):
        return HTTPError(503, "Unavailable", str(e), headers={"Retry-After": "1"})
    if isinstance(e, TimeoutError):
        return HTTPError(504, "Timeout", str(e))
    if isinstance(e, ModelError):
        return HTTPError(500, e.type_name, e.message)
    logger.exception("raymesh.serve: a request failed in the server itself")
    return HTTPError(500, type(e).__name__, str(e)[:500])


async def answer_predict(
    scope: Scope,
    receive: Receive,
    read_json: Callable[[Scope, Receive], Awaitable[dict[str, Any]]],
    info: ModelInfo | None,
    predict: Callable[[Any], Awaitable[Any]],
) -> tuple[int, bytes, dict[str, str] | None]:
    """POST /v1/predict's contract, for raymesh's front and the Ray Serve deployment alike:
    the body read by `read_json`, {"x": <one input>} checked against `info` (422 naming the
    field), `predict(x)` awaited; returns (status, JSON body, extra headers), {"y": ...} or
    the error shape (a ModelError is a 500 with the model's exception type)."""
    try:
        body = await read_json(scope, receive)
        if "x" not in body:
            raise _field_error('x: missing; send {"x": <one input>}')
        if info is not None:
            why = check_input(body["x"], info.input_shape, info.input_dtype == "int64")
            if why is not None:
                raise _field_error(why)
            why = check_range(body["x"], info.input_dtype)
            if why is not None:
                raise _out_of_range(why)
        return 200, _json({"y": await predict(body["x"])}), None
    except Exception as e:
        error = _as_http(e)
        return error.status, _json(error.payload()), error.headers


def guard_of(front: FrontConfig) -> Guard:
    """The token check and body reader of /v1 and /metrics (the Ray Serve backend's too)."""
    return Guard(
        token=front.token,
        max_body_bytes=front.max_body_bytes,
        body_timeout_s=front.body_timeout_s,
    )


# The routes whose requests are counted in the metrics, by path (refusals included).
_ROUTES = {"/v1/predict": "predict", "/v1/generate": "generate", "/admin/reload": "reload"}


@dataclass(frozen=True)
class GenerateArgs:
    """A /v1/generate request's fields, checked."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    stream: bool


def generate_args(body: dict[str, Any], max_tokens: int) -> GenerateArgs:
    """/v1/generate's body checked (HTTPError naming the field: 422 a wrong kind, 400 a number
    out of range), `max_tokens` the most a request may ask for."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _field_error(f'prompt: give a string, e.g. "def " (got {prompt!r:.40})')
    n = body.get("max_tokens", 64)
    if not is_int(n) or not 1 <= n <= max_tokens:
        raise _field_error(f"max_tokens: give an integer 1..{max_tokens} (got {n!r:.40})")
    t = body.get("temperature", 0.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
        raise _field_error(f"temperature: give a number >= 0, 0 for greedy (got {t!r:.40})")
    # The model divides float32 logits by it: past float32's largest it is infinity.
    why = check_range(t, "float32", "temperature")
    if why is not None:
        raise _out_of_range(why)
    seed = body.get("seed", 0)
    if not is_int(seed):
        raise _field_error(f"seed: give an integer (got {seed!r:.40})")
    if not -LARGEST["int64"] - 1 <= seed <= LARGEST["int64"]:  # torch's seeds are 64-bit
        raise _out_of_range(f"seed: give an integer of 64 bits (got {len(str(seed))} digits)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _field_error(f"stream: give true or false (got {stream!r:.40})")
    return GenerateArgs(prompt, n, float(t), seed, stream)


def reload_args(body: dict[str, Any]) -> str:
    """/admin/reload's checkpoint folder, from its body (HTTPError 422 naming the field)."""
    checkpoint = body.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise _field_error('checkpoint: give a checkpoint folder, e.g. "runs/job"')
    return checkpoint


def _reload_off() -> HTTPError:
    return HTTPError(
        403,
        "Forbidden",
        "POST /admin/reload is off: start the server with an admin token (admin_token, "
        "--admin-token or $RAYMESH_SERVE_ADMIN_TOKEN) and checkpoint_root to turn it on",
    )


class _Routes:
    """The handlers of make_app's routes over one router, counting what they answer."""

    def __init__(self, router: Router, front: FrontConfig, metrics: Metrics) -> None:
        self.router, self.front, self.metrics = router, front, metrics
        self.root = None if front.checkpoint_root is None else Path(front.checkpoint_root)
        self.read_json = guard_of(front).read_json  # the tokens are checked by BearerAuth
        self.log_refusal = RefusalLog(logger, "raymesh.serve")
        self.counters: dict[tuple[str, int], Any] = {}
        self.latencies = {route: metrics.latency.labels(route) for route in _ROUTES.values()}

    def count(self, route: str, code: int) -> None:
        child = self.counters.get((route, code))
        if child is None:
            child = self.counters[(route, code)] = self.metrics.requests.labels(route, str(code))
        child.inc()

    def failed(self, route: str, e: Exception) -> Response:
        error = _as_http(e)
        self.count(route, error.status)
        return JSONResponse({"error": error.body}, error.status, headers=error.headers)

    def refused(self, scope: Scope, error: HTTPError) -> None:
        """A request BearerAuth turned away: logged, and counted under its route."""
        self.log_refusal(scope, error)
        route = _ROUTES.get(scope["path"])
        if route is not None:
            self.count(route, error.status)

    async def predict(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The hot route, as a plain ASGI handler: Starlette's Request, Response and middleware
        # cost more CPU per request here than the request's own work.
        started = time.perf_counter()
        router = self.router
        status, data, extra = await answer_predict(
            scope, receive, self.read_json, router.info, router.predict
        )
        self.count("predict", status)
        if status == 200:
            self.latencies["predict"].observe(time.perf_counter() - started)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        if extra:
            headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def generate(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await self.read_json(request.scope, request.receive)
            args = generate_args(body, self.front.max_tokens)
            info = self.router.info
            if info is not None and not info.generates:
                raise HTTPError(
                    404,
                    "NotFound",
                    "this model serves POST /v1/predict only (deploy it with generate=... "
                    "to serve /v1/generate)",
                )
            stream = args.stream or "text/event-stream" in request.headers.get("accept", "")
            pieces = self.router.stream(args.prompt, args.max_tokens, args.temperature, args.seed)
            if stream:
                return StreamingResponse(
                    _events(pieces, lambda code: self.count("generate", code)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            text = [piece async for piece in pieces]
        except Exception as e:
            return self.failed("generate", e)
        self.count("generate", 200)
        self.latencies["generate"].observe(time.perf_counter() - started)
        return JSONResponse({"text": "".join(text), "tokens": len(text)})

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        ready = len(self.router.slots)
        return JSONResponse({"ready": ready > 0, "replicas": ready}, 200 if ready else 503)

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def reload(self, request: Request) -> Response:
        try:
            if self.front.admin_token is None:
                raise _reload_off()
            checkpoint = reload_args(await self.read_json(request.scope, request.receive))
            try:
                loaded = await self.router.reload(checkpoint, root=self.root)
            except PermissionError as e:  # outside checkpoint_root
                raise HTTPError(403, "Forbidden", str(e), field="checkpoint") from None
            except (ValueError, RuntimeError) as e:
                raise HTTPError(422, "ReloadFailed", str(e), field="checkpoint") from None
        except Exception as e:
            return self.failed("reload", e)
        self.count("reload", 200)
        return JSONResponse({"checkpoint": loaded, "replicas": len(self.router.slots)})


def make_app(router: Router, front: FrontConfig, metrics: Metrics) -> ASGIApp:
    """The routes above over `router`, with `front`'s tokens and limits, counted in
    `metrics`."""
    routes = _Routes(router, front, metrics)
    app = Starlette(
        routes=[
            Route("/v1/predict", _ASGI(routes.predict), methods=["POST"]),
            Route("/v1/generate", routes.generate, methods=["POST"]),
            Route("/healthz", routes.healthz, methods=["GET"]),
            Route("/readyz", routes.readyz, methods=["GET"]),
            Route("/metrics", routes.metrics_page, methods=["GET"]),
            Route("/admin/reload", routes.reload, methods=["POST"]),
        ]
    )

    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/predict" and scope["method"] == "POST":
            await routes.predict(scope, receive, send)  # straight to it, past Starlette's routing
        else:
            await app(scope, receive, send)

    # /healthz and /readyz need no token; the admin token opens /admin/reload only.
    guarded = BearerAuth(routed, front.token, paths=("/v1/", "/metrics"), refused=routes.refused)
    return BearerAuth(
        guarded,
        front.admin_token,
        paths=("/admin/",),
        what="the admin token",
        refused=routes.refused,
        field="admin_token",
    )


class _ASGI:
    """A plain ASGI handler as a Starlette route's endpoint (Starlette calls an endpoint that
    is not a function as an ASGI app)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.fn(scope, receive, send)


def _json(payload: Any) -> bytes:
    """As Starlette's JSONResponse renders it; a NaN or infinity in it is a ValueError."""
    return json.dumps(
        payload, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


async def _events(pieces: AsyncIterator[str], count: Any) -> AsyncIterator[bytes]:
    """Server-sent events: one per token, then [DONE]; an error mid-stream is an `error`
    event (the status line has already gone out as 200)."""
    try:
        async for piece in pieces:
            yield f"data: {json.dumps({'text': piece})}\n\n".encode()
    except Exception as e:
        error = _as_http(e)
        count(error.status)
        yield f"event: error\ndata: {json.dumps({'error': error.body})}\n\n".encode()
        return
    count(200)
    yield b"data: [DONE]\n\n"
