"""Bearer tokens: the one check every raymesh server makes, as an ASGI middleware.

A request is allowed when it carries `Authorization: Bearer <token>`: the scheme in any case
(RFC 7235), the token compared in constant time (a wrong guess learns nothing from timing), a
non-ASCII header simply wrong. A refusal is a 401 in the shared error shape
(`raymesh._common.http_error`) with `WWW-Authenticate: Bearer`, its message naming the token
wanted and how to send it; the token itself is never in a message or a log.

A token is at least `MIN_TOKEN_CHARS` characters of printable ASCII (it travels in a header):
a short one can be guessed by a client that simply keeps trying. `check_token` is that rule,
for a config to refuse a bad token before anything starts (ValueError naming the field).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from raymesh._common.fields import bad
from raymesh._common.http_error import HTTPError

__all__ = ["MIN_TOKEN_CHARS", "BearerAuth", "BearerToken", "check_token"]

MIN_TOKEN_CHARS = 16


def check_token(field: str, token: object) -> str:
    """`token`, if it can be a bearer token; ValueError naming `field` (never the token's
    value) and the fix otherwise."""
    if not isinstance(token, str) or not token:
        raise bad(field, "<hidden>", "give a non-empty string, or None for no token")
    if not (token.isascii() and token.isprintable()) or token != token.strip():
        raise bad(
            field,
            "<hidden>",
            "give printable ASCII without spaces at either end (it travels in an HTTP header)",
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise bad(
            field,
            "<hidden>",
            f"the token has {len(token)} characters: give at least {MIN_TOKEN_CHARS} (a short "
            'one can be guessed), e.g. python -c "import secrets; print(secrets.token_urlsafe())"',
        )
    return token


class BearerToken:
    """One token's check. `what` names it in the 401's message ("the server's token"); a bad
    token is a ValueError naming `field` (see `check_token`)."""

    def __init__(self, token: str, what: str = "the server's token", field: str = "token") -> None:
        self._token = check_token(field, token).encode()
        self.what = what

    def allows(self, authorization: bytes | str) -> bool:
        """Whether an `Authorization` header's value carries this token."""
        if isinstance(authorization, bytes):
            try:
                authorization = authorization.decode("ascii")
            except UnicodeDecodeError:
                return False
        if not authorization.isascii():
            return False  # compare_digest refuses non-ASCII str; such a header is wrong anyway
        scheme, _, given = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token
        )

    def refusal(self) -> HTTPError:
        """The 401 for a request without this token."""
        return HTTPError(
            401,
            "Unauthorized",
            f"give {self.what}: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def check(self, scope: MutableMapping[str, Any]) -> None:
        """HTTPError 401 unless the ASGI request `scope` carries this token."""
        if not self.allows(_header(scope, b"authorization")):
            raise self.refusal()


class BearerAuth:
    """ASGI middleware: an HTTP request whose path starts with one of `paths` must carry
    `token` (None: no check); any other request passes untouched.

    refused: called with the request's scope and the 401 before it is sent (a server's log
    line: `RefusalLog`, its metrics). field: names the token in a ValueError."""

    def __init__(
        self,
        app: Any,
        token: str | None,
        *,
        paths: Sequence[str] = ("/",),
        what: str = "the server's token",
        refused: Callable[[MutableMapping[str, Any], HTTPError], None] | None = None,
        field: str = "token",
    ) -> None:
        self.app = app
        self.token = BearerToken(token, what, field) if token is not None else None
        self.paths = tuple(paths)
        self.refused = refused

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        token = self.token
        if (
            token is not None
            and scope["type"] == "http"
            and scope["path"].startswith(self.paths)
            and not token.allows(_header(scope, b"authorization"))
        ):
            error = token.refusal()
            if self.refused is not None:
                self.refused(scope, error)
            await error.send(send)
            return
        await self.app(scope, receive, send)


def _header(scope: MutableMapping[str, Any], name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
