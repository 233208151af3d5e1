"""The federated server for edge clients: a Starlette app under uvicorn, on a thread of the
controller, bound to loopback unless told otherwise, over HTTPS when given a certificate.

    POST /v1/join  {"device": D}  -> {"client": cid, "key": "<session key>"}
    GET  /v1/next?client=cid      -> the client's next message (as JSON: raymesh.federated.
                                     protocol.messages), or 204 after `poll_s` with none; Done
                                     at the end
    POST /v1/reply?client=cid  {"reply": <the answer>} -> 200, or 4xx with the reason
    GET  /healthz                 200 while the server runs

Every request but /healthz carries `Authorization: Bearer <token>`; /next and /reply also
`X-Client-Key`, the key /join gave that client, so one device cannot answer for another. A
device enrols once: a second /join for a device id heard from within three poll periods is
refused (409), and at most `max_clients` devices enrol (403 beyond). A long poll waits on an
event the round driver sets, so a message goes out as soon as it is queued.

Refusals, each logged with its reason (cut to 200 characters): 401 no token, a wrong one, or a
non-ASCII token or key; 403 a wrong key, or the server full; 404 an unknown client; 409 no
message waits for this answer (too late, or already answered: a replay), or a device already
enrolled; 429 another answer from this client is still being received or checked (refused at
once, its body unread: one answer in flight per client); 413 a body over the byte limit (counted
while it streams in, before any decoding) or with more JSON values than an answer holds
(raymesh.federated.edge.bodies: both follow the model's size, unless `EdgeConfig.max_body_bytes`
sets the bytes); 400 a body that is not JSON, holds NaN or Infinity, or nests deeper than
protocol.MAX_DEPTH; 422 an answer that does not decode or fails its checks
(raymesh.federated.protocol.checks); 408 a body not in within `EdgeConfig.body_deadline` (by
default the byte limit at 256 KiB/s, at least 60 s). A client whose answer is refused (413, 400,
422) is dropped from that round, and the round goes on; one that went away before its body ended
(400) or was too slow (408) sent no answer, and may send it again. Every refusal is answered in
raymesh's error shape, `{"error": {"type", "message"}}`, the token check by the shared
`BearerAuth` (raymesh._common.auth).

The server's event loop only moves bytes: an answer is parsed, decoded and checked in one of
`PARSERS` worker threads, and each message is encoded to JSON once, when it is queued (a
round's weights once for all its edge clients), whatever the number of polls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from raymesh._common import BearerAuth, HTTPError, Pending, RefusalLog, ServerThread
from raymesh.federated.config import EdgeConfig
from raymesh.federated.edge.bodies import Limits, load
from raymesh.federated.protocol.checks import BadUpdate
from raymesh.federated.protocol.messages import Done, Fit, Message, decode, encode

__all__ = ["BadUpdate", "EdgeConfig", "EdgeServer"]

logger = logging.getLogger("raymesh.federated")

_DEVICE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_JOIN = Limits(max_bytes=4096, max_items=64)  # a join's body is one short device id
PARSERS = 2  # worker threads parsing answers: a few cores for the driver, the loop, the rest


class _Edge:
    def __init__(self, cid: int, device: str) -> None:
        self.cid, self.device = cid, device
        self.key = secrets.token_urlsafe(16)
        self.message: Message | None = None
        self.body = b""  # `message` as JSON, encoded once when it was queued
        self.replying = False  # an answer from it is being received or checked
        self.answer: concurrent.futures.Future[Any] | None = None
        self.check: Callable[[Any], None] | None = None
        self.told = False  # it has seen Done
        self.seen = time.monotonic()
        self.wake = asyncio.Event()  # set on the server's loop when a message is queued


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


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class EdgeServer:
    """Hands messages to edge clients and collects their answers. Thread-safe: the round
    driver calls `send`, the server's loop answers HTTP. `size`: the model's float count and
    `peers`: the most secure-aggregation neighbours a client has, which bound an honest
    answer's body (`limits`, raymesh.federated.edge.bodies)."""

    def __init__(self, config: EdgeConfig, *, first_cid: int, size: int, peers: int = 0) -> None:
        self.config = config
        self.limits = Limits.for_model(size, peers=peers, max_bytes=config.max_body_bytes)
        # An honest answer as large as the limit must fit its deadline on a slow uplink.
        self.body_timeout_s = config.body_deadline(self.limits.max_bytes)
        self._parsers = concurrent.futures.ThreadPoolExecutor(
            PARSERS, thread_name_prefix="raymesh-federated-parse"
        )
        self._weights: tuple[np.ndarray, Any] | None = None  # the round's, encoded
        self.token = config.token or secrets.token_urlsafe(24)
        self._next_cid = first_cid
        self._edges: dict[int, _Edge] = {}
        self._devices: dict[str, int] = {}
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self._done: str | None = None
        self._done_body = b""
        # Refusals are logged rate-limited, the path as sent with control characters escaped.
        self._log_refusal = RefusalLog(logger, "raymesh.federated")
        self._server = ServerThread(
            self._app(),
            host=config.host,
            port=config.port,
            name="raymesh-federated",
            tls=config.tls,
            body_timeout_s=self.body_timeout_s,
            authenticated=True,  # BearerAuth checks every /v1 request's token, by any Host
            exposure_fix="keys and updates too: give edge.tls (--tls-cert/--tls-key)",
        )
        self.port = self._server.port

    @property
    def url(self) -> str:
        return self._server.url

    def _recent(self, edge: _Edge) -> bool:
        return edge.seen > time.monotonic() - 3 * self.config.poll_s

    def clients(self) -> list[int]:
        """The edge clients that joined and were heard from within three poll periods (a
        device that went away is not sampled again until it polls)."""
        with self._lock:
            return sorted(c for c, e in self._edges.items() if self._recent(e))

    def wait_for(self, n: int, timeout: float) -> int:
        """Blocks until `n` edge clients joined or `timeout` passed; returns how many did."""
        deadline = time.monotonic() + timeout
        with self._joined:
            while len(self._edges) < n and time.monotonic() < deadline:
                self._joined.wait(timeout=max(0.0, deadline - time.monotonic()))
            return len(self._edges)

    def _wake(self, edge: _Edge) -> None:
        loop = self._server.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(edge.wake.set)

    def _encode(self, msg: Message) -> bytes:
        """`msg` as JSON; a Fit's weights are encoded once for all the round's edge clients
        (each gets its own Fit, with its own clients and shares, around the same array)."""
        if not isinstance(msg, Fit):
            return _json(encode(msg))
        weights = msg.weights
        if self._weights is None or self._weights[0] is not weights:
            self._weights = (weights, encode(weights))  # holds the array, so `is` stays sound
        data = encode(dataclasses.replace(msg, weights=np.zeros(0, np.float32)))
        data["weights"] = self._weights[1]
        return _json(data)

    def send(self, cid: int, msg: Message, check: Callable[[Any], None]) -> Pending:
        """Queue `msg` for edge client `cid`; `check(answer)` raises BadUpdate to refuse one.
        Encodes `msg` here, on the caller's thread: every poll then serves those bytes."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        body = self._encode(msg)
        with self._lock:
            edge = self._edges[cid]
            if edge.answer is not None:
                _settle(edge.answer, error=BadUpdate("superseded by a later message"))
            edge.message, edge.body, edge.answer, edge.check = msg, body, future, check
        self._wake(edge)
        # A late answer is refused (409): the driver moved on when its wait ended.
        return Pending(future, cancel_on_timeout=True)

    def finish(self, reason: str, grace_s: float = 3.0) -> None:
        """Tell polling clients the run is over (Done), then stop serving."""
        with self._lock:
            self._done, self._done_body = reason, _json(encode(Done(reason)))
            edges = list(self._edges.values())
            for e in edges:
                if e.answer is not None and not e.answer.done():
                    _settle(e.answer, error=BadUpdate("the run ended"))
        for e in edges:
            self._wake(e)
        deadline = time.monotonic() + grace_s
        live = [e for e in edges if self._recent(e)]
        while time.monotonic() < deadline and not all(e.told for e in live):
            time.sleep(0.05)  # let each polling client see Done
        self._server.stop(timeout=30)
        self._parsers.shutdown(wait=False, cancel_futures=True)

    # --- HTTP --------------------------------------------------------------------------

    def _refuse(self, error: HTTPError, request: Request) -> JSONResponse:
        self._log_refusal(request.scope, error)
        error.body["message"] = error.body["message"][:1000]
        return JSONResponse(error.payload(), status_code=error.status, headers=error.headers)

    def _edge(self, request: Request) -> _Edge:
        text = request.query_params.get("client", "")
        if not (text.isascii() and text.isdigit() and len(text) < 12):
            raise HTTPError(422, None, "give ?client=<the id /v1/join returned>")
        cid = int(text)
        with self._lock:
            edge = self._edges.get(cid)
        if edge is None:
            raise HTTPError(404, None, f"unknown client {cid}: join first (POST /v1/join)")
        key = request.headers.get("x-client-key", "")
        if not key.isascii():
            raise HTTPError(401, None, "X-Client-Key is not ASCII")
        if not hmac.compare_digest(key.encode(), edge.key.encode()):
            raise HTTPError(403, None, f"wrong X-Client-Key for client {cid}")
        edge.seen = time.monotonic()
        return edge

    async def _body(self, request: Request, limit: int) -> bytes:
        """The body's bytes, counted while they stream in and refused (413) past `limit`
        before any decoding."""
        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and (len(length) > 15 or int(length) > limit):
            raise HTTPError(413, None, f"the body has {length[:20]} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, None, f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _join(self, request: Request) -> Response:
        try:
            body = load(await self._body(request, _JOIN.max_bytes), _JOIN)  # small: no thread
            device = body.get("device") if isinstance(body, dict) else None
            if not isinstance(device, str) or not _DEVICE.fullmatch(device):
                raise HTTPError(
                    422,
                    None,
                    'give {"device": "<this device\'s id>"}: 1 to 128 of A-Z a-z 0-9 . _ : @ -',
                )
            edge = self._enrol(device)
        except HTTPError as e:
            return self._refuse(e, request)
        host = request.client.host if request.client else "?"
        logger.info("raymesh.federated: edge client %d (%s) joined from %s", edge.cid, device, host)
        return JSONResponse({"client": edge.cid, "key": edge.key})

    def _enrol(self, device: str) -> _Edge:
        with self._joined:
            if self._done is not None:
                raise HTTPError(409, None, "the run is over")
            cid = self._devices.get(device)
            if cid is not None:
                old = self._edges[cid]
                if self._recent(old):
                    raise HTTPError(
                        409,
                        None,
                        f"device {device!r} is enrolled already (client {cid}); it may join "
                        f"again once silent for {3 * self.config.poll_s:g} s",
                    )
                if old.answer is not None:  # its key is replaced: nothing it sent counts now
                    _settle(old.answer, error=BadUpdate("the device enrolled again"))
            elif len(self._edges) >= self.config.max_clients:
                raise HTTPError(
                    403, None, f"the run holds its max_clients={self.config.max_clients}"
                )
            else:
                cid, self._next_cid = self._next_cid, self._next_cid + 1
                self._devices[device] = cid
            edge = self._edges[cid] = _Edge(cid, device)
            self._joined.notify_all()
            return edge

    async def _next(self, request: Request) -> Response:
        try:
            edge = self._edge(request)
        except HTTPError as e:
            return self._refuse(e, request)
        deadline = time.monotonic() + self.config.poll_s
        while True:
            with self._lock:
                # Cleared under the lock, before looking: a message queued after the look
                # sets the event again (on this loop), so the wait below returns at once.
                edge.wake.clear()
                if self._done is not None:
                    edge.told = True
                    return Response(self._done_body, media_type="application/json")
                answer = edge.answer
                if edge.message is not None and answer is not None and not answer.done():
                    return Response(edge.body, media_type="application/json")
            left = deadline - time.monotonic()
            if left <= 0:
                return Response(status_code=204)
            try:
                await asyncio.wait_for(edge.wake.wait(), left)
            except asyncio.TimeoutError:
                pass
            edge.seen = time.monotonic()

    def _answer(self, raw: bytes, check: Callable[[Any], None]) -> Any:
        """The answer in `raw`, parsed, decoded and checked (in a worker thread), or
        HTTPError: 413 and 400 from the body's limits, 422 for anything else."""
        body = load(raw, self.limits)
        if not isinstance(body, dict) or "reply" not in body:
            raise HTTPError(422, None, 'give {"reply": <the answer>}')
        try:
            reply = decode(body["reply"], max_depth=self.limits.max_depth)
            check(reply)
        except Exception as e:  # decode and check raise ValueError; anything else is too
            raise HTTPError(422, None, f"{type(e).__name__}: {e}") from None
        return reply

    async def _reply(self, request: Request) -> Response:
        try:
            edge = self._edge(request)
            with self._lock:
                if edge.replying:  # its body stays unread: a client's answers cost one at a time
                    raise HTTPError(
                        429,
                        "TooManyRequests",
                        f"client {edge.cid}: an answer from this client is in flight already; "
                        "send one at a time and wait for its status",
                    )
                answer, check = edge.answer, edge.check
                if answer is None or answer.done() or check is None:
                    raise HTTPError(409, None, f"client {edge.cid}: no message waits for an answer")
                edge.replying = True
            try:
                await self._accept(request, edge, answer, check)
            finally:
                with self._lock:
                    edge.replying = False
        except HTTPError as e:
            return self._refuse(e, request)
        return JSONResponse({"ok": True})

    async def _accept(
        self,
        request: Request,
        edge: _Edge,
        answer: concurrent.futures.Future[Any],
        check: Callable[[Any], None],
    ) -> None:
        """Receive, parse and check `edge`'s answer, then hand it to the round driver; a
        refused answer drops the client from the step (BadUpdate), then raises HTTPError."""
        try:
            raw = await self._body(request, self.limits.max_bytes)
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(self._parsers, self._answer, raw, check)
        except ClientDisconnect:  # no answer arrived: it may still come, on a new connection
            raise HTTPError(400, None, f"client {edge.cid}: gone before its body ended") from None
        except HTTPError as e:
            reason = f"client {edge.cid}: {e}"
            _settle(answer, error=BadUpdate(reason))
            raise HTTPError(e.status, None, reason) from None
        except RuntimeError as e:  # the executor shut down: the run is over
            raise HTTPError(409, None, f"client {edge.cid}: the run is over ({e})") from None
        with self._lock:
            if edge.answer is answer:
                edge.message, edge.body = None, b""
        if not _settle(answer, result=reply):  # the round moved on meanwhile
            raise HTTPError(409, None, f"client {edge.cid}: the answer came too late")

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    def _app(self) -> Any:
        app = Starlette(
            routes=[
                Route("/v1/join", self._join, methods=["POST"]),
                Route("/v1/next", self._next, methods=["GET"]),
                Route("/v1/reply", self._reply, methods=["POST"]),
                Route("/healthz", self._health, methods=["GET"]),
            ]
        )
        # Every /v1 request carries the token, checked before its body is read.
        return BearerAuth(app, self.token, paths=("/v1/",), refused=self._log_refusal)
