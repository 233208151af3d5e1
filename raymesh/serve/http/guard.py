"""What every request passes before it is served: its bearer token (`raymesh._common.auth`),
and its JSON body read within a size limit and a deadline. raymesh's front and the Ray Serve
deployment (`backend="ray-serve"`) use the same `Guard`, so they refuse the same requests the
same way, in the shared error shape (`raymesh._common.http_error`).

Guarantees, for each request `read_json` is given:
- the body is counted while it streams in, and refused (413) as soon as it passes
  `max_body_bytes` (or at once when its Content-Length says it will), before any of it is
  decoded;
- the whole body must arrive within `body_timeout_s` of the first read, however the client
  paces its bytes (408: a client trickling a byte at a time cannot hold a request open);
- a 408 or 413 ends its connection (`Connection: close`), so the rest of a refused body is
  never waited for;
- what is decoded is a JSON object of finite numbers: NaN, Infinity and numbers that overflow
  to infinity (`1e400`) are malformed JSON (400), so no model ever sees them;
- it nests at most `MAX_DEPTH` levels (400 naming the top-level field that goes deeper): a
  body of 100000 `[` is refused, not a RecursionError and a 500.
Whether a finite number fits the model's dtype (3.5e38 is inf in float32) is the route's
check, which knows the field and the dtype (`raymesh.serve.http.inputs.check_range`).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.types import Receive, Scope

from raymesh._common import BearerToken, HTTPError

__all__ = ["MAX_DEPTH", "Guard", "HTTPError", "header"]

MAX_DEPTH = 64  # levels of nesting a body may have (an input of 60 dimensions still fits)


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case), or b""."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""


# On a refused body, the connection ends with the answer: uvicorn would otherwise read (and
# drop) the rest of the body, for as long as the client takes to send it.
_CLOSE = {"Connection": "close"}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"{text[:40]} is out of range (it overflows to infinity)")
    return value


class Guard:
    """The token check and the body reader of one server (see the module docstring).

    token: the bearer token requests must carry (None: no check). `what` names the token in
    the 401's message ("the server's token", "the admin token").
    """

    def __init__(
        self,
        *,
        token: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        what: str = "the server's token",
    ) -> None:
        self.token = BearerToken(token, what) if token else None
        self.limit = max_body_bytes
        self.timeout_s = body_timeout_s

    def authorize(self, scope: Scope) -> None:
        """HTTPError 401 unless the request carries `Authorization: Bearer <token>`."""
        if self.token is not None:
            self.token.check(scope)

    async def read_json(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        """The body as a JSON object; HTTPError 413 (too large), 408 (not in within
        `body_timeout_s`), 400 (not JSON, or a number that is not finite), 422 (not an object)
        otherwise."""
        length = header(scope, b"content-length")
        if length.isdigit() and int(length) > self.limit:
            raise HTTPError(
                413,
                "TooLarge",
                f"the body has {int(length)} bytes; the limit is {self.limit}",
                headers=_CLOSE,
            )
        # A deadline for the whole body, as asyncio.timeout does it (which Python 3.10 lacks,
        # and asyncio.wait_for would cost a task per request): cancel this task when it passes.
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.timeout_s, expire)
        try:
            raw = await self._body(receive)
        except asyncio.CancelledError:
            if not expired:
                raise  # cancelled from outside: not ours to turn into a 408
            if hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
            raise HTTPError(
                408,
                "Timeout",
                f"the body did not arrive within body_timeout_s={self.timeout_s:g}",
                headers=_CLOSE,
            ) from None
        finally:
            timer.cancel()
        try:
            body = json.loads(raw, parse_constant=_no_constants, parse_float=_finite)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise HTTPError(400, "MalformedJSON", f"the body is not valid JSON: {e}") from None
        except RecursionError:  # the parser's own stack: nested thousands of levels deep
            raise _too_deep(None) from None
        if not isinstance(body, dict):
            raise HTTPError(
                422, "ValidationError", f"the body must be a JSON object, not {type(body).__name__}"
            )
        # A body with few brackets cannot nest deeply: the walk is for the rare others.
        if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
            field = _deeper_than(body, MAX_DEPTH)
            if field is not None:
                raise _too_deep(field)
        return body

    async def _body(self, receive: Receive) -> bytes:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HTTPError(400, "Disconnected", "the client left before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise HTTPError(
                    413,
                    "TooLarge",
                    f"the body is over the limit of {self.limit} bytes",
                    headers=_CLOSE,
                )
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _too_deep(field: str | None) -> HTTPError:
    where = f"{field}: " if field is not None else "the body "
    return HTTPError(
        400,
        "MalformedJSON",
        f"{where}nests deeper than {MAX_DEPTH} levels of lists and objects",
        field=field,
    )


def _deeper_than(body: dict[str, Any], limit: int) -> str | None:
    """The top-level key whose value nests deeper than `limit` (the body itself is level 1),
    or None. Iterative: no recursion to exhaust; containers only are visited."""
    for key, value in body.items():
        stack = [(value, 2)]
        while stack:
            v, depth = stack.pop()
            if depth > limit:
                return str(key)[:100]
            if isinstance(v, dict):
                v = v.values()
            elif not isinstance(v, list):
                continue
            stack.extend((x, depth + 1) for x in v if isinstance(x, (list, dict)))
    return None
