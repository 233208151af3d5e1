"""`HTTPError`: a request refused, and the one shape every raymesh server answers it in.

    {"error": {"type": "Unauthorized", "message": "give the server's token: ...", "field": "x"}}

`type` is a stable word a client can branch on, `message` says what was wrong and the fix,
`field` (present only when one field is at fault) names it. raymesh.serve, raymesh.federated's
edge server and raymesh.dashboard answer every error this way.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["HTTPError", "error_json"]

# The `type` of a refusal given without one.
_TYPES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    408: "Timeout",
    409: "Conflict",
    413: "TooLarge",
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
