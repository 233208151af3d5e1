"""The federated server for edge clients: a Starlette app under uvicorn, on a thread of the
controller, bound to loopback unless told otherwise.

    POST /v1/join              -> {"client": cid, "key": "<session key>"}
    GET  /v1/next?client=cid   -> the client's next message (raymesh.federated.protocol, as
                                  JSON), or 204 after `poll_s` with none; Done at the end
    POST /v1/reply?client=cid  {"reply": <the answer>} -> 200, or 409 / 422 with the reason
    GET  /healthz              200 while the server runs

Every request but /healthz carries `Authorization: Bearer <token>`; /next and /reply also
`X-Client-Key`, the key /join gave that client, so one device cannot answer for another.
A refused request (401 no or wrong token, 403 wrong key, 404 unknown client, 409 no message
waits for this answer, 422 a malformed or invalid answer) is logged with its reason; a client
whose answer is refused is dropped from that round and the round goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from raymesh._src.asgi import ServerThread
from raymesh.federated.protocol import Done, Message, decode, encode

__all__ = ["BadUpdate", "EdgeConfig", "EdgeServer"]

logger = logging.getLogger("raymesh.federated")


class BadUpdate(ValueError):
    """An answer that was refused; its message is the reason."""


@dataclass(frozen=True, kw_only=True)
class EdgeConfig:
    """Where edge clients connect. `token` authenticates them (one is generated and logged
    when None); the first round waits up to `join_timeout_s` for `wait_for` of them."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    wait_for: int = 0
    join_timeout_s: float = 300.0
    poll_s: float = 20.0
    max_body_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"edge.port={self.port!r}: give a TCP port, or 0 for any free one")
        if self.token is not None and len(self.token) < 8:
            raise ValueError("edge.token is under 8 characters: give a longer secret")
        if not isinstance(self.wait_for, int) or self.wait_for < 0:
            raise ValueError(f"edge.wait_for={self.wait_for!r}: give a count >= 0")
        for name in ("join_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"edge.{name}={getattr(self, name)!r}: give seconds > 0")


class _Edge:
    def __init__(self, cid: int, key: str) -> None:
        self.cid, self.key = cid, key
        self.message: Message | None = None
        self.answer: concurrent.futures.Future[Any] | None = None
        self.check: Callable[[Any], None] | None = None
        self.told = False  # it has seen Done
        self.seen = time.monotonic()


class Pending:
    """An answer on its way from an edge client (`get` as a raymesh Future's)."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self._future = future

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g} s") from None


def _settle(
    future: concurrent.futures.Future[Any],
    *,
    result: Any = None,
    error: BaseException | None = None,
) -> bool:
    """Resolve `future` unless the driver already gave up on it; False if it had."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True


class EdgeServer:
    """Hands messages to edge clients and collects their answers. Thread-safe: the round
    driver calls `send`, the server's loop answers HTTP."""

    def __init__(self, config: EdgeConfig, *, first_cid: int) -> None:
        self.config = config
        self.token = config.token or secrets.token_urlsafe(16)
        self._next_cid = first_cid
        self._edges: dict[int, _Edge] = {}
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self._done: str | None = None
        self._server = ServerThread(
            self._app(), host=config.host, port=config.port, name="raymesh-federated"
        )
        self.port = self._server.port

    @property
    def url(self) -> str:
        return self._server.url

    def clients(self) -> list[int]:
        """The edge clients that joined and were heard from within three poll periods (a
        device that went away is not sampled again until it polls)."""
        recent = time.monotonic() - 3 * self.config.poll_s
        with self._lock:
            return sorted(c for c, e in self._edges.items() if e.seen > recent)

    def wait_for(self, n: int, timeout: float) -> int:
        """Blocks until `n` edge clients joined or `timeout` passed; returns how many did."""
        deadline = time.monotonic() + timeout
        with self._joined:
            while len(self._edges) < n and time.monotonic() < deadline:
                self._joined.wait(timeout=max(0.0, deadline - time.monotonic()))
            return len(self._edges)

    def send(self, cid: int, msg: Message, check: Callable[[Any], None]) -> Pending:
        """Queue `msg` for edge client `cid`; `check(answer)` raises BadUpdate to refuse one."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            edge = self._edges[cid]
            if edge.answer is not None:
                _settle(edge.answer, error=BadUpdate("superseded by a later message"))
            edge.message, edge.answer, edge.check = msg, future, check
        return Pending(future)

    def finish(self, reason: str, grace_s: float = 3.0) -> None:
        """Tell polling clients the run is over (Done), then stop serving."""
        with self._lock:
            self._done = reason
            idle = [e for e in self._edges.values() if e.answer and not e.answer.done()]
            for e in idle:
                assert e.answer is not None
                _settle(e.answer, error=BadUpdate("the run ended"))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(e.told for e in self._edges.values()):
            time.sleep(0.05)  # let each polling client see Done
        self._server.stop(timeout=30)

    # --- HTTP --------------------------------------------------------------------------

    def _refuse(self, status: int, reason: str, request: Request) -> JSONResponse:
        logger.warning(
            "raymesh.federated: refused %s %s from %s: %s",
            request.method,
            request.url.path,
            request.client.host if request.client else "?",
            reason,
        )
        return JSONResponse({"error": reason}, status_code=status)

    def _authorized(self, request: Request) -> bool:
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode())

    def _edge(self, request: Request) -> _Edge | JSONResponse:
        if not self._authorized(request):
            return self._refuse(401, "missing or wrong bearer token", request)
        try:
            cid = int(request.query_params.get("client", ""))
        except ValueError:
            return self._refuse(422, "give ?client=<the id /v1/join returned>", request)
        with self._lock:
            edge = self._edges.get(cid)
        if edge is None:
            return self._refuse(404, f"unknown client {cid}: join first (POST /v1/join)", request)
        if not hmac.compare_digest(request.headers.get("x-client-key", ""), edge.key):
            return self._refuse(403, f"wrong X-Client-Key for client {cid}", request)
        edge.seen = time.monotonic()
        return edge

    async def _join(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refuse(401, "missing or wrong bearer token", request)
        with self._joined:
            cid, self._next_cid = self._next_cid, self._next_cid + 1
            self._edges[cid] = _Edge(cid, secrets.token_urlsafe(16))
            key = self._edges[cid].key
            self._joined.notify_all()
        logger.info("raymesh.federated: edge client %d joined from %s", cid, request.client)
        return JSONResponse({"client": cid, "key": key})

    async def _next(self, request: Request) -> Response:
        edge = self._edge(request)
        if isinstance(edge, JSONResponse):
            return edge
        deadline = time.monotonic() + self.config.poll_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._done is not None:
                    edge.told = True
                    return JSONResponse(encode(Done(self._done)))
                answer = edge.answer
                if edge.message is not None and answer is not None and not answer.done():
                    return JSONResponse(encode(edge.message))
            await asyncio.sleep(0.005)
            edge.seen = time.monotonic()
        return Response(status_code=204)

    async def _reply(self, request: Request) -> Response:
        edge = self._edge(request)
        if isinstance(edge, JSONResponse):
            return edge
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            return self._refuse(413, f"body over {self.config.max_body_bytes} bytes", request)
        with self._lock:
            answer, check = edge.answer, edge.check
            edge.message = None
        if answer is None or answer.done() or check is None:
            return self._refuse(409, f"client {edge.cid}: no message waits for an answer", request)
        try:
            reply = decode(json.loads(body)["reply"])
            check(reply)
        except (BadUpdate, ValueError, KeyError, TypeError) as e:
            reason = f"client {edge.cid}: {type(e).__name__}: {e}"
            _settle(answer, error=BadUpdate(reason))
            return self._refuse(422, reason, request)
        if not _settle(answer, result=reply):  # the round moved on meanwhile
            return self._refuse(409, f"client {edge.cid}: the answer came too late", request)
        return JSONResponse({"ok": True})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/join", self._join, methods=["POST"]),
                Route("/v1/next", self._next, methods=["GET"]),
                Route("/v1/reply", self._reply, methods=["POST"]),
                Route("/healthz", self._health, methods=["GET"]),
            ]
        )
