"""`HTTPError`: a request refused, and the one shape every raymesh server answers it in.

    {"error": {"type": "Unauthorized", "message": "give the server's token: ...", "field": "x"}}

`type` is a stable word a client can branch on, `message` says what was wrong and the fix,
`field` (present only when one field is at fault) names it. raymesh.serve, raymesh.federated's
edge server and raymesh.dashboard answer every error this way.

`RefusalLog` is the one way a server logs what it refused: a few lines per window, then a count
of the lines left out (a client sending refused requests in a loop cannot flood the log), and
what the client sent (its path, the refusal's message) with every control character escaped and
the path as sent, never %-decoded (a `%0a` in a path cannot start a forged log line).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

__all__ = ["HTTPError", "RefusalLog", "error_json", "printable"]

# The `type` of a refusal given without one.
_TYPES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    408: "Timeout",
    409: "Conflict",
    413: "TooLarge",
    421: "MisdirectedRequest",
    422: "ValidationError",
    500: "InternalError",
    503: "Unavailable",
    504: "Timeout",
}


class HTTPError(Exception):
    """A refusal: HTTP `status`, the JSON error `body` ({"type", "message", "field"}) and
    extra response `headers`. `type_name` None: the status's usual word ("NotFound")."""

    def __init__(
        self,
        status: int,
        type_name: str | None,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        kind = type_name or _TYPES.get(status, "Error")
        self.body: dict[str, Any] = {"type": kind, "message": message}
        if field is not None:
            self.body["field"] = field
        self.headers = headers

    def payload(self) -> dict[str, Any]:
        """The response's JSON: {"error": body}."""
        return {"error": self.body}

    async def send(self, send: Any) -> None:
        """Answer with this refusal on a plain ASGI `send` (no framework needed)."""
        data = error_json(self)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        for key, value in (self.headers or {}).items():
            headers.append((key.lower().encode(), value.encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def error_json(error: HTTPError) -> bytes:
    """The response body of `error`, as compact JSON."""
    return json.dumps(error.payload(), ensure_ascii=False, separators=(",", ":")).encode()


def printable(text: bytes | str, limit: int = 200) -> str:
    """`text` for a log line: printable ASCII kept, every other character (control
    characters, a backslash, non-ASCII) escaped as `\\xNN`/`\\uNNNN`, cut to `limit` characters."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    cut = len(text) > limit
    out = "".join(c if " " <= c <= "~" and c != "\\" else _escape(c) for c in text[:limit])
    return out + "..." if cut else out


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class RefusalLog:
    """Logs each refused request as one WARNING line on `logger`, prefixed with `server`:
    at most `lines` in each `window_s`; past that, a count of the lines left out, logged with
    the first line of a later window. A server passes it where it refuses (BearerAuth's
    `refused`, its own handlers)."""

    def __init__(
        self,
        logger: logging.Logger,
        server: str,
        *,
        lines: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.server = server
        self.lines = lines
        self.window_s = window_s
        self.clock = clock
        self._window_end = float("-inf")
        self._logged = 0
        self.suppressed = 0  # lines left out in this window (and not yet counted in the log)

    def __call__(self, scope: MutableMapping[str, Any], error: HTTPError) -> None:
        now = self.clock()
        if now >= self._window_end:
            if self.suppressed:
                self.logger.warning(
                    "%s: %d more refused requests were not logged (at most %d lines per %gs)",
                    self.server,
                    self.suppressed,
                    self.lines,
                    self.window_s,
                )
            self._window_end, self._logged, self.suppressed = now + self.window_s, 0, 0
        if self._logged >= self.lines:
            self.suppressed += 1
            return
        self._logged += 1
        client = scope.get("client")
        # raw_path: the path as the client sent it (ASGI's `path` is %-decoded).
        path = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "replace")
        self.logger.warning(
            "%s: refused %s %s from %s: %d %s",
            self.server,
            printable(scope.get("method") or "-", 20),
            printable(path),
            printable(str(client[0]) if client else "?", 60),
            error.status,
            printable(str(error)),
        )
